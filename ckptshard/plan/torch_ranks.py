"""Plans for torch FSDP2's per-rank files at another world size: what rank r of N holds, from the M files.

Each DTensor's rows are re-cut as FSDP2 at N cuts them (``torch.chunk``
along its shard dimension) and each new piece is planned as the runs of the
old pieces it covers; replicated DTensors, plain tensors (buffers) and
other values are rank 0's, as torch's full state dict takes them. A tie
(one DTensor under two names) stays one object. Optimizer state is planned
by optimizer id, the same way: FSDP2 moments are DTensors like their
parameters, ``step`` is a plain tensor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..layout.dim_shards import chunk_sizes, local_shape, row_runs
from ..layout.fsdp1_flat import FlatUnits, find_units, same_at
from ..read.torch_ranks import TorchRanks, assemble
from ..tensors import DTensorFill, DTensorRef, Fill, TensorRef, sources_in, whole


def _piece(full: Fill, first: DTensorRef, world: int, rank: int) -> DTensorFill:
    kind, dim = first.placements[0]
    if kind == "replicate":
        return DTensorFill(full, tuple(first.shape), first.placements, first.sharded_tensor)
    sizes = chunk_sizes(first.shape[dim], world)
    start = sum(sizes[:rank])
    sources = []
    for whole_at, piece_at, length in row_runs(first.shape, dim, start, sizes[rank]):
        sources.extend(sources_in(full, whole_at, whole_at + length, piece_at))
    local = Fill(local_shape(first.shape, dim, sizes[rank]), first.dtype, tuple(sources))
    return DTensorFill(local, tuple(first.shape), first.placements, first.sharded_tensor)


Wholes = Dict[Any, Fill]  # each DTensor's whole, by its rank-0 piece: assembled once for every output rank


class _Planner:
    """Re-cuts DTensors for one rank, a tie planned once; ``wholes`` may be shared by the ranks' planners."""

    def __init__(self, world: int, rank: int, wholes: Optional[Wholes] = None) -> None:
        self.world, self.rank = world, rank
        self.wholes: Wholes = {} if wholes is None else wholes
        self.done: Dict[Any, DTensorFill] = {}

    def dtensor(self, pieces: Sequence[DTensorRef]) -> DTensorFill:
        first = pieces[0]
        key = first.tie_key or id(first)
        if key not in self.done:
            if key not in self.wholes:
                self.wholes[key] = assemble(pieces)
            self.done[key] = _piece(self.wholes[key], first, self.world, self.rank)
        return self.done[key]

    def value(self, values: Sequence[Any]) -> Any:
        v = values[0]
        if isinstance(v, DTensorRef):
            return self.dtensor(values)
        if isinstance(v, TensorRef):
            return whole(v)
        return v


def resharded_model(ranks: TorchRanks, world: int, rank: int, wholes: Optional[Wholes] = None) -> Dict[str, Any]:
    """Rank ``rank`` of ``world``'s ``model.state_dict()``; ``wholes``: a cache kept across ranks."""
    plan = _Planner(world, rank, wholes)
    return {name: plan.value([sd[name] for sd in ranks.models]) for name in ranks.models[0]}


def resharded_optimizer(ranks: TorchRanks, world: int, rank: int, wholes: Optional[Wholes] = None) -> Dict[str, Any]:
    """Rank ``rank`` of ``world``'s ``optimizer.state_dict()``; ``wholes``: a cache kept across ranks."""
    assert ranks.optims is not None
    plan = _Planner(world, rank, wholes)
    first = ranks.optims[0]
    state: Dict[Any, Dict[str, Any]] = {}
    for pid, entry in first["state"].items():
        state[pid] = {k: plan.value([o["state"][pid][k] for o in ranks.optims]) for k in entry}
    return _optimizer_file(first, state)


def _optimizer_file(first: Dict[str, Any], state: Dict[Any, Dict[str, Any]]) -> Dict[str, Any]:
    """An ``optimizer.state_dict()`` of ``state``, its param groups and other keys rank 0's."""
    others = {k: v for k, v in first.items() if k not in ("state", "param_groups")}
    return {**others, "state": state, "param_groups": [dict(g) for g in first["param_groups"]]}


def fsdp1_units(ranks: TorchRanks, world: int) -> Tuple[FlatUnits, List[Tuple[int, str]], List[int]]:
    """How the FSDP1 checkpoint's parameters were grouped into units (and aligned), as its optimizer slices
    show, with the (id, name) pairs and element counts they were told from; refused where no grouping or
    several that differ at ``world`` ranks fit them."""
    pairs, numels, seen = ranks.fsdp1_slices()
    names = [name for _, name in pairs]
    found = find_units(names, numels, seen, ranks.world_size)
    where = (ranks.files.optim or ("",))[0]
    if not found:
        raise CheckpointError(
            f"{where}: the FSDP1 optimizer slices fit no grouping of the parameters into FSDP units by module "
            "(the root and up to two module kinds, e.g. model.layers.*) at 2-, 4- or 8-element alignment: "
            "resharding them would guess; convert --to dcp and load that at the new world size"
        )
    chosen = same_at(found, numels, world)
    if chosen is None:
        shown = "; ".join(f"units {', '.join(c.wrapped) or 'root only'}, align {c.align}" for c in found[:3])
        why = " (at world size 1 the slices show no grouping)" if ranks.world_size == 1 else ""
        raise CheckpointError(
            f"{where}: {len(found)} FSDP unit groupings fit the optimizer slices{why} and they cut the "
            f"parameters differently at {world} ranks ({shown}): convert --to dcp and load that instead"
        )
    return chosen, pairs, numels


class Fsdp1Optimizer:
    """FSDP1's raw ``optimizer.state_dict()`` of rank r of N (``use_orig_params=True``): each parameter's
    moments sliced as its unit's flat parameter at N cuts it, ``step`` as stored, param groups rank 0's."""

    def __init__(self, ranks: TorchRanks, world: int) -> None:
        assert ranks.optims is not None
        self.ranks, self.world = ranks, world
        if world == 1:  # NO_SHARD: each moment whole, in its parameter's shape
            self.pairs = ranks.optimizer_ids()
        else:
            units, self.pairs, numels = fsdp1_units(ranks, world)
            self.at_n = units.slices(numels, world)
        self.full = {pid: ranks.fsdp1_entry(pid, name) for pid, name in self.pairs}

    def rank(self, rank: int) -> Dict[str, Any]:
        assert self.ranks.optims is not None
        state: Dict[Any, Dict[str, Any]] = {}
        if self.world == 1:
            state = {pid: entry for pid, _ in self.pairs if (entry := self.full[pid]) is not None}
            return _optimizer_file(self.ranks.optims[0], state)
        for (pid, _), slices in zip(self.pairs, self.at_n):
            entry = self.full[pid]
            if entry is None or rank not in slices:
                continue  # FSDP1 keeps no state where a rank holds none of the parameter
            start, count = slices[rank]
            state[pid] = {k: self._slice(v, start, count) for k, v in entry.items()}
        return _optimizer_file(self.ranks.optims[0], state)

    @staticmethod
    def _slice(v: Any, start: int, count: int) -> Any:
        """A moment's flat elements ``[start, start + count)``; ``step`` (0-d) and other values as they are."""
        if isinstance(v, Fill) and v.shape:
            return Fill((count,), v.dtype, sources_in(v, start, start + count))
        return v

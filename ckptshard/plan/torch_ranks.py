"""Plans for torch FSDP2's per-rank files at another world size: what rank r of N holds, from the M files.

Each DTensor's rows are re-cut as FSDP2 at N cuts them (``torch.chunk``
along the dimension its placement rule picks at N: ``plan.placement``) and each new piece is planned as the runs of the
old pieces it covers; replicated DTensors, plain tensors (buffers) and
other values are rank 0's, as torch's full state dict takes them. A tie
(one DTensor under two names) stays one object. Optimizer state is planned
by optimizer id, the same way: FSDP2 moments are DTensors like their
parameters, ``step`` is a plain tensor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..formats.torch_distributed import MeshPlace
from ..layout.dim_shards import chunk_sizes, local_shape, row_runs
from ..layout.fsdp1_flat import ALIGNS, FlatUnits, Slices, find_units, flat_offsets, same_at
from ..read.fsdp1_local import flat_prefix
from ..read.rank_pieces import assemble, rank_slices
from ..read.torch_ranks import TorchRanks
from ..tensors import DTensorFill, DTensorRef, Fill, TensorRef, sources_in, whole
from ..tree import map_leaves
from .placement import Placed, choose_rule, rule_dim


def _piece(full: Fill, first: DTensorRef, world: int, rank: int, rule: str = "keep") -> DTensorFill:
    kind, kept = first.placements[0]
    if kind == "replicate":
        return DTensorFill(
            full, tuple(first.shape), first.placements, first.sharded_tensor, first.requires_grad, first.pickled
        )
    dim = kept if first.sharded_tensor else rule_dim(rule, first.shape, world, kept)  # FSDP1: always dim 0
    placements = ((kind, dim), *first.placements[1:])
    sizes = chunk_sizes(first.shape[dim], world)
    start = sum(sizes[:rank])
    sources = []
    for whole_at, piece_at, length in row_runs(first.shape, dim, start, sizes[rank]):
        sources.extend(sources_in(full, whole_at, whole_at + length, piece_at))
    local = Fill(local_shape(first.shape, dim, sizes[rank]), first.dtype, tuple(sources))
    return DTensorFill(local, tuple(first.shape), placements, first.sharded_tensor, first.requires_grad, first.pickled)


Wholes = Dict[Any, Fill]  # each DTensor's whole, by its rank-0 piece: assembled once for every output rank


class _Planner:
    """Re-cuts DTensors for one rank, a tie planned once; ``wholes`` may be shared by the ranks' planners."""

    def __init__(self, world: int, rank: int, wholes: Optional[Wholes] = None, rule: str = "keep") -> None:
        self.world, self.rank, self.rule = world, rank, rule
        self.wholes: Wholes = {} if wholes is None else wholes
        self.done: Dict[Any, DTensorFill] = {}

    def dtensor(self, pieces: Sequence[DTensorRef]) -> DTensorFill:
        first = pieces[0]
        key = first.tie_key or id(first)
        if key not in self.done:
            if key not in self.wholes:
                self.wholes[key] = assemble(pieces)
            self.done[key] = _piece(self.wholes[key], first, self.world, self.rank, self.rule)
        return self.done[key]

    def value(self, values: Sequence[Any]) -> Any:
        v = values[0]
        if isinstance(v, DTensorRef):
            return self.dtensor(values)
        if isinstance(v, TensorRef):
            return whole(v)
        return v


def resharded_model(
    ranks: TorchRanks, world: int, rank: int, wholes: Optional[Wholes] = None, rule: str = "keep"
) -> Dict[str, Any]:
    """Rank ``rank`` of ``world``'s ``model.state_dict()``, each DTensor sharded on the dimension ``rule`` picks
    (``plan.placement``); ``wholes``: a cache kept across ranks."""
    plan = _Planner(world, rank, wholes, rule)
    return {name: plan.value([sd[name] for sd in ranks.models]) for name in ranks.models[0]}


def resharded_optimizer(
    ranks: TorchRanks, world: int, rank: int, wholes: Optional[Wholes] = None, rule: str = "keep"
) -> Dict[str, Any]:
    """Rank ``rank`` of ``world``'s ``optimizer.state_dict()``, each moment placed as its parameter (``rule``);
    ``wholes``: a cache kept across ranks."""
    assert ranks.optims is not None
    plan = _Planner(world, rank, wholes, rule)
    first = ranks.optims[0]
    state: Dict[Any, Dict[str, Any]] = {}
    for pid, entry in first["state"].items():
        state[pid] = {k: plan.value([o["state"][pid][k] for o in ranks.optims]) for k in entry}
    return _optimizer_file(first, state)


def shard_group(ranks: TorchRanks, world: int, group: Optional[int]) -> int:
    """The ranks each parameter is sharded over at ``world`` (``--shard-group``): ``world`` for FSDP2, fewer
    for HSDP (``world // group`` replicas, verl's ``fsdp_size``). By default an HSDP source's own group size,
    else ``world``."""
    where = ranks.files.folder
    if group is None:
        if ranks.hsdp is None:
            return world
        group = ranks.hsdp[1]
        if world % group:
            raise CheckpointError(
                f"{where}: HSDP files sharded over groups of {group} ranks, and {world} ranks are not a multiple "
                f"of {group}: pass --shard-group (the ranks a parameter is sharded over; {world} for no replicas)"
            )
        return group
    if group < 1 or world % group:
        raise CheckpointError(f"--shard-group {group} does not divide --world-size {world}")
    if group < world and ranks.kind != "fsdp2":
        raise CheckpointError(f"{where}: FSDP1 files; --shard-group below the world size (HSDP) is FSDP2's")
    return group


def placement_rule(ranks: TorchRanks, group: int, given: Optional[str]) -> str:
    """The rule FSDP2 placed the source's DTensors by (``plan.placement``), for shard groups of ``group``
    ranks; ``keep`` for FSDP1 files, which shard dim 0 whatever the rule."""
    if ranks.kind != "fsdp2":
        if given not in (None, "keep", "dim0"):
            raise CheckpointError(f"{ranks.files.folder}: FSDP1 files shard dim 0: --placement {given} is FSDP2's")
        return "keep"
    placed: List[Placed] = [
        (name, tuple(v.shape), v.placements[0][1])
        for name, v in ranks.models[0].items()
        if isinstance(v, DTensorRef) and v.placements[0][0] == "shard"
    ]
    source_group = ranks.hsdp[1] if ranks.hsdp is not None else ranks.world_size
    return choose_rule(placed, source_group, group, given, ranks.files.folder) if placed else "keep"


class TargetMesh:
    """The device mesh FSDP2 at ``world`` ranks keeps rank r's DTensors on: 1-D, or HSDP's
    ``(world // group, group)``, replicated over the first dimension and sharded over the second, where
    rank r holds piece ``r % group``. Its dimensions are named ``names``, which must be the names the
    training code gives its mesh (torch refuses to load a DTensor into a parameter of another mesh);
    by default the source's (a 1-D source's name second under a new ``"ddp"``, as verl names them; an
    HSDP source's second alone for a 1-D mesh)."""

    def __init__(self, ranks: TorchRanks, world: int, group: int, names: Optional[Sequence[str]] = None) -> None:
        self.world, self.group, self.replicas = world, group, world // group
        dims = 2 if self.replicas > 1 else 1
        if names is not None:
            if len(names) != dims or not all(names):
                raise CheckpointError(
                    f"--mesh-dim-names {','.join(names)}: the mesh at {world} ranks has {dims} dimension(s) "
                    f"({'replicas, shards' if dims == 2 else 'shards'})"
                )
            if len(set(names)) != len(names):
                raise CheckpointError(f"--mesh-dim-names {','.join(names)}: a device mesh's names must differ")
            self.dim_names: Optional[Tuple[str, ...]] = tuple(names)
            return
        first = next((v for v in ranks.models[0].values() if isinstance(v, DTensorRef)), None)
        from ..formats.dtensor_pickle import mesh_dim_names  # here: torch FSDP sources only

        kept = mesh_dim_names(first.pickled) if first is not None else None
        if dims == 1:
            self.dim_names = kept[-1:] if kept else None
        else:
            self.dim_names = kept if kept and len(kept) == 2 else ("ddp", kept[-1]) if kept else None

    def shard_rank(self, rank: int) -> int:
        return rank % self.group

    def place(self, rank: int) -> MeshPlace:
        return MeshPlace(self.world, rank, (self.replicas, self.group) if self.replicas > 1 else (), self.dim_names)

    def placed(self, tree: Any) -> Any:
        """``tree``'s DTensors of one shard group, replicated over HSDP's first mesh dimension (a tie stays
        one object); as it is without replicas."""
        if self.replicas == 1:
            return tree
        done: Dict[int, DTensorFill] = {}

        def put(x: Any) -> Any:
            if not isinstance(x, DTensorFill):
                return x
            if id(x) not in done:
                done[id(x)] = replace(x, placements=(("replicate", -1), *x.placements))
            return done[id(x)]

        return map_leaves(tree, put)


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


class _UnitLayout(NamedTuple):
    """One FSDP unit of a LOCAL_STATE_DICT, as :class:`LocalReshard` re-cuts it."""

    names: List[str]  # its parameters in flat order, a tie once
    total: int  # elements before world-size padding: the source's first ``total`` are the flat parameter at N
    size: int  # the flat parameter's size at N
    at_n: Optional[List[Slices]]  # use_orig_params: each parameter's slice on each rank of N (else None)
    pad: Optional[int]  # an element of the source's padding, copied into the padding added at N


class LocalReshard:
    """FSDP1's LOCAL_STATE_DICT files of rank r of N: each unit's flat parameter as FSDP1 at N holds it (a
    ShardedTensor of this rank's chunk) and, under ``use_orig_params``, each parameter's 1-D slice in it.

    The units are the files' flat parameters, their parameters ``like``'s (``LocalStateDict.units``).
    Without ``use_orig_params`` a flat parameter is its parameters end to end, cut as ``torch.chunk``
    cuts it. With it, each parameter is aligned to ``align`` elements and the whole padded to a multiple of
    the world size; the alignment is the one of 4, 8 or 2 elements that gives every rank's slices at M
    exactly (``FlatUnits``), refused where none does or two cut differently at N.
    """

    def __init__(self, ranks: TorchRanks, world: int) -> None:
        assert ranks.local is not None
        self.ranks, self.world = ranks, world
        self.full = ranks.local.full_model()
        self.units = ranks.local.units()
        self.layouts = {prefix: self._layout(prefix, names) for prefix, (names, _) in self.units.items()}

    def _layout(self, prefix: str, names: List[str]) -> _UnitLayout:
        local, M, N = self.ranks.local, self.ranks.world_size, self.world
        assert local is not None
        flat = local.flats[prefix]
        numels = [self.full[n].numel for n in names]
        if not (names and names[0] in self.ranks.models[0]):  # end to end; LocalStateDict checked the size
            return _UnitLayout(names, flat.numel, flat.numel, None, None)
        seen = [{r: (s.dst_start, s.length) for r, s in rank_slices([sd[n] for sd in self.ranks.models])[0].items()}
                for n in names]  # fmt: skip
        members = (tuple(range(len(names))),)
        fits = [
            units
            for units in (FlatUnits(members, align, ()) for align in ALIGNS)
            if -(-flat_offsets(numels, units.align)[1] // M) * M == flat.numel and units.slices(numels, M) == seen
        ]
        unit = f"{prefix}_flat_param"
        if not fits:
            raise CheckpointError(
                f"{self.ranks.files.model[0]}: {unit} and its parameters' slices fit no 2-, 4- or 8-element "
                "alignment of the parameters --like puts in it: not this model's files"
            )
        totals = {flat_offsets(numels, units.align)[1] for units in fits}
        if len(totals) > 1 or same_at(fits, numels, N) is None:
            raise CheckpointError(
                f"{self.ranks.files.model[0]}: {unit}'s slices fit several alignments that cut it differently "
                f"at {N} ranks: convert --to dcp --like and load that instead"
            )
        offsets, total = flat_offsets(numels, fits[0].align)
        pad = _padding_at(offsets, numels, flat.numel)
        return _UnitLayout(names, total, -(-total // N) * N, fits[0].slices(numels, N), pad)

    def rank(self, rank: int) -> Dict[str, Any]:
        """Rank ``rank``'s ``model.state_dict()`` under LOCAL_STATE_DICT, in the source files' order.

        A parameter's place in its flat parameter does not depend on the world size, so the first elements
        of the flat parameter at N, padding between parameters included, are the source's. Padding added
        for the new world size holds what the source's padding holds (FSDP1 fills padding with one value).
        """
        local = self.ranks.local
        assert local is not None
        flat_keys = {flat_prefix(k): k for k in self.ranks.models[0] if flat_prefix(k) is not None}
        out: Dict[str, Any] = {}
        for prefix, unit in self.layouts.items():
            flat = local.flats[prefix]
            sizes = chunk_sizes(unit.size, self.world)
            start = sum(sizes[:rank])
            stop = start + sizes[rank]
            sources = list(sources_in(flat, start, min(stop, unit.total)))
            if unit.pad is not None:
                for at in range(max(start, unit.total), stop):
                    sources.extend(sources_in(flat, unit.pad, unit.pad + 1, at - start))
            if unit.at_n is not None:  # this rank's elements of each parameter, none if it holds none
                for name, slices in zip(unit.names, unit.at_n):
                    param = self.full[name]
                    first, count = slices.get(rank, (0, 0))
                    out[name] = Fill((count,), param.dtype, sources_in(param, first, first + count))
                for twin, name in self.units[prefix][1].items():
                    out[twin] = out[name]
            piece = Fill((sizes[rank],), flat.dtype, tuple(sources))
            source = self.ranks.models[0][flat_keys[prefix]]
            out[flat_keys[prefix]] = DTensorFill(
                piece, (unit.size,), (("shard", 0),), True, source.requires_grad, source.pickled
            )
        for name, v in self.ranks.models[0].items():
            if name not in out:  # a buffer, whole; another value as it is
                out[name] = self.full[name] if isinstance(v, TensorRef) else v
        return {name: out[name] for name in self.ranks.models[0]}

    def optimizer(self, rank: int) -> Dict[str, Any]:
        """Rank ``rank``'s raw ``optimizer.state_dict()`` beside these files at N.

        Under ``use_orig_params`` each parameter's moments are cut as its slice of the flat parameter at N
        (a rank holding none of it has no entry), as for SHARDED_STATE_DICT files. Without it, each flat
        parameter's moments are the flat parameter's size padded to a multiple of N, this rank's shard of
        them: the source's elements, the padding zero (elements no source covers are written as zeros).
        """
        ranks, local = self.ranks, self.ranks.local
        assert ranks.optims is not None and local is not None
        state: Dict[Any, Dict[str, Any]] = {}
        if local.orig_params:
            at_n = {n: s for unit in self.layouts.values() for n, s in zip(unit.names, unit.at_n or ())}
            for pid, name in ranks.optimizer_ids():
                entry = ranks.fsdp1_entry(pid, name)
                if entry is not None and rank in at_n[name]:
                    start, count = at_n[name][rank]
                    state[pid] = {k: Fsdp1Optimizer._slice(v, start, count) for k, v in entry.items()}
            return _optimizer_file(ranks.optims[0], state)
        for pid, key in ranks.optimizer_ids():
            unit = self.layouts[flat_prefix(key)]  # type: ignore[index]
            shard = -(-unit.total // self.world)
            start = shard * rank
            stop = min(start + shard, unit.total)
            state[pid] = {
                k: Fill((shard,), v.dtype, sources_in(v, start, stop)) if isinstance(v, Fill) and v.shape else v
                for k, v in ranks.flat_moments(pid, key).items()
            }
        return _optimizer_file(ranks.optims[0], state)


def _padding_at(offsets: List[int], numels: List[int], size: int) -> Optional[int]:
    """An element of a flat parameter of ``size`` that no parameter covers, if any."""
    at = 0
    for offset, n in zip(offsets, numels):
        if offset > at:
            return at
        at = offset + n
    return at if at < size else None

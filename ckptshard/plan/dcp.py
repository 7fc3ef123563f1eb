"""Plan torch.distributed.checkpoint (DCP) checkpoints. Pure: no I/O.

What ckptshard writes is what ``dcp.save`` writes for::

    {"model": get_model_state_dict(model),
     "optim": get_optimizer_state_dict(model, optim),
     "extra": ...}   # the source container's other keys (rank 0's), e.g. fairseq's cfg

so a torch FSDP2 (``fully_shard``) model at any world size loads it with
``dcp.load`` and ``set_model_state_dict``/``set_optimizer_state_dict``.
Optimizer state is keyed by parameter name (one entry per logical
parameter, tensors in the parameter's shape, ``step`` a 0-dim tensor), as
torch's distributed state-dict API has it.

A logical tensor spanning several fairscale shards becomes several DCP
chunks: each contiguous run of one shard is split into the few boxes that
cover it (:func:`ckptshard.layout.boxes.flat_range_boxes`); nothing is
gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..errors import CheckpointError
from ..formats.dcp_state import flatten_state_dict
from ..layout.boxes import Shape, flat_index, flat_range_boxes
from ..read.source import ShardedCheckpoint
from ..tensors import Fill, Source, TensorRef, as_fill, is_tensor, numel, whole, with_fills
from ..tree import copy_tree, get_path, set_path
from .consolidate import member_sources
from .optimizer import check_optimizer

MODEL, OPTIM, EXTRA = "model", "optim", "extra"


@dataclass(frozen=True, eq=False)
class Chunk:
    """One DCP chunk: a box of a logical tensor and where its elements come from."""

    offsets: Shape
    sizes: Shape
    fill: Fill  # shape == sizes


def chunks_of(fill: Fill) -> List[Chunk]:
    """Chunks covering every element of ``fill`` exactly once: one box per
    contiguous source run, zero-filled boxes for elements no source covers."""
    shape = tuple(fill.shape)
    if fill.numel == 0:
        return [Chunk((0,) * len(shape), shape, Fill(shape, fill.dtype, ()))]
    out: List[Chunk] = []

    def add(start: int, stop: int, src: Optional[Source]) -> None:
        for offsets, sizes in flat_range_boxes(shape, start, stop):
            first = flat_index(shape, offsets)
            n = numel(sizes)
            sources = () if src is None else (Source(src.ref, src.src_start + first - src.dst_start, 0, n),)
            out.append(Chunk(offsets, sizes, Fill(sizes, fill.dtype, sources)))

    pos = 0
    for s in sorted((s for s in fill.sources if s.length), key=lambda s: s.dst_start):
        if s.dst_start < pos:
            raise AssertionError("overlapping sources in one planned tensor")
        add(pos, s.dst_start, None)
        add(s.dst_start, s.dst_start + s.length, s)
        pos = s.dst_start + s.length
    add(pos, fill.numel, None)
    return out


@dataclass(frozen=True, eq=False)
class TensorEntry:
    fill: Fill
    chunks: List[Chunk]  # shared by the names of one tied tensor


@dataclass
class DcpPlan:
    """A nested state dict flattened as DCP flattens it, every tensor cut into chunks."""

    entries: Dict[str, Any]  # flat name -> TensorEntry, or a non-tensor value
    mapping: Dict[str, Any]  # flat name -> path in the nested dict (DCP's planner_data)

    @property
    def nbytes(self) -> int:
        """Tensor bytes to copy, tied tensors once."""
        seen: Dict[int, int] = {}
        for e in self.entries.values():
            if isinstance(e, TensorEntry):
                seen[id(e.fill)] = sum(c.fill.nbytes for c in e.chunks)
        return sum(seen.values())


def plan_dcp(tree: Mapping[str, Any]) -> DcpPlan:
    """Flatten ``tree`` as ``dcp.save`` does, and cut every tensor into chunks (a tie's chunks are shared)."""
    flat, mapping = flatten_state_dict(tree)
    by_fill: Dict[int, List[Chunk]] = {}
    entries: Dict[str, Any] = {}
    for name, value in flat.items():
        if is_tensor(value):
            fill = as_fill(value)
            if id(fill) not in by_fill:
                by_fill[id(fill)] = chunks_of(fill)
            entries[name] = TensorEntry(fill, by_fill[id(fill)])
        else:
            entries[name] = value
    return DcpPlan(entries, dict(mapping))


NameMap = Callable[[str], Optional[str]]  # new name, or None to drop


def fsdp2_optimizer(ckpt: ShardedCheckpoint, rename: NameMap = lambda n: n) -> Dict[str, Any]:
    """The optimizer state as ``get_optimizer_state_dict`` gives it for the same model under FSDP2.

    ``state`` is keyed by parameter name; moments are in the parameter's
    shape (fairscale's flat, padded shards re-cut per parameter), 0-dim
    values such as ``step`` come from rank 0 and are shared by the members
    of one flat parameter. ``param_groups`` list parameter names.
    """
    all_flat = ckpt.layout.flat_params()
    flat = [all_flat[j] for j in check_optimizer(ckpt, by_name=True)]  # index = optimizer id; frozen: none
    M = ckpt.world_size
    osds = [ckpt.optimizer_state(r) for r in range(M)]
    state: Dict[str, Dict[str, Any]] = {}
    names_of: Dict[int, List[str]] = {}
    for lid, (part, inst, fp) in enumerate(flat):
        names = [rename(part.prefix + inst.logical_name(m.name)) for m in fp.members]
        names_of[lid] = [n for n in names if n is not None]
        entry = osds[0]["state"].get(lid)
        if entry is None:
            continue
        scalars = {k: whole(v) for k, v in entry.items() if isinstance(v, TensorRef) and len(v.shape) == 0}
        for m, name in zip(fp.members, names):
            if name is None:
                continue
            s: Dict[str, Any] = {}
            for k, v in entry.items():
                if k in scalars:
                    s[k] = scalars[k]
                elif isinstance(v, TensorRef):
                    refs = [osds[r]["state"][lid][k] for r in range(M)]
                    s[k] = Fill(m.shape, v.dtype, member_sources(refs, inst, fp, m))
                else:
                    s[k] = v
            state[name] = s
    groups = []
    for g in osds[0]["param_groups"]:
        new = {k: copy_tree(v) for k, v in g.items() if k != "params"}
        new["params"] = [n for lid in g["params"] for n in names_of[lid]]
        groups.append(new)
    return {"state": state, "param_groups": groups}


def container_extra(ckpt: ShardedCheckpoint) -> Dict[str, Any]:
    """Rank 0's container without weights, FSDP metadata and optimizer state/param_groups.

    What is left (fairseq's cfg and training progress, VISSL's phase,
    fairseq's loss_scale) is carried, as consolidating does.
    """
    tree = copy_tree(ckpt.objs[0])
    for spec in ckpt.container.parts:
        set_path(tree, spec.weights, {})
        set_path(tree, spec.metadata, {})
    if ckpt.container.optimizer is not None:
        opt = get_path(tree, ckpt.container.optimizer)
        for k in ("state", "param_groups"):
            opt.pop(k, None)
    return with_fills(tree)


def fairscale_to_dcp(
    ckpt: ShardedCheckpoint, weights: Mapping[str, Fill], optimizer: bool, rename: NameMap = lambda n: n
) -> Dict[str, Any]:
    """The nested state dict to store: model weights (already selected, renamed and cast), optimizer, extra.

    Instances whose ranks each hold their own parameters
    (``no_broadcast_optim_state``, e.g. MoE experts) are refused: a DCP name
    has one value, and keeping rank 0's would drop the others silently.
    """
    per_rank = ckpt.layout.per_rank_instances()
    if per_rank and ckpt.world_size > 1:
        raise CheckpointError(
            f"{per_rank[0]}: each rank holds its own parameters (no_broadcast_optim_state, e.g. MoE experts): "
            "DCP stores one value per name, so they cannot be converted"
        )
    tree: Dict[str, Any] = {MODEL: dict(weights)}
    if optimizer:
        if ckpt.container.optimizer is None:
            raise CheckpointError("the shards hold no optimizer state")
        tree[OPTIM] = fsdp2_optimizer(ckpt, rename)
    tree[EXTRA] = container_extra(ckpt)
    return tree


def fairscale_full_optimizer(ckpt: ShardedCheckpoint, optim: Mapping[str, Any]) -> Dict[str, Any]:
    """fairscale's full optimizer format (``gather_full_optim_state_dict``) from an FSDP2-style one.

    ``optim`` is keyed by parameter name (as :func:`fsdp2_optimizer` writes,
    or ``get_optimizer_state_dict`` gives); the result numbers parameters
    in ``ckpt``'s flat order, so ``sharded_optimizer_from_full`` can cut it
    for any world size. The members of one flat parameter have state all
    or none (none: a stateless optimizer such as SGD without momentum, or
    a parameter not stepped yet), and all state names a parameter; a flat
    parameter the optimizer neither lists nor holds state for is frozen
    and gets no optimizer id. Optimizer ids follow the flat order with one
    param group, and the order the groups list parameters in with several
    (as torch numbers them), each group then listing its global ids.
    """
    if not isinstance(optim, Mapping) or "state" not in optim or "param_groups" not in optim:
        raise CheckpointError("optimizer state lacks 'state' or 'param_groups'")
    groups = optim["param_groups"]
    names_of = [
        [part.prefix + inst.logical_name(m.name) for m in fp.members] for part, inst, fp in ckpt.layout.flat_params()
    ]
    stray = sorted(set(optim["state"]) - {n for names in names_of for n in names})
    if stray:
        raise CheckpointError(
            f"optimizer state for {', '.join(map(str, stray[:4]))}, which the model has no parameter of"
        )
    # The flat parameter of each optimizer id: model order with one group, the groups' listed order with several.
    per_group = _group_flat_params(names_of, groups) if len(groups) > 1 else []
    if per_group:
        order = [j for js in per_group for j in js]
        unlisted = [
            names[0]
            for j, names in enumerate(names_of)
            if j not in set(order) and any(n in optim["state"] for n in names)
        ]
        if unlisted:
            raise CheckpointError(f"optimizer state for {', '.join(unlisted[:4])}, which no param group lists")
    else:
        listed = set(groups[0].get("params", [])) if groups else set()
        order = [j for j, names in enumerate(names_of) if any(n in optim["state"] or n in listed for n in names)]
    lid_of = {j: lid for lid, j in enumerate(order)}
    state: Dict[int, Any] = {}
    id_map: Dict[int, Optional[int]] = {}
    gids_of: Dict[int, List[int]] = {}
    missing: List[str] = []
    gid = 0
    for j, names in enumerate(names_of):
        lid = lid_of.get(j)  # None: frozen, not in the optimizer at all; its members keep their global ids
        stateless = not any(n in optim["state"] for n in names)  # its entry holds no state in torch either
        for name in names:
            if lid is not None:
                entry = optim["state"].get(name)
                if entry is not None:
                    state[gid] = dict(entry)
                elif not stateless:
                    missing.append(name)
                gids_of.setdefault(lid, []).append(gid)
            id_map[gid] = lid
            gid += 1
    if missing:
        raise CheckpointError(
            f"optimizer state missing for {len(missing)} parameters whose flat parameter has some: "
            f"{', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )
    out_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    if per_group:
        for new, js in zip(out_groups, per_group):
            new["params"] = [g for j in js for g in gids_of[lid_of[j]]]
    elif out_groups:
        out_groups[0]["params"] = list(range(gid))
    return {"state": state, "param_groups": out_groups, "param_id_map": id_map}


def _group_flat_params(names_of: List[List[str]], groups: Sequence[Mapping[str, Any]]) -> List[List[int]]:
    """Per param group, the flat parameters its names belong to, in listed order (names of no parameter: skipped)."""
    flat_of = {n: j for j, names in enumerate(names_of) for n in names}
    out: List[List[int]] = []
    group_of: Dict[int, int] = {}
    for g_index, g in enumerate(groups):
        js: List[int] = []
        for name in g.get("params", []):
            j = flat_of.get(name) if isinstance(name, str) else None
            if j is None or j in js:
                continue
            if j in group_of:
                raise CheckpointError(
                    f"optimizer param groups {group_of[j]} and {g_index} both list members of one FSDP flat "
                    f"parameter ({', '.join(names_of[j][:3])}): fairscale holds one optimizer entry for them"
                )
            group_of[j] = g_index
            js.append(j)
        out.append(js)
    return out


def flat_tensors(
    tree: Mapping[str, Any], keep_non_tensors: bool, where: str, select: Sequence[str] = ()
) -> Dict[str, Any]:
    """DCP's flattened names (``model.trunk.x``, ``optim.state.trunk.x.exp_avg``) -> values.

    Only names under a ``select`` prefix, where given; non-tensor values
    among them are refused by name unless ``keep_non_tensors``.
    """
    flat, _ = flatten_state_dict(tree)
    out: Dict[str, Any] = {}
    others = []
    for k, v in flat.items():
        if select and not any(k.startswith(p) for p in select):
            continue
        if is_tensor(v):
            out[k] = as_fill(v)
        elif keep_non_tensors:
            out[k] = v
        else:
            others.append(k)
    if others:
        raise CheckpointError(
            f"{where}: {len(others)} entries are not tensors ({', '.join(others[:6])}"
            + (" ..." if len(others) > 6 else "")
            + "): this output holds tensors only; narrow it with --select (e.g. --select model.)"
        )
    return out


def model_state(tree: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """The model's state dict inside a DCP tree (the ``model`` key)."""
    if MODEL not in tree or not isinstance(tree[MODEL], Mapping):
        raise CheckpointError(f"{where}: no '{MODEL}' state dict inside (keys: {sorted(map(str, tree))})")
    return dict(tree[MODEL])

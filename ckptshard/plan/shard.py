"""Plan shards of a full state dict, following an existing checkpoint's FSDP wrapping."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Union

from ..errors import CheckpointError
from ..layout.chunking import shard_range
from ..layout.model import FlatParam, ShardedLayout, metadata_of
from ..read.source import ShardedCheckpoint
from ..tensors import Fill, Source, TensorRef, as_fill, is_tensor, sources_in, with_fills
from ..tree import copy_tree, get_path, set_path

Tensorish = Union[TensorRef, Fill]  # a stored tensor, or one planned from pieces (e.g. DCP chunks)


def check_full_against_plan(ckpt: ShardedCheckpoint, full: Mapping[str, Tensorish]) -> None:
    """Refuse, listing them, names and shapes that do not match the wrapping plan."""
    missing, wrong, expected = [], [], set()
    for part in ckpt.layout.parts:
        for inst, fp in part.flat_params():
            for m in fp.members:
                name = part.prefix + inst.logical_name(m.name)
                expected.add(name)
                if name not in full:
                    missing.append(name)
                elif tuple(full[name].shape) != m.shape:
                    wrong.append(f"{name} {list(full[name].shape)} (plan: {list(m.shape)})")
            for _src, dst in inst.shared:
                expected.add(part.prefix + inst.logical_name(dst))
        for alias, _ in part.aliases:
            expected.add(part.prefix + alias)
        for b in part.stored_buffers:
            expected.add(part.prefix + b)
            if part.prefix + b not in full:
                missing.append(part.prefix + b)
    extra = sorted(set(full) - expected)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if wrong:
        problems.append(f"wrong shape {len(wrong)}: {', '.join(wrong[:8])}" + (" ..." if len(wrong) > 8 else ""))
    if extra:
        problems.append(f"not in the plan {len(extra)}: {', '.join(extra[:8])}" + (" ..." if len(extra) > 8 else ""))
    if problems:
        raise CheckpointError("full state dict does not match the wrapping plan: " + "; ".join(problems))


def _flat_sources(fp: FlatParam, refs: List[Tensorish], world_size: int, rank: int) -> tuple:
    """Rank ``rank``'s shard of a flat param whose members are separate tensors (stored or planned)."""
    a, b = shard_range(fp.numel, world_size, rank)
    out: List[Source] = []
    for m, ref in zip(fp.members, refs):
        lo, hi = max(a, m.offset), min(b, m.offset + m.numel)
        if lo < hi:
            out += sources_in(as_fill(ref), lo - m.offset, hi - m.offset, lo - a)
    return tuple(out)


def sharded_from_full(
    ckpt: ShardedCheckpoint,
    full: Mapping[str, Tensorish],
    world_size: int,
    rank: int,
    optim: Optional[Any] = None,
) -> Any:
    """Rank ``rank``'s file at ``world_size``: ``ckpt``'s container and wrapping, ``full``'s values.

    Tensors are cast to the plan's dtype where ``full`` holds another one.
    The template's optimizer state is dropped unless ``optim`` (a planned
    optimizer shard) replaces it.
    """
    tree = copy_tree(ckpt.objs[0])
    for pi, spec in enumerate(ckpt.container.parts):
        part = ckpt.layout.parts[pi]
        sd: Dict[str, Fill] = {}
        template = ckpt.local_state(0, pi)
        flat = {inst.local_key(fp): (inst, fp) for inst, fp in part.flat_params()}
        aliases = dict(part.aliases)
        for key in template:
            if key in aliases:
                continue
            if key in flat:
                inst, fp = flat[key]
                refs = [full[part.prefix + inst.logical_name(m.name)] for m in fp.members]
                sd[key] = Fill(fp.local_shape(world_size), fp.dtype, _flat_sources(fp, refs, world_size, rank))
            elif part.prefix + key in full:
                sd[key] = as_fill(full[part.prefix + key])
            else:
                raise CheckpointError(
                    f"{part.prefix}{key}: stored in the template shards but not in the full state dict"
                )
        for alias, target in part.aliases:
            sd[alias] = sd[target]
        sd = {k: sd[k] for k in template}
        set_path(tree, spec.weights, sd)
        set_path(tree, spec.metadata, metadata_of(part, world_size, rank))
    if ckpt.container.optimizer is not None:
        opt_path = ckpt.container.optimizer
        if optim is None:
            get_path(tree, opt_path[:-1]).pop(opt_path[-1])
        else:
            set_path(tree, opt_path, optim)
    return with_fills(tree)


def sharded_files(
    ckpt: ShardedCheckpoint,
    full: Mapping[str, Tensorish],
    world_size: int,
    full_optim: Optional[Mapping[str, Any]] = None,
) -> List[Any]:
    """Every rank's file at ``world_size``: ``ckpt``'s wrapping, ``full``'s values, ``full_optim`` sharded alongside."""
    return [
        sharded_from_full(
            ckpt,
            full,
            world_size,
            rank,
            None if full_optim is None else sharded_optimizer_from_full(ckpt.layout, full_optim, world_size, rank),
        )
        for rank in range(world_size)
    ]


# Per-parameter scalars of torch's optimizers: 0-dim under these names is not a 0-dim parameter's moment.
SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})


def elementwise_state(key: str, values: List[Any]) -> bool:
    """Whether optimizer state ``key`` of one flat param's members holds a value per element (a moment).

    ``values``: the state under ``key`` of each member, in flat order. Any
    member's tensor with a dimension decides it. A 0-dim parameter's moments
    are 0-dim like ``step``, so where every value is 0-dim the name decides
    (fairscale's ``get_shard_from_optim_state_dict`` keeps such a moment as a
    scalar and loses the instance's state).
    """
    if not values or not all(is_tensor(v) for v in values):
        return False
    return any(len(v.shape) > 0 for v in values) or key not in SCALAR_STATE


def sharded_optimizer_from_full(
    layout: ShardedLayout, full_optim: Mapping[str, Any], world_size: int, rank: int
) -> Dict[str, Any]:
    """Rank ``rank``'s optimizer shard from fairscale's full format (``gather_full_optim_state_dict``).

    ``layout``: the FSDP wrapping to shard for (a checkpoint's, or a live
    model's). Like ``get_shard_from_optim_state_dict``: per-element state is
    concatenated in flat order and sharded, other values are copied.
    """
    for key in ("state", "param_groups", "param_id_map"):
        if key not in full_optim:
            raise CheckpointError(f"full optimizer state lacks {key!r}: not fairscale's full format")
    flat = layout.flat_params()
    # Global ids number every flat parameter's members in order, frozen ones included.
    flat_of_gid = [j for j, (_, _, fp) in enumerate(flat) for _ in fp.members]
    by_local: Dict[int, List[int]] = {}
    for gid, lid in full_optim["param_id_map"].items():
        if lid is not None:
            by_local.setdefault(int(lid), []).append(int(gid))
    out = {k: v for k, v in copy_tree(dict(full_optim)).items() if k not in ("param_id_map", "uncollected_local_ids")}
    state: Dict[int, Dict[str, Any]] = {}
    identity = True
    for lid, gids in sorted(by_local.items()):
        gids = sorted(gids)
        js = {flat_of_gid[g] if 0 <= g < len(flat_of_gid) else None for g in gids}
        if len(js) != 1 or None in js:
            raise CheckpointError(f"optimizer entry {lid} covers parameters {gids}, not those of one flat parameter")
        j = js.pop()
        identity = identity and j == lid
        _, inst, fp = flat[j]
        if len(gids) != len(fp.members):
            raise CheckpointError(f"optimizer entry {lid} covers {len(gids)} parameters, the plan {len(fp.members)}")
        held = [g for g in gids if g in full_optim["state"]]
        if not held:  # a stateless entry (SGD without momentum): torch keeps no state for it
            continue
        if len(held) != len(gids):
            missing = [inst.logical_name(fp.members[gids.index(g)].name) for g in gids if g not in held]
            raise CheckpointError(
                f"optimizer entry {lid}: no state for {', '.join(missing[:4])}, "
                "though other parameters of its flat parameter have some"
            )
        entries = [full_optim["state"][g] for g in gids]
        s: Dict[str, Any] = {}
        for k, v in entries[0].items():
            if elementwise_state(k, [e.get(k) for e in entries]):
                refs = [e[k] for e in entries]
                for m, ref in zip(fp.members, refs):
                    if ref.numel != m.numel:
                        raise CheckpointError(
                            f"optimizer state[{k!r}] for {inst.logical_name(m.name)}: {ref.numel} elements, "
                            f"parameter has {m.numel}"
                        )
                s[k] = Fill(fp.local_shape(world_size), v.dtype, _flat_sources(fp, refs, world_size, rank))
            elif isinstance(v, list) and v and is_tensor(v[0]):
                s[k] = as_fill(v[rank] if rank < len(v) else v[0])  # fairscale's rule for per-rank scalars
            else:
                s[k] = v
        state[lid] = s
    out["state"] = state
    groups = copy_tree(full_optim["param_groups"])
    if len(groups) == 1:
        # Entry k is flat parameter k, or (frozen parameters left out) the optimizer numbered fewer.
        groups[0]["params"] = list(range(len(flat) if identity else max(by_local) + 1))
    else:  # each group lists global ids (ckptshard's extension of the format): back to optimizer ids
        id_map = {int(g): lid for g, lid in full_optim["param_id_map"].items()}
        for g in groups:
            g["params"] = list(
                dict.fromkeys(int(id_map[int(x)]) for x in g["params"] if id_map.get(int(x)) is not None)
            )
        listed = sorted(i for g in groups for i in g["params"])
        if listed != sorted(by_local):
            raise CheckpointError(f"optimizer param groups list entries {listed}, the state has {sorted(by_local)}")
    out["param_groups"] = groups
    return with_fills(out)

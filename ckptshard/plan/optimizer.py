"""Plan optimizer state: resharded per rank, or consolidated in fairscale's full format.

FSDP optimizers hold one entry per flat parameter, numbered in the order
the model's parameters are (the layout's flat-param order). Each entry's
tensors of the flat shard's size (``exp_avg``, ``momentum_buffer``...) are
sharded exactly like the flat parameter, padding included.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..errors import CheckpointError
from ..io.fill import Fill, Source, whole
from ..io.safe_load import TensorRef
from ..io.source import ShardedCheckpoint
from ..io.tree import copy_tree, map_leaves
from ..layout.model import FlatParam, FsdpInstance, Part
from .consolidate import member_sources
from .intervals import replica_source, reshard_pieces


def _entries(ckpt: ShardedCheckpoint) -> List[Tuple[Part, FsdpInstance, FlatParam]]:
    return ckpt.layout.flat_params()


def _entry_shape(osd: Mapping[str, Any]) -> Dict[Any, List[str]]:
    return {pid: sorted(map(str, e)) for pid, e in osd["state"].items()}


def check_optimizer(ckpt: ShardedCheckpoint) -> None:
    """Refuse optimizer state that does not fit the layout: parameter count, entry keys, sizes."""
    flat = _entries(ckpt)
    first = None
    for r in range(ckpt.world_size):
        osd = ckpt.optimizer_state(r)
        where = f"{ckpt.files.paths[r]}: optimizer"
        if not isinstance(osd, Mapping) or "state" not in osd or "param_groups" not in osd:
            raise CheckpointError(f"{where}: not a torch optimizer state dict")
        ids = [i for g in osd["param_groups"] for i in g.get("params", [])]
        if sorted(ids) != list(range(len(flat))):
            raise CheckpointError(
                f"{where}: param_groups number {len(ids)} parameters, the model has {len(flat)} flat parameters"
            )
        if not isinstance(osd["state"], Mapping) or not all(isinstance(e, Mapping) for e in osd["state"].values()):
            raise CheckpointError(f"{where}: state is not a dict of per-parameter dicts")
        if first is None:
            first = _entry_shape(osd)
        elif _entry_shape(osd) != first:
            raise CheckpointError(f"{where}: state entries or their keys differ from rank 0's")
        for pid, entry in osd["state"].items():
            if not isinstance(pid, int) or not 0 <= pid < len(flat):
                raise CheckpointError(f"{where}: state entry {pid!r} names no parameter")
            part, inst, fp = flat[pid]
            want = fp.numel if inst.no_broadcast_optim_state else fp.shard_numel(ckpt.world_size)
            for k, v in entry.items():
                if isinstance(v, TensorRef) and len(v.shape) > 0 and v.numel != want:
                    raise CheckpointError(
                        f"{where}: state[{pid}][{k!r}] has {v.numel} elements but parameter "
                        f"{part.prefix}{inst.local_key(fp)} holds {want} per rank "
                        "(parameter order differs, or state of another shape)"
                    )


def resharded_optimizer(ckpt: ShardedCheckpoint, world_size: int, rank: int) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s optimizer state dict at ``world_size``, as a tree of Fills."""
    if ckpt.container.optimizer is None:
        return None
    check_optimizer(ckpt)
    M, flat = ckpt.world_size, _entries(ckpt)
    same = world_size == M
    # Per-rank values (0-dim tensors) follow the weights' buffer rule.
    own = replica_source(M, world_size, rank)
    base = ckpt.optimizer_state(own)
    out = copy_tree(base)
    out["state"] = {}
    for pid, entry in base["state"].items():
        _, inst, fp = flat[pid]
        new: Dict[str, Any] = {}
        for k, v in entry.items():
            if not isinstance(v, TensorRef):
                new[k] = v
            elif len(v.shape) == 0 or same:
                new[k] = whole(ckpt.optimizer_state(own)["state"][pid][k])
            elif inst.no_broadcast_optim_state:
                raise CheckpointError(
                    f"{inst.local_key(fp)}: per-rank (no_broadcast_optim_state) state cannot be resharded"
                )
            else:
                srcs = [ckpt.optimizer_state(r)["state"][pid][k] for r in range(M)]
                sources = tuple(
                    Source(srcs[p.src_rank], p.src_start, p.dst_start, p.length)
                    for p in reshard_pieces(fp.numel, M, world_size, rank)
                )
                new[k] = Fill(fp.local_shape(world_size), v.dtype, sources)
        out["state"][pid] = new
    return _wrap_refs(out)


def _wrap_refs(tree: Any) -> Any:
    return map_leaves(tree, lambda x: whole(x) if isinstance(x, TensorRef) else x)


def consolidated_optimizer(ckpt: ShardedCheckpoint) -> Optional[Dict[str, Any]]:
    """The full optimizer state in ``gather_full_optim_state_dict``'s format.

    One entry per logical parameter (global id), tensors in the parameter's
    shape; ``step`` becomes a Python number and other 0-dim tensors a list
    of every rank's value, as fairscale does, so that
    ``get_shard_from_optim_state_dict`` accepts the result. Two of
    fairscale's quirks are kept so the output equals its own: state of an
    unflattened parameter stays 1-D, and ``param_groups[0]["params"]``
    counts only flattened parameters.
    """
    if ckpt.container.optimizer is None:
        return None
    check_optimizer(ckpt)
    M, flat = ckpt.world_size, _entries(ckpt)
    osds = [ckpt.optimizer_state(r) for r in range(M)]
    out = copy_tree(osds[0])
    state: Dict[int, Dict[str, Any]] = {}
    param_id_map: Dict[int, Optional[int]] = {}
    gid = 0
    for lid, (_, inst, fp) in enumerate(flat):
        entry = osds[0]["state"].get(lid)
        for m in fp.members:
            param_id_map[gid] = lid if entry is not None else None
            if entry is not None:
                s: Dict[str, Any] = {}
                for k, v in entry.items():
                    if not isinstance(v, TensorRef):
                        s[k] = v
                    elif len(v.shape) == 0:
                        vals = [osds[r]["state"][lid][k].read() for r in range(M)]
                        s[k] = vals[0].item() if k == "step" else vals
                    else:
                        srcs = [osds[r]["state"][lid][k] for r in range(M)]
                        sources = member_sources(srcs, inst, fp, m)
                        s[k] = Fill(m.shape if fp.flattened else (m.numel,), v.dtype, sources)
                state[gid] = s
            gid += 1
    out["state"] = state
    groups = copy_tree(osds[0]["param_groups"])
    if len(groups) != 1:
        raise CheckpointError(f"optimizer has {len(groups)} param groups; fairscale's full format supports one")
    groups[0]["params"] = list(range(sum(len(fp.members) for _, _, fp in flat if fp.flattened)))
    out["param_groups"] = groups
    out["param_id_map"] = param_id_map
    out["uncollected_local_ids"] = [i for i, (_, inst, _) in enumerate(flat) if inst.no_broadcast_optim_state]
    return _wrap_refs(out)

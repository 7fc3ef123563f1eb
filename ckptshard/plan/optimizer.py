"""Plan optimizer state: resharded per rank, or consolidated in fairscale's full format.

FSDP optimizers hold one entry per flat parameter, numbered in the order
the model's parameters are (the layout's flat-param order). Each entry's
tensors of the flat shard's size (``exp_avg``, ``momentum_buffer``...) are
sharded exactly like the flat parameter, padding included.

An optimizer built over the trainable parameters only
(``filter(lambda p: p.requires_grad, ...)``, e.g. a frozen trunk) numbers
fewer entries than there are flat parameters, and nothing in the checkpoint
says which were frozen. :func:`optimizer_params` recovers the mapping from
the entries' shard sizes, in order; fairscale's own
``gather_full_optim_state_dict`` assumes entry ``k`` is instance ``k`` and
mislabels the state instead.

Several param groups number their parameters group by group, so ids need
not follow the model's order (a per-group learning rate listing the head
first). Each group's ids are matched in order, the groups together to
distinct flat parameters. fairscale refuses such state in its optimizer
utilities; its full format (``consolidated_optimizer``) is extended here
to list each group's global ids.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from ..errors import CheckpointError
from ..layout.model import FlatParam, FsdpInstance, Part
from ..read.source import ShardedCheckpoint
from ..read.tensor_data import read_scalar, read_scalars
from ..tensors import Fill, Source, TensorRef, whole, with_fills
from ..tree import copy_tree, map_leaves
from .consolidate import member_sources
from .intervals import replica_source, reshard_pieces

FlatEntry = Tuple[Part, FsdpInstance, FlatParam]


def _entries(ckpt: ShardedCheckpoint) -> List[FlatEntry]:
    return ckpt.layout.flat_params()


def _entry_shape(osd: Mapping[str, Any]) -> Dict[Any, List[str]]:
    return {pid: sorted(map(str, e)) for pid, e in osd["state"].items()}


def _per_rank_numel(ckpt: ShardedCheckpoint, entry: FlatEntry) -> int:
    _, inst, fp = entry
    return fp.numel if inst.no_broadcast_optim_state else fp.shard_numel(ckpt.world_size)


def _entry_numels(osd: Mapping[str, Any], pid: int) -> Set[int]:
    """The sizes of entry ``pid``'s non-scalar tensors (empty: no tensor state, fits any parameter)."""
    entry = osd["state"].get(pid, {})
    return {v.numel for v in entry.values() if isinstance(v, TensorRef) and len(v.shape) > 0}


def _candidates(ckpt: ShardedCheckpoint, osd: Mapping[str, Any], ids: List[int]) -> List[List[int]]:
    """For each of ``ids`` (one param group's), the flat parameters it can be in some in-order choice of them.

    ``ids[i]`` may stand for flat parameter ``j`` when its tensors have
    ``j``'s per-rank size, ``ids[:i]`` fit in order before ``j`` and
    ``ids[i+1:]`` after.
    """
    flat = _entries(ckpt)
    n, k = len(flat), len(ids)
    sizes = [_per_rank_numel(ckpt, e) for e in flat]
    fits = []
    for i in ids:
        want = _entry_numels(osd, i)
        fits.append([not (want - {s}) for s in sizes])
    # before[i][j]: ids 0..i fit in order with id i at j; after[i][j]: ids i..k-1 fit with id i at j.
    before = [[False] * n for _ in range(k)]
    after = [[False] * n for _ in range(k)]
    for i in range(k):
        seen = i == 0
        for j in range(n):
            before[i][j] = fits[i][j] and seen
            seen = seen or (i > 0 and before[i - 1][j])
    for i in reversed(range(k)):
        seen = i == k - 1
        for j in reversed(range(n)):
            after[i][j] = fits[i][j] and seen
            seen = seen or (i < k - 1 and after[i + 1][j])
    return [[j for j in range(n) if before[i][j] and after[i][j]] for i in range(k)]


def _distinct(cands: List[List[int]]) -> Optional[List[int]]:
    """One candidate per id, no flat parameter twice (augmenting paths), or None where none exists."""
    owner: Dict[int, int] = {}  # flat parameter -> id
    for start in range(len(cands)):
        # Depth-first search for an augmenting path, iterative: paths can be as long as there are ids.
        seen: Set[int] = set()
        stack = [(start, iter(cands[start]))]
        path: List[Tuple[int, int]] = []  # (id, flat parameter) edges taken
        while stack:
            i, it = stack[-1]
            j = next((j for j in it if j not in seen), None)
            if j is None:
                stack.pop()
                if path:
                    path.pop()
                continue
            seen.add(j)
            path.append((i, j))
            if j not in owner:
                for pi, pj in path:
                    owner[pj] = pi
                break
            stack.append((owner[j], iter(cands[owner[j]])))
        else:
            return None
    out = [0] * len(cands)
    for j, i in owner.items():
        out[i] = j
    return out


def optimizer_params(ckpt: ShardedCheckpoint, by_name: bool = False) -> List[int]:
    """The index of the flat parameter each optimizer id stands for (list index = id).

    All flat parameters: the identity. Fewer (frozen ones left out of the
    optimizer): the in-order choice the state's sizes allow. Where several
    choices fit, resharding only needs each id's size, which may still be
    certain; ``by_name`` (consolidating, DCP: the state is named after the
    parameter) needs the parameter itself. Either way, what cannot be told
    is refused.
    """
    flat = _entries(ckpt)
    where = f"{ckpt.files.paths[0]}: optimizer"
    osd = ckpt.optimizer_state(0)
    if not isinstance(osd, Mapping) or "state" not in osd or "param_groups" not in osd:
        raise CheckpointError(f"{where}: not a torch optimizer state dict")
    groups = [list(g.get("params", [])) for g in osd["param_groups"]]
    ids = [i for g in groups for i in g]
    if sorted(ids) != list(range(len(ids))) or len(ids) > len(flat):
        raise CheckpointError(
            f"{where}: param_groups number {len(ids)} parameters, the model has {len(flat)} flat parameters"
        )
    if len(ids) == len(flat) and len(groups) == 1:
        return list(range(len(flat)))
    if not isinstance(osd["state"], Mapping) or not all(isinstance(e, Mapping) for e in osd["state"].values()):
        raise CheckpointError(f"{where}: state is not a dict of per-parameter dicts")
    frozen = len(flat) - len(ids)
    cands: List[List[int]] = [[] for _ in ids]
    for g in groups:
        for i, js in zip(g, _candidates(ckpt, osd, g)):
            cands[i] = js
    chosen = _distinct(cands) if all(cands) else None
    if chosen is None:
        raise CheckpointError(
            f"{where}: holds {len(ids)} of the model's {len(flat)} flat parameters in {len(groups)} param "
            "group(s), but no in-order choice of them per group has the sizes of its state: not this model's optimizer"
        )
    why = f"{frozen} frozen, not in the optimizer" if frozen else f"{len(groups)} param groups, ids not in model order"
    for i, js in enumerate(cands):
        shapes = {(flat[j][2].numel, flat[j][1].no_broadcast_optim_state) for j in js}
        if len(js) > 1 and (by_name or len(shapes) > 1):
            names = ", ".join(flat[j][0].prefix + flat[j][1].local_key(flat[j][2]) for j in js)
            raise CheckpointError(
                f"{where}: holds {len(ids)} of the model's {len(flat)} flat parameters ({why}), "
                f"and optimizer entry {i} fits several of them ({names}): "
                + (
                    "cannot tell which parameter its state belongs to (reshard, which needs only its size, can)"
                    if len(shapes) == 1
                    else "cannot tell its size; reshard with --no-optimizer to leave it out"
                )
            )
    return chosen


def check_optimizer(ckpt: ShardedCheckpoint, by_name: bool = False) -> List[int]:
    """Refuse optimizer state that does not fit the layout; return :func:`optimizer_params`.

    Checks the parameter count, each rank's entry keys and tensor sizes.
    """
    memo = ckpt.memo.get(("check_optimizer", by_name))
    if memo is not None:  # asked once per output file; the answer is the checkpoint's
        return list(memo)
    index = optimizer_params(ckpt, by_name)
    entries = _entries(ckpt)
    flat = [entries[j] for j in index]
    first = None
    for r in range(ckpt.world_size):
        osd = ckpt.optimizer_state(r)
        where = f"{ckpt.files.paths[r]}: optimizer"
        if not isinstance(osd, Mapping) or "state" not in osd or "param_groups" not in osd:
            raise CheckpointError(f"{where}: not a torch optimizer state dict")
        ids = [i for g in osd["param_groups"] for i in g.get("params", [])]
        if sorted(ids) != list(range(len(flat))):
            raise CheckpointError(f"{where}: param_groups number {len(ids)} parameters, rank 0's number {len(flat)}")
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
            want = _per_rank_numel(ckpt, flat[pid])
            for k, v in entry.items():
                if isinstance(v, TensorRef) and len(v.shape) > 0 and v.numel != want:
                    raise CheckpointError(
                        f"{where}: state[{pid}][{k!r}] has {v.numel} elements but parameter "
                        f"{part.prefix}{inst.local_key(fp)} holds {want} per rank "
                        "(parameter order differs, or state of another shape)"
                    )
    check_ranks_agree(ckpt)
    ckpt.memo[("check_optimizer", by_name)] = tuple(index)
    return index


def _comparable(tree: Any) -> Any:
    """``tree`` with tensors as (dtype, shape): what must agree between ranks, not where it is stored."""
    return map_leaves(tree, lambda x: ("tensor", str(x.dtype), x.shape) if isinstance(x, TensorRef) else x)


def _steps(osd: Mapping[str, Any]) -> Dict[Any, Any]:
    """Each state entry's ``step``, as a number (0-dim tensors read from the file)."""
    steps = {pid: e["step"] for pid, e in osd["state"].items() if "step" in e}
    refs = [(pid, v) for pid, v in steps.items() if isinstance(v, TensorRef) and v.numel == 1]
    for (pid, _), value in zip(refs, read_scalars([v for _, v in refs])):
        steps[pid] = float(value)
    return {pid: float(v) if isinstance(v, (int, float)) else v for pid, v in steps.items()}


def check_ranks_agree(ckpt: ShardedCheckpoint) -> None:
    """Refuse optimizer state whose replicated values differ between ranks: the param groups
    (learning rates, weight decay...) and every entry's ``step``. Consolidating or resharding keeps
    one rank's copy; a disagreement means shards of different runs or a damaged file."""
    groups0, steps0 = _comparable(ckpt.optimizer_state(0)["param_groups"]), _steps(ckpt.optimizer_state(0))
    for r in range(1, ckpt.world_size):
        osd = ckpt.optimizer_state(r)
        where = f"{ckpt.files.paths[r]}: optimizer"
        if _comparable(osd["param_groups"]) != groups0:
            raise CheckpointError(f"{where}: param_groups differ from rank 0's")
        steps = _steps(osd)
        for pid in sorted(set(steps0) | set(steps), key=str):
            if steps.get(pid) != steps0.get(pid):
                raise CheckpointError(
                    f"{where}: state[{pid}]['step'] is {steps.get(pid)}, rank 0's is {steps0.get(pid)}"
                )


def resharded_optimizer(ckpt: ShardedCheckpoint, world_size: int, rank: int) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s optimizer state dict at ``world_size``, as a tree of Fills."""
    if ckpt.container.optimizer is None:
        return None
    entries = _entries(ckpt)
    flat = [entries[j] for j in check_optimizer(ckpt)]  # index = optimizer id
    M = ckpt.world_size
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
    return with_fills(tree)


def optimizer_param_names(ckpt: ShardedCheckpoint) -> List[str]:
    """The logical name of each global id of :func:`consolidated_optimizer`'s state (list index = id)."""
    return [part.prefix + inst.logical_name(m.name) for part, inst, fp in _entries(ckpt) for m in fp.members]


def consolidated_optimizer(ckpt: ShardedCheckpoint) -> Optional[Dict[str, Any]]:
    """The full optimizer state in ``gather_full_optim_state_dict``'s format.

    One entry per logical parameter (global id), tensors in the parameter's
    shape; ``step`` becomes a Python number and other 0-dim tensors a list
    of every rank's value, as fairscale does, so that
    ``get_shard_from_optim_state_dict`` accepts the result. Two of
    fairscale's quirks are kept so the output equals its own: state of an
    unflattened parameter stays 1-D, and ``param_groups[0]["params"]``
    counts only flattened parameters. fairscale supports one param group;
    with several, each group's ``params`` lists the global ids of its
    parameters (``param_id_map`` takes them back to optimizer ids).
    """
    if ckpt.container.optimizer is None:
        return None
    M, flat = ckpt.world_size, _entries(ckpt)
    lid_of = {j: lid for lid, j in enumerate(check_optimizer(ckpt, by_name=True))}  # frozen: none
    osds = [ckpt.optimizer_state(r) for r in range(M)]
    out = copy_tree(osds[0])
    state: Dict[int, Dict[str, Any]] = {}
    param_id_map: Dict[int, Optional[int]] = {}
    gids_of: Dict[int, List[int]] = {}
    gid = 0
    for j, (_, inst, fp) in enumerate(flat):
        lid = lid_of.get(j)
        entry = None if lid is None else osds[0]["state"].get(lid)
        for m in fp.members:
            param_id_map[gid] = lid  # None: frozen; an entry with no state (SGD) keeps its id, as in fairscale
            if lid is not None:
                gids_of.setdefault(lid, []).append(gid)
            if entry is not None:
                s: Dict[str, Any] = {}
                for k, v in entry.items():
                    if not isinstance(v, TensorRef):
                        s[k] = v
                    elif len(v.shape) == 0:  # read without torch, as Fills: no import, no data in memory
                        s[k] = read_scalar(v) if k == "step" else [whole(osds[r]["state"][lid][k]) for r in range(M)]
                    else:
                        srcs = [osds[r]["state"][lid][k] for r in range(M)]
                        sources = member_sources(srcs, inst, fp, m)
                        s[k] = Fill(m.shape if fp.flattened else (m.numel,), v.dtype, sources)
                state[gid] = s
            gid += 1
    out["state"] = state
    groups = copy_tree(osds[0]["param_groups"])
    if len(groups) == 1:
        groups[0]["params"] = list(range(sum(len(fp.members) for _, _, fp in flat if fp.flattened)))
    else:
        for g in groups:
            g["params"] = [gid for lid in g["params"] for gid in gids_of[lid]]
    out["param_groups"] = groups
    out["param_id_map"] = param_id_map
    out["uncollected_local_ids"] = [i for i, (_, inst, _) in enumerate(flat) if inst.no_broadcast_optim_state]
    return _wrap_refs(out)

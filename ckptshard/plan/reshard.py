"""Plan the files FSDP at a new world size would have saved."""

from __future__ import annotations

from typing import Any, Dict

from ..errors import CheckpointError
from ..layout.model import metadata_of
from ..read.source import ShardedCheckpoint
from ..tensors import Fill, Source, whole, with_fills
from ..tree import copy_tree, get_path, set_path
from .intervals import replica_source, reshard_pieces
from .optimizer import resharded_optimizer


def resharded_state(ckpt: ShardedCheckpoint, part_index: int, world_size: int, rank: int) -> Dict[str, Fill]:
    """Rank ``rank``'s ``local_state_dict()`` of one part at ``world_size``.

    Buffers and other replicated tensors: each rank keeps its own when the
    world size is unchanged (so M -> M is an exact copy); otherwise every
    rank gets rank 0's, which is what loading the consolidated state dict
    into FSDP would give.
    """
    M = ckpt.world_size
    own = replica_source(M, world_size, rank)
    part = ckpt.layout.parts[part_index]
    flat = {inst.local_key(fp): (inst, fp) for inst, fp in part.flat_params()}
    sds = [ckpt.local_state(r, part_index) for r in range(M)]
    aliases = dict(part.aliases)
    out: Dict[str, Fill] = {}
    for key in sds[0]:
        if key in aliases:
            continue
        if key not in flat or world_size == M:
            out[key] = whole(sds[own][key])
            continue
        inst, fp = flat[key]
        if inst.no_broadcast_optim_state:
            raise CheckpointError(
                f"{part.prefix}{key}: held whole by each rank (no_broadcast_optim_state, e.g. MoE experts): "
                "cannot be resharded to another world size"
            )
        sources = tuple(
            Source(sds[p.src_rank][key], p.src_start, p.dst_start, p.length)
            for p in reshard_pieces(fp.numel, M, world_size, rank)
        )
        out[key] = Fill(fp.local_shape(world_size), fp.dtype, sources)
    for alias, target in part.aliases:
        out[alias] = out[target]  # one tensor under two names, as FSDP saves it
    return {k: out[k] for k in sds[0]}


def resharded_file(ckpt: ShardedCheckpoint, world_size: int, rank: int, optimizer: bool = True) -> Any:
    """The whole object rank ``rank``'s file holds at ``world_size``: container, weights, metadata, optimizer.

    Non-model keys are carried from the source rank the buffers come from.
    Without ``optimizer`` the optimizer state is left out of the container
    (its key removed), as frameworks save a model-only checkpoint.
    """
    own = replica_source(ckpt.world_size, world_size, rank)
    tree = copy_tree(ckpt.objs[own])
    for pi, spec in enumerate(ckpt.container.parts):
        set_path(tree, spec.weights, resharded_state(ckpt, pi, world_size, rank))
        set_path(tree, spec.metadata, metadata_of(ckpt.layout.parts[pi], world_size, rank))
    path = ckpt.container.optimizer
    if path is not None and optimizer:
        set_path(tree, path, resharded_optimizer(ckpt, world_size, rank))
    elif path is not None:
        get_path(tree, path[:-1]).pop(path[-1])
    return with_fills(tree)

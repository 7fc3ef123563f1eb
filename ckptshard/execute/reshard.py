"""``reshard``: M shards -> N shards, weights and optimizer state."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List

import torch

from ..errors import CheckpointError
from ..io.atomic import atomic_output, check_output, check_space
from ..io.fill import Copier
from ..io.source import ShardedCheckpoint, open_checkpoint
from ..io.writers import tree_nbytes, write_torch
from ..plan.reshard import resharded_file
from .progress import progress_bar


@dataclass
class ReshardResult:
    folder: str
    files: List[str]
    nbytes: int


def shard_list_name(ckpt: ShardedCheckpoint) -> str:
    """VISSL's list file: ``model_phase2_shard{r}.torch`` -> ``model_phase2.torch``."""
    if ckpt.files.shard_list:
        return os.path.basename(ckpt.files.shard_list)
    head = ckpt.files.head
    return (head[: -len("_shard")] if head.endswith("_shard") else head.rstrip("_-")) + ckpt.files.tail


def write_resharded(ckpt: ShardedCheckpoint, world_size: int, folder: str, copier: Copier, tick) -> List[str]:
    """Write every rank's file of ``ckpt`` at ``world_size`` into ``folder``."""
    names = []
    for rank in range(world_size):
        name = ckpt.files.name_for(rank)
        write_torch(os.path.join(folder, name), resharded_file(ckpt, world_size, rank), copier, tick, ckpt.trust_pickles)
        names.append(name)
    if ckpt.container.kind == "vissl":
        list_name = shard_list_name(ckpt)
        torch.save({"type": "shard_list", "shards": names}, os.path.join(folder, list_name))
        names.append(list_name)
    return names


def reshard(
    src: str,
    dst: str,
    world_size: int,
    *,
    overwrite: bool = False,
    trust_pickles: bool = False,
    progress: bool = True,
) -> ReshardResult:
    """Write the checkpoint ``src`` as FSDP at ``world_size`` would have saved it, into folder ``dst``."""
    if world_size < 1:
        raise CheckpointError(f"--world-size must be >= 1, got {world_size}")
    ckpt = open_checkpoint(src, trust_pickles)
    check_output(dst, overwrite, tuple(ckpt.files.paths))
    # Plan every rank first: a bad input fails here, before any byte is written.
    total = sum(tree_nbytes(resharded_file(ckpt, world_size, r)) for r in range(world_size))
    check_space(dst, total)
    with Copier() as copier, progress_bar(total, f"reshard {ckpt.world_size}->{world_size}", progress) as tick:
        with atomic_output(dst, is_dir=True, overwrite=overwrite) as tmp:
            names = write_resharded(ckpt, world_size, tmp, copier, tick)
    return ReshardResult(dst, names, total)

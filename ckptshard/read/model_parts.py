"""Model-parallel parts x FSDP shards: metaseq's ``...-model_part-{k}-shard{r}.pt`` (fairseq's naming too).

Each part is an ordinary fairscale checkpoint over its data-parallel group;
together they are one model, split by tensor parallelism. This module finds
the parts, opens each, and checks that they belong together: the same FSDP
world size, the same step, the same tensor names.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..tree import get_path
from .discover import ShardFiles, group_by_rank, ranks_to_paths
from .source import ShardedCheckpoint, open_checkpoint

_PART_RE = re.compile(r"^(?P<before>.*model_part-)(?P<part>\d+)(?P<after>.*)$")


@dataclass(frozen=True)
class PartFiles:
    """Every part's shard files (index = model-parallel rank)."""

    folder: str
    parts: Tuple[ShardFiles, ...]

    @property
    def paths(self) -> Tuple[str, ...]:
        return tuple(p for part in self.parts for p in part.paths)


def find_model_parts(src: str) -> Optional[PartFiles]:
    """The parts of a folder holding two or more model parts; None otherwise (one part's shard file names
    that part alone)."""
    if not os.path.isdir(src):
        return None
    folder = src
    groups = group_by_rank(sorted(os.listdir(folder)))
    by_part: Dict[Tuple[str, str, str], Dict[int, Tuple[str, str]]] = {}
    others = []
    for head, tail in groups:
        m = _PART_RE.match(head)
        if m:
            by_part.setdefault((m["before"], m["after"], tail), {})[int(m["part"])] = (head, tail)
        else:
            others.append(f"{head}*{tail}")
    if not by_part or max(len(v) for v in by_part.values()) < 2:
        return None
    if len(by_part) > 1 or others:
        names = sorted(f"{b}*{a}*{t}" for b, a, t in by_part) + others
        raise CheckpointError(
            f"{folder}: holds model-parallel parts and other shard files ({', '.join(names)}): one checkpoint "
            "of several model parts is handled alone (MoE expert files beside several parts are not supported)"
        )
    ((_, parts),) = by_part.items()
    missing = [k for k in range(max(parts) + 1) if k not in parts]
    if missing:
        raise CheckpointError(f"{folder}: model part {missing[0]} of {max(parts) + 1} is missing")
    files = []
    for k in range(len(parts)):
        head, tail = parts[k]
        files.append(ShardFiles(ranks_to_paths(folder, head, tail, groups[(head, tail)]), head, tail))
    return PartFiles(folder, tuple(files))


def _step(ckpt: ShardedCheckpoint) -> Any:
    try:
        history = get_path(ckpt.objs[0], ["optimizer_history"])
        return history[-1].get("num_updates") if history else None
    except (KeyError, TypeError, IndexError, AttributeError):
        return None


def open_model_parts(files: PartFiles, trust_pickles: bool = False) -> List[ShardedCheckpoint]:
    """Open every part (each checked as any fairscale checkpoint) and check that they belong together."""
    ckpts = [open_checkpoint(part.paths[0], trust_pickles, torch_free=True) for part in files.parts]
    sizes = [c.world_size for c in ckpts]
    if len(set(sizes)) > 1:
        k = next(i for i, s in enumerate(sizes) if s != sizes[0])
        raise CheckpointError(
            f"{files.folder}: model part {k} has FSDP world size {sizes[k]}, part 0 has {sizes[0]}: parts of one "
            "checkpoint are sharded alike"
        )
    names = ckpts[0].layout.param_names()
    for k, c in enumerate(ckpts[1:], 1):  # tensor parallelism splits a tensor's shape, never its name
        other = c.layout.param_names()
        if other != names:
            odd = next((a for a, b in zip(other, names) if a != b), None) or sorted(set(other) ^ set(names))[0]
            raise CheckpointError(
                f"{files.folder}: model part {k} holds other parameters than part 0 (e.g. {odd}): not one checkpoint"
            )
    steps = [_step(c) for c in ckpts]
    if any(s != steps[0] for s in steps):
        k = next(i for i, s in enumerate(steps) if s != steps[0])
        raise CheckpointError(
            f"{files.folder}: model part {k} was saved at update {steps[k]}, part 0 at {steps[0]}: not one checkpoint"
        )
    return ckpts

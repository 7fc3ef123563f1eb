"""Find the per-rank files of one sharded checkpoint from what the user named."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..formats.torch_pickle import Unsupported
from ..osio.inputs import input_file
from .safe_load import safe_globals
from .torch_file import read_torch_file

# "...shard3.pt", "..._shard3.torch", "...-shard03.pt", "..._shard_3.pt": the rank follows "shard".
_SHARD_RE = re.compile(r"^(?P<head>.*shard[-_]?)(?P<rank>\d+)(?P<tail>\.[A-Za-z0-9]+)$")
# A training loop's own naming ("model_rank3.pt", "rank-3.pt"), used only where no name says "shard".
_RANK_RE = re.compile(r"^(?P<head>.*rank[-_]?)(?P<rank>\d+)(?P<tail>\.[A-Za-z0-9]+)$")


@dataclass(frozen=True)
class ShardFiles:
    paths: Tuple[str, ...]  # index = rank
    head: str  # file name before the rank number
    tail: str  # after it
    shard_list: Optional[str] = None  # the VISSL shard_list file, if the source was one

    def name_for(self, rank: int) -> str:
        return f"{self.head}{rank}{self.tail}"


def group_by_rank(
    names: List[str], patterns: Tuple[re.Pattern[str], ...] = (_SHARD_RE, _RANK_RE)
) -> Dict[Tuple[str, str], Dict[int, List[str]]]:
    """Shard names by (head, tail), then rank; the first pattern any name matches decides."""
    for pattern in patterns:
        groups: Dict[Tuple[str, str], Dict[int, List[str]]] = {}
        for n in names:
            m = pattern.match(n)
            if m:
                groups.setdefault((m["head"], m["tail"]), {}).setdefault(int(m["rank"]), []).append(n)
        if groups:
            return groups
    return {}


def ranks_to_paths(folder: str, head: str, tail: str, by_rank: Dict[int, List[str]]) -> Tuple[str, ...]:
    dup = {r: ns for r, ns in by_rank.items() if len(ns) > 1}
    if dup:
        r, ns = sorted(dup.items())[0]
        raise CheckpointError(f"{folder}: rank {r} appears more than once: {', '.join(sorted(ns))}")
    n = max(by_rank) + 1
    # At most len(by_rank) + 1 ranks are looked at: a name may claim rank 10**12.
    missing = [r for r in range(min(n, len(by_rank) + 5)) if r not in by_rank]
    if missing:
        shown = ", ".join(f"{head}{r}{tail}" for r in missing[:5])
        raise CheckpointError(f"{folder}: missing shard(s) {shown} of {n}")
    return tuple(os.path.join(folder, by_rank[r][0]) for r in range(n))


def _read_shard_list(path: str) -> Optional[List[str]]:
    """The shard names of a VISSL ``shard_list`` file, or None if it is not one."""
    if input_file(path).st_size > 64 * 1024 * 1024:
        return None
    try:
        obj = read_torch_file(path)
    except Unsupported:
        try:
            import torch

            with safe_globals():
                obj = torch.load(path, map_location="meta", weights_only=True)
        except Exception:
            return None
    if isinstance(obj, dict) and obj.get("type") == "shard_list":
        shards = obj.get("shards")
        if not isinstance(shards, (list, tuple)) or not shards:
            raise CheckpointError(f"{path}: shard_list file lists no shards")
        return [str(s) for s in shards]
    return None


def _metadata_only(path: str) -> bool:
    """A small file holding only ``local_metadata_dict()`` (no weights): the metadata saved on its own."""
    try:
        if input_file(path).st_size > 16 * 1024 * 1024:
            return False
    except CheckpointError:
        return False
    try:
        obj = read_torch_file(path)
    except (Unsupported, OSError):
        return False
    return isinstance(obj, dict) and "param_metadata" in obj


def find_shards(src: str) -> ShardFiles:
    """Resolve ``src`` (a folder, one shard file, or a VISSL shard_list file)."""
    if not os.path.exists(src):
        raise CheckpointError(f"{src}: no such file or folder")
    if os.path.isdir(src):
        groups = group_by_rank(sorted(os.listdir(src)))
        if not groups:
            raise CheckpointError(
                f"{src}: no shard files (names like checkpoint-shard0.pt or model_rank0.pt) in this folder"
            )
        if len(groups) > 1:
            names = ", ".join(f"{h}*{t}" for h, t in sorted(groups))
            meta = [
                f"{h}*{t}"
                for (h, t), by_rank in sorted(groups.items())
                if _metadata_only(os.path.join(src, by_rank[min(by_rank)][0]))
            ]
            if meta and len(meta) < len(groups):
                raise CheckpointError(
                    f"{src}: FSDP metadata is saved apart from the weights ({', '.join(meta)} among {names}); "
                    "ckptshard reads one file per rank holding both: re-save each rank's pair as "
                    "{'model': weights, 'fsdp_metadata': metadata}"
                )
            raise CheckpointError(f"{src}: holds several checkpoints ({names}): name one shard file instead")
        (head, tail), by_rank = next(iter(groups.items()))
        return ShardFiles(ranks_to_paths(src, head, tail, by_rank), head, tail)
    folder, name = os.path.split(os.path.abspath(src))
    listed = _read_shard_list(src)
    if listed is not None:
        names = [os.path.basename(s) for s in listed]
        groups = group_by_rank(names)
        if len(groups) != 1:
            raise CheckpointError(f"{src}: shard_list names files that are not one run's shards: {names}")
        (head, tail), by_rank = next(iter(groups.items()))
        for n in names:
            if not os.path.isfile(os.path.join(folder, n)):
                raise CheckpointError(f"{src}: lists {n}, which is not in {folder}")
        paths = ranks_to_paths(folder, head, tail, by_rank)
        if len(paths) != len(names):
            raise CheckpointError(f"{src}: shard_list does not list ranks 0..{len(paths) - 1} exactly once")
        return ShardFiles(paths, head, tail, shard_list=os.path.abspath(src))
    pattern = next((p for p in (_SHARD_RE, _RANK_RE) if p.match(name)), None)
    m = pattern.match(name) if pattern else None
    if not m or not pattern:
        # A single file that names no rank: a world-size-1 checkpoint.
        stem, ext = os.path.splitext(name)
        return ShardFiles((os.path.abspath(src),), stem + "-shard", ext or ".pt")
    groups = group_by_rank(sorted(os.listdir(folder)), (pattern,))
    head, tail = m["head"], m["tail"]
    return ShardFiles(ranks_to_paths(folder, head, tail, groups[(head, tail)]), head, tail)

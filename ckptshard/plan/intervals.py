"""Interval arithmetic between a flat tensor and its shards.

A flat tensor of ``numel`` elements sharded over ``world_size`` ranks puts
global element ``g`` on rank ``g // c`` at local offset ``g % c`` (``c`` the
chunk size). Every conversion is a list of :class:`Piece`: a run of
consecutive elements that lies on one source rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ..layout.chunking import chunk_size


@dataclass(frozen=True)
class Piece:
    src_rank: int
    src_start: int  # offset inside the source rank's shard
    dst_start: int  # offset inside the destination tensor
    length: int


def pieces(numel: int, world_size: int, start: int, stop: int, dst_start: int = 0) -> List[Piece]:
    """Where global elements ``[start, stop)`` of a flat tensor live.

    The result copies them to ``dst_start, dst_start + 1, ...`` in order.
    """
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) outside [0, {numel})")
    out: List[Piece] = []
    c = chunk_size(numel, world_size)
    g = start
    while g < stop:
        rank, local = divmod(g, c)
        n = min(stop, (rank + 1) * c) - g
        out.append(Piece(src_rank=rank, src_start=local, dst_start=dst_start + g - start, length=n))
        g += n
    return out


def reshard_pieces(numel: int, src_world_size: int, dst_world_size: int, dst_rank: int) -> List[Piece]:
    """Fill destination rank ``dst_rank``'s shard from the source shards.

    Elements of the destination shard not covered by the result are padding.
    """
    c = chunk_size(numel, dst_world_size)
    start = min(dst_rank * c, numel)
    return pieces(numel, src_world_size, start, min(start + c, numel))


def replica_source(src_world_size: int, dst_world_size: int, rank: int) -> int:
    """The source rank whose per-rank values (buffers, 0-dim state, container keys) ``rank`` gets.

    Its own when the world size is unchanged (M -> M is an exact copy);
    otherwise rank 0's, as loading the consolidated state into FSDP gives.
    """
    return rank if dst_world_size == src_world_size else 0

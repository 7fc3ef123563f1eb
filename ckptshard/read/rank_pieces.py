"""Every rank's piece of one tensor, joined: DTensor and ShardedTensor pieces along their shard dimension, and
the 1-D slices of FSDP1's flat parameters and optimizer state."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from ..layout.dim_shards import row_runs
from ..tensors import DTensorRef, Fill, Source, TensorRef, whole


def assemble(pieces: Sequence[DTensorRef]) -> Fill:
    """The whole tensor of every rank's piece (each checked by ``torch_ranks``)."""
    first = pieces[0]
    kind, dim = first.placements[0]
    if kind == "replicate":
        return whole(first.local)
    sources, start = [], 0
    for piece in pieces:
        rows = piece.local.shape[dim]
        for dst, src, length in row_runs(first.shape, dim, start, rows):
            sources.append(Source(piece.local, src, dst, length))
        start += rows
    return Fill(tuple(first.shape), first.dtype, tuple(sources))


def is_slice(v: Any) -> bool:
    return isinstance(v, TensorRef) and len(v.shape) == 1


def rank_slices(pieces: Sequence[Optional[TensorRef]]) -> Tuple[Dict[int, Source], int]:
    """1-D slices of one tensor's flattened elements, one per rank (None or empty: the rank holds none), laid
    end to end in rank order: each holding rank's Source, and the elements they cover."""
    sources: Dict[int, Source] = {}
    start = 0
    for r, piece in enumerate(pieces):
        if piece is not None and piece.numel:
            sources[r] = Source(piece, 0, start, piece.numel)
            start += piece.numel
    return sources, start

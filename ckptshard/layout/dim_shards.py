"""Tensors split along one dimension over ranks, as torch FSDP2 (``Shard(dim)``) splits them. Pure: no I/O.

FSDP2 cuts a parameter with ``torch.chunk``: every rank gets ``ceil(n / W)``
rows of dimension ``dim`` but the last ones, which get what is left, possibly
none (13 rows over 3 ranks: 5, 5, 3; 2 rows over 3 ranks: 1, 1, 0).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple


def chunk_sizes(n: int, world: int) -> List[int]:
    """Rows of each rank when ``n`` rows are cut as ``torch.chunk(x, world)`` cuts them."""
    step = -(-n // world) if n else 0
    return [max(0, min(step, n - r * step)) for r in range(world)]


def local_shape(shape: Sequence[int], dim: int, rows: int) -> Tuple[int, ...]:
    return tuple(rows if d == dim else s for d, s in enumerate(shape))


def row_runs(shape: Sequence[int], dim: int, start: int, rows: int) -> List[Tuple[int, int, int]]:
    """Rows ``[start, start + rows)`` of dimension ``dim`` of a contiguous ``shape`` tensor, as element runs:
    (offset in the whole, offset in the piece, length). One run for ``dim`` 0, one per outer index else."""
    inner = 1
    for s in shape[dim + 1 :]:
        inner *= s
    outer = 1
    for s in shape[:dim]:
        outer *= s
    length = rows * inner
    if length == 0:
        return []
    whole_stride = shape[dim] * inner
    return [(o * whole_stride + start * inner, o * length, length) for o in range(outer)]

"""fairscale's shard arithmetic, without tensors.

FSDP flattens a parameter and splits it with ``torch.chunk(world_size)``:
every chunk holds ``ceil(numel / world_size)`` elements except the last
non-empty one; ``torch.chunk`` may return fewer chunks than ranks (5 elements
on 4 ranks gives 3), and fairscale gives the ranks past the end an empty chunk.
Every rank's shard is then zero-padded at the end to the first chunk's size.
"""

from __future__ import annotations

from typing import Tuple

from ..errors import CheckpointError

# Past any FSDP job; a world size is checked against it before anything is sized by it (a file name or a
# flag saying 10**12 ranks would otherwise allocate per rank until memory runs out).
MAX_WORLD_SIZE = 1 << 20


def check_world_size(world_size: int, what: str = "--world-size") -> None:
    """Refuse a world size below 1 or above :data:`MAX_WORLD_SIZE`, in one line naming ``what``."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_WORLD_SIZE:
        raise CheckpointError(f"{what} must be between 1 and {MAX_WORLD_SIZE:,}, got {world_size!r}")


def chunk_size(numel: int, world_size: int) -> int:
    """Elements in every rank's (padded) shard."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return -(-numel // world_size)


def shard_range(numel: int, world_size: int, rank: int) -> Tuple[int, int]:
    """The ``[start, stop)`` slice of the flat tensor that ``rank`` holds."""
    c = chunk_size(numel, world_size)
    start = min(rank * c, numel)
    return start, min(start + c, numel)


def padding(numel: int, world_size: int, rank: int) -> int:
    """Zero elements appended to ``rank``'s shard."""
    start, stop = shard_range(numel, world_size, rank)
    return chunk_size(numel, world_size) - (stop - start)

"""Pure description of where every byte of a checkpoint lives. No I/O."""
from .chunking import chunk_size, padding, shard_range
from .model import FlatParam, FsdpInstance, Member, Part, ShardedLayout, layout_from_metadata

__all__ = [
    "chunk_size",
    "padding",
    "shard_range",
    "FlatParam",
    "FsdpInstance",
    "Member",
    "Part",
    "ShardedLayout",
    "layout_from_metadata",
]

"""fairscale's chunk/padding arithmetic, checked against fairscale's own _get_shard."""

from types import SimpleNamespace

import torch
from fairscale.nn import FullyShardedDataParallel as FSDP
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptshard.layout.chunking import chunk_size, padding, shard_range


def fairscale_shard(numel: int, world_size: int, rank: int):
    fake_self = SimpleNamespace(world_size=world_size, rank=rank)
    t = torch.arange(numel, dtype=torch.float32)
    return FSDP._get_shard(fake_self, t)


@settings(max_examples=400, deadline=None)
@given(numel=st.integers(0, 300), world_size=st.integers(1, 40), data=st.data())
def test_shard_arithmetic_matches_fairscale(numel, world_size, data):
    rank = data.draw(st.integers(0, world_size - 1))
    shard, pad = fairscale_shard(numel, world_size, rank)
    start, stop = shard_range(numel, world_size, rank)
    assert shard.numel() == chunk_size(numel, world_size)
    assert pad == padding(numel, world_size, rank)
    expected = torch.cat([torch.arange(start, stop, dtype=torch.float32), torch.zeros(pad)])
    assert torch.equal(shard, expected)


def test_fewer_chunks_than_ranks_gives_empty_padded_shards():
    # 5 elements on 4 ranks: torch.chunk returns 3 chunks of 2, 2, 1.
    assert [shard_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [padding(5, 4, r) for r in range(4)] == [0, 0, 1, 2]

"""Copy plans: every target element written exactly once, from the right source element."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptshard.layout.chunking import chunk_size, shard_range
from ckptshard.plan.intervals import pieces, reshard_pieces


def shards(numel, world_size):
    """Simulated shards: each element's value is its global index; padding is -1."""
    c = chunk_size(numel, world_size)
    out = []
    for r in range(world_size):
        a, b = shard_range(numel, world_size, r)
        out.append(list(range(a, b)) + [-1] * (c - (b - a)))
    return out


@settings(max_examples=500, deadline=None)
@given(numel=st.integers(0, 400), m=st.integers(1, 17), n=st.integers(1, 17))
def test_reshard_plan_writes_each_element_once_from_the_right_source(numel, m, n):
    src = shards(numel, m)
    c = chunk_size(numel, n)
    for rank in range(n):
        dst = [None] * c
        for p in reshard_pieces(numel, m, n, rank):
            for i in range(p.length):
                assert dst[p.dst_start + i] is None, "element written twice"
                dst[p.dst_start + i] = src[p.src_rank][p.src_start + i]
        a, b = shard_range(numel, n, rank)
        assert dst[: b - a] == list(range(a, b))
        assert all(v is None for v in dst[b - a :]), "padding must be left untouched (zero)"


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(1, 400), m=st.integers(1, 17), data=st.data())
def test_pieces_of_a_member_reassemble_it(numel, m, data):
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    src = shards(numel, m)
    got = [None] * (stop - start)
    for p in pieces(numel, m, start, stop):
        assert p.length > 0
        for i in range(p.length):
            got[p.dst_start + i] = src[p.src_rank][p.src_start + i]
    assert got == list(range(start, stop))


def test_elementwise_state_tells_moments_from_per_parameter_scalars():
    from ckptshard.plan.shard import elementwise_state
    from ckptshard.tensors import TensorRef

    def t(*shape):
        return TensorRef("x", 0, torch.float32, shape, ())

    assert elementwise_state("exp_avg", [t(), t(3, 2)])  # a 0-dim member beside others
    assert not elementwise_state("step", [t(), t()])  # torch's tensor step
    assert elementwise_state("exp_avg", [t(), t()])  # only 0-dim parameters: the name decides
    assert not elementwise_state("step", [3.0, 3.0])
    assert not elementwise_state("exp_avg", [])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), max_size=6, unique=True), min_size=1, max_size=5))
def test_distinct_choice_of_flat_params_exists_exactly_when_brute_force_finds_one(cands):
    # Optimizer ids of several param groups -> distinct flat parameters (plan.optimizer._distinct).
    import itertools

    from ckptshard.plan.optimizer import _distinct

    got = _distinct(cands)
    exists = any(len(set(c)) == len(c) for c in itertools.product(*cands))
    assert (got is not None) == exists
    if got is not None:
        assert len(set(got)) == len(cands) and all(j in c for j, c in zip(got, cands))


def test_distinct_choice_survives_augmenting_paths_longer_than_the_recursion_limit():
    from ckptshard.plan.optimizer import _distinct

    n = 3000  # id t fits flat params t and t+1; the last id fits only 0: every earlier id must move up one
    got = _distinct([[t, t + 1] for t in range(n - 1)] + [[0]])
    assert got is not None and len(set(got)) == n

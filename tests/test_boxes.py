"""Box arithmetic between DCP chunks and flat ranges, checked against torch indexing."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptshard.layout.boxes import box_runs, flat_range_boxes, numel

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def shape_and_range(draw):
    shape = draw(shapes)
    n = numel(shape)
    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, a, b


@settings(max_examples=400, deadline=None)
@given(shape_and_range())
def test_flat_range_boxes_cover_the_range_exactly_in_order(case):
    shape, a, b = case
    t = torch.arange(numel(shape)).reshape(shape)
    got = []
    for offsets, sizes in flat_range_boxes(shape, a, b):
        assert len(offsets) == len(shape) and all(s > 0 for s in sizes)
        box = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        flat = box.reshape(-1)
        # each box is one contiguous run of the flat tensor
        assert torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + flat.numel()))
        got.append(flat)
    joined = torch.cat(got) if got else torch.empty(0, dtype=torch.long)
    assert torch.equal(joined, torch.arange(a, b))
    # at most two boxes per dimension (plus one)
    assert len(got) <= max(1, 2 * len(shape) - 1)


@st.composite
def shape_and_box(draw):
    shape = draw(shapes)
    offsets, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offsets.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return shape, tuple(offsets), tuple(sizes)


@settings(max_examples=400, deadline=None)
@given(shape_and_box())
def test_box_runs_list_the_box_elements_in_row_major_order(case):
    shape, offsets, sizes = case
    t = torch.arange(numel(shape)).reshape(shape)
    want = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
    got_tensor, got_box = [], []
    for tstart, bstart, n in box_runs(shape, offsets, sizes):
        got_tensor.append(torch.arange(tstart, tstart + n))
        got_box.append(torch.arange(bstart, bstart + n))
    cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.long)  # noqa: E731
    assert torch.equal(cat(got_tensor), want)
    assert torch.equal(cat(got_box), torch.arange(want.numel()))


def test_row_sharded_matrix_is_one_run_column_sharded_one_per_row():
    assert list(box_runs((6, 4), (2, 0), (3, 4))) == [(8, 0, 12)]
    assert list(box_runs((3, 4), (0, 2), (3, 2))) == [(2, 0, 2), (6, 2, 2), (10, 4, 2)]


def test_flat_range_of_a_matrix_splits_into_head_body_tail():
    assert flat_range_boxes((4, 5), 3, 17) == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    assert flat_range_boxes((), 0, 1) == [((), ())]

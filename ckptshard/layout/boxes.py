"""Boxes: the n-d chunks DCP stores, against the flat ranges fairscale stores. Pure.

A DCP chunk is a box of a logical tensor (``offsets``, ``sizes`` per
dimension). A fairscale shard holds a flat, row-major range of elements.
A flat range splits into a few boxes, each a contiguous run of elements
(at most two per dimension); a box, conversely, is a set of contiguous
runs (one per index of its leading, not fully covered dimensions).
"""

from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

from ..tensors import numel

Shape = Tuple[int, ...]
Box = Tuple[Shape, Shape]  # (offsets, sizes)


def strides(shape: Sequence[int]) -> Shape:
    """Row-major element strides, as torch reports them (a 0-sized dimension counts as 1)."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def flat_index(shape: Sequence[int], index: Sequence[int]) -> int:
    return sum(i * st for i, st in zip(index, strides(shape)))


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` as boxes, in element order.

    Each box covers a contiguous run of the range; together they cover it
    exactly. A 0-dim tensor's one element is the box ``((), ())``.
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= stop <= numel(shape):
        raise ValueError(f"range [{start}, {stop}) outside a tensor of shape {list(shape)}")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    return _split(shape, start, stop, ())


def _split(shape: Shape, a: int, b: int, lead: Shape) -> List[Box]:
    ones = (1,) * len(lead)
    if len(shape) == 1:
        return [(lead + (a,), ones + (b - a,))]
    inner = numel(shape[1:])
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    if i0 == i1:  # inside one slice of the leading dimension
        return _split(shape[1:], r0, r1, lead + (i0,))
    out: List[Box] = []
    if r0:  # a partial slice first
        out += _split(shape[1:], r0, inner, lead + (i0,))
        i0 += 1
    if i1 > i0:  # whole slices
        out.append((lead + (i0,) + (0,) * (len(shape) - 1), ones + (i1 - i0,) + shape[1:]))
    if r1:  # a partial slice last
        out += _split(shape[1:], 0, r1, lead + (i1,))
    return out


def box_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[Tuple[int, int, int]]:
    """The contiguous runs of a box: ``(flat start in the tensor, flat start in the box, length)``.

    A box that spans whole trailing dimensions is one run per index of the
    dimensions before them (a row-sharded matrix: one run; a column-sharded
    one: one run per row).
    """
    shape, offsets, sizes = tuple(shape), tuple(offsets), tuple(sizes)
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise ValueError(f"box {list(offsets)}+{list(sizes)} does not fit shape {list(shape)}")
    for o, s, d in zip(offsets, sizes, shape):
        if o < 0 or s < 0 or o + s > d:
            raise ValueError(f"box {list(offsets)}+{list(sizes)} outside shape {list(shape)}")
    total = numel(sizes)
    if total == 0:
        return
    if not shape:
        yield 0, 0, 1
        return
    # The run covers dimensions k.. : every one after k whole, k itself partial or whole.
    k = len(shape) - 1
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    run = numel(sizes[k:])
    outer = sizes[:k]
    tstr = strides(shape)
    base = flat_index(shape, offsets)
    for j in range(numel(outer)):
        idx, rem = [], j
        for s in reversed(outer):
            rem, i = divmod(rem, s)
            idx.append(i)
        idx.reverse()
        yield base + sum(i * st for i, st in zip(idx, tstr)), j * run, run

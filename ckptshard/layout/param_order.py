"""Which tensors of a state dict an optimizer's parameters are, from order and shape alone. Pure: no I/O.

``optimizer.state_dict()`` keys its state by the position of each parameter
in ``model.parameters()``; the model's ``state_dict()`` lists the same
parameters in the same order, with buffers (and a tied parameter's second
name) between them. Where nothing marks which entries are buffers (FSDP1
at world size 1 saves every entry as a plain tensor) the parameters are
the in-order subsequence whose shapes are the moments' shapes. That is an
answer only where exactly one subsequence fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class OrderMatch:
    """``picked``: for each wanted entry, the index of the tensor it is (None unless exactly one fit);
    ``ways``: 0, 1, or 2 for two or more fits; ``fork``: where a second fit first parts from the first."""

    ways: int
    picked: Optional[List[int]] = None
    fork: Optional[int] = None


def match_in_order(wanted: Sequence[Optional[Shape]], have: Sequence[Shape]) -> OrderMatch:
    """Place every ``wanted`` shape (None: any, a parameter without state) on an equal entry of ``have``, in
    order, each entry used once; count the ways (up to 2). Linear in ``len(wanted)`` times the number of
    entries left over."""
    n, slack = len(wanted), len(have) - len(wanted)
    if slack < 0:
        return OrderMatch(0)

    def fits(i: int, j: int) -> bool:
        return wanted[i] is None or tuple(wanted[i]) == tuple(have[j])  # type: ignore[arg-type]

    # ways[i][d]: the ways to place wanted[i:] on have[i + d:]
    ways = [[0] * (slack + 2) for _ in range(n + 1)]
    ways[n][: slack + 1] = [1] * (slack + 1)
    for i in range(n - 1, -1, -1):
        for d in range(slack, -1, -1):
            here = ways[i + 1][d] if fits(i, i + d) else 0
            ways[i][d] = min(2, here + ways[i][d + 1])
    if not ways[0][0]:
        return OrderMatch(0)
    picked: List[int] = []
    i = d = 0
    while i < n:  # walk the fits: take wanted[i] here, or pass this entry over
        take = ways[i + 1][d] if fits(i, i + d) else 0
        if take and ways[i][d + 1]:
            return OrderMatch(ways[0][0], fork=i + d)
        if take:
            picked.append(i + d)
            i += 1
        else:
            d += 1
    return OrderMatch(ways[0][0], picked if ways[0][0] == 1 else None)

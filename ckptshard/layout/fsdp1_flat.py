"""torch FSDP1's flat parameters under ``use_orig_params=True``: where each original parameter's elements sit
in its unit's flat parameter, and so which slice of it each rank's optimizer state holds. Pure: no I/O.

A unit's flat parameter lays its parameters out in ``module.parameters()``
order (a tie once), each preceded by the padding that aligns it to 16 bytes
of the compute dtype (``align`` elements: 4 for fp32, 8 under bf16 mixed
precision), then pads the whole to a multiple of the world size; rank r
holds elements ``[r * S, (r + 1) * S)``. Which parameters share a unit is
stored in no file: :func:`find_units` tells it from the slices one world
size gave, over the groupings the parameter names allow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import combinations
from typing import Dict, List, Optional, Sequence, Tuple

ALIGNS = (4, 8, 2)  # elements of 16 bytes: fp32, bf16/fp16, fp64 compute

Slices = Dict[int, Tuple[int, int]]  # rank -> (first element of the parameter, count); ranks holding none left out


@dataclass(frozen=True)
class FlatUnits:
    """Parameters (indices in optimizer order) grouped into FSDP units, each unit in flat order; ``align``:
    the alignment in elements; ``wrapped``: the module name patterns that are units besides the root."""

    units: Tuple[Tuple[int, ...], ...]
    align: int
    wrapped: Tuple[str, ...]

    def slices(self, numels: Sequence[int], world: int) -> List[Slices]:
        """Each parameter's slice on each rank of ``world``."""
        out: List[Slices] = [{} for _ in numels]
        for members in self.units:
            offsets, total = flat_offsets([numels[i] for i in members], self.align)
            shard = -(-total // world)  # padded to a multiple of world, then cut in equal shards
            for i, at in zip(members, offsets):
                out[i] = param_slices(at, numels[i], shard)
        return out


def flat_offsets(numels: Sequence[int], align: int) -> Tuple[List[int], int]:
    """Each parameter's first element in the flat parameter, and the elements before world-size padding."""
    offsets, total = [], 0
    for n in numels:
        if total % align:
            total += align - total % align
        offsets.append(total)
        total += n
    return offsets, total


def param_slices(offset: int, numel: int, shard: int) -> Slices:
    """The ranks' slices of elements ``[offset, offset + numel)`` of a flat parameter cut in ``shard``-element
    shards."""
    out: Slices = {}
    at = offset
    while at < offset + numel:
        rank = at // shard
        end = min(offset + numel, (rank + 1) * shard)
        out[rank] = (at - offset, end - at)
        at = end
    return out


def module_patterns(names: Sequence[str]) -> List[str]:
    """The module paths above the parameters, layer indices as ``*`` (``model.layers.*``): the groupings a
    wrap policy can make (every module of a class is one pattern; the root is always a unit)."""
    seen: Dict[str, None] = {}
    for name in names:
        parts = name.split(".")[:-1]
        for k in range(1, len(parts) + 1):
            seen.setdefault(".".join("*" if p.isdigit() else p for p in parts[:k]))
    return list(seen)


def group(names: Sequence[str], wrapped: Sequence[str]) -> Tuple[Tuple[int, ...], ...]:
    """Units when the modules matching ``wrapped`` (and the root) are FSDP units: each parameter belongs to its
    deepest wrapped module; units in order of their first parameter."""
    patterns = [re.compile(re.escape(p).replace(r"\*", r"\d+") + r"$") for p in wrapped]
    units: Dict[str, List[int]] = {}
    for i, name in enumerate(names):
        parts = name.split(".")[:-1]
        owner = ""
        for k in range(len(parts), 0, -1):
            path = ".".join(parts[:k])
            if any(p.match(path) for p in patterns):
                owner = path
                break
        units.setdefault(owner, []).append(i)
    return tuple(tuple(m) for m in units.values())


def find_units(
    names: Sequence[str], numels: Sequence[int], seen: Sequence[Optional[Slices]], world: int, depth: int = 2
) -> List[FlatUnits]:
    """Every grouping (root plus up to ``depth`` wrapped module patterns) and alignment that gives exactly the
    slices ``seen`` at ``world`` ranks (None: a parameter without state, which shows nothing): the candidates
    for how the checkpoint was wrapped."""
    patterns = module_patterns(names)
    found: List[FlatUnits] = []
    done = set()
    for k in range(depth + 1):
        for wrapped in combinations(patterns, k):
            units = group(names, wrapped)
            for align in ALIGNS:
                if (units, align) in done:
                    continue
                done.add((units, align))
                candidate = FlatUnits(units, align, wrapped)
                got = candidate.slices(numels, world)
                if all(want is None or want == g for want, g in zip(seen, got)):
                    found.append(candidate)
    return found


def same_at(candidates: Sequence[FlatUnits], numels: Sequence[int], world: int) -> Optional[FlatUnits]:
    """The first candidate if every one gives the same slices at ``world`` ranks, else None."""
    first = candidates[0].slices(numels, world)
    return candidates[0] if all(c.slices(numels, world) == first for c in candidates[1:]) else None

"""Which dimension FSDP2 shards each parameter on at a world size: the rule the training code gave
``fully_shard`` (``shard_placement_fn``), told from the source's placements. Pure.

FSDP2 saves each parameter's placement, not the rule that chose it. Two rules are in wide use:

- ``dim0``: torch's default, ``Shard(0)`` for every parameter;
- ``divisible``: verl's ``get_shard_placement_fn(fsdp_size)``, the first dimension the number of ranks a
  parameter is sharded over divides, else ``Shard(0)`` (no padding where it can be avoided).

A source fits a rule if the rule, at the source's shard-group size, places every DTensor as it is placed.
Where it fits both and they place some DTensor differently at the new size, the files cannot say which the
training used: the user names it (``--placement``). ``keep`` keeps each DTensor's own dimension.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple

from ..errors import CheckpointError

RULES = {
    "dim0": "torch's default, Shard(0)",
    "divisible": "verl's shard_placement_fn, the first dimension the shard group divides",
    "keep": "each DTensor's dimension in the source",
}
Placed = Tuple[str, Tuple[int, ...], int]  # name, whole shape, shard dimension in the source


def rule_dim(rule: str, shape: Sequence[int], group: int, kept: int) -> int:
    """The dimension ``rule`` shards a tensor of ``shape`` on over ``group`` ranks (``kept``: the source's)."""
    if rule == "keep":
        return kept
    if rule == "divisible":
        return next((i for i, n in enumerate(shape) if n % group == 0), 0)
    return 0


def _fits(rule: str, placed: Sequence[Placed], group: int) -> bool:
    return all(rule_dim(rule, shape, group, dim) == dim for _, shape, dim in placed)


def _shown(name: str, shape: Sequence[int], dim: int) -> str:
    return f"{name} {tuple(shape)} is Shard({dim})"


def choose_rule(
    placed: Iterable[Placed], source_group: int, target_group: int, given: Optional[str], where: str
) -> str:
    """The rule the source's DTensors were placed by, for a reshard from ``source_group`` to ``target_group``
    ranks per shard group; ``given``: the user's ``--placement``, taken as it is."""
    if given is not None:
        if given not in RULES:
            raise CheckpointError(f"--placement {given!r}: choose one of {', '.join(RULES)}")
        return given
    placed = list(placed)
    fits: List[str] = [r for r in ("dim0", "divisible") if _fits(r, placed, source_group)]
    if not fits:
        off = [next(p for p in placed if rule_dim(r, p[1], source_group, p[2]) != p[2]) for r in ("dim0", "divisible")]
        raise CheckpointError(
            f"{where}: the placements follow neither torch's default (Shard(0)) nor verl's (the first dimension "
            f"{source_group} ranks divide): {', '.join(_shown(*p) for p in dict.fromkeys(off))}; --placement keep "
            "keeps each DTensor's dimension"
        )
    if len(fits) == 1:
        return fits[0]
    for name, shape, dim in placed:
        a, b = (rule_dim(r, shape, target_group, dim) for r in fits)
        if a != b:
            raise CheckpointError(
                f"{where}: the placements fit both torch's default (Shard(0)) and verl's shard_placement_fn (the "
                f"first dimension the shard group divides), and at {target_group} ranks they place {name} "
                f"{tuple(shape)} on Shard({a}) or Shard({b}): give --placement dim0 or --placement divisible"
            )
    return fits[0]

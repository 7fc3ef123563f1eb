"""Compare two checkpoints (weights, optimizer state) and loss curves, offline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

from ..plan.consolidate import consolidated_weights
from ..plan.optimizer import consolidated_optimizer
from ..read.source import open_checkpoint
from ..read.tensor_data import materialize


@dataclass
class Diff:
    """Differences found; ``tolerance`` (relative, 0: bit-exact) decides which tensors are named as differing."""

    tolerance: float = 0.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    problems: List[str] = field(default_factory=list)  # structural: keys, dtypes, shapes, exact values
    differing: List[Tuple[float, float, str]] = field(default_factory=list)  # (relative, absolute, name)
    first_step: Optional[str] = None  # the first step whose loss differs
    unsaved: List[str] = field(default_factory=list)  # state the checkpoint does not hold, found differing

    def tensor(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.dtype != b.dtype or a.shape != b.shape:
            self.problems.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            return
        if a.numel() == 0:
            return
        d = (a.double() - b.double()).abs().max().item()
        scale = max(b.double().abs().max().item(), 1e-12)
        self.max_abs = max(self.max_abs, d)
        self.max_rel = max(self.max_rel, d / scale)
        if d > 0 and d / scale > self.tolerance:
            self.differing.append((d / scale, d, name))

    def report(self, limit: int = 6) -> List[str]:
        """What a reader needs first: the first step that differs, state the checkpoint lacks, values that
        must be equal (step, learning rate, keys), then the largest tensor differences."""
        lines = ([self.first_step] if self.first_step else []) + self.unsaved + self.problems[:3]
        for rel, d, name in sorted(self.differing, reverse=True)[:3]:
            lines.append(f"{name}: differs by {d:.3g} ({rel:.3g} relative)")
        return (lines + self.problems[3:])[:limit]

    def exact(self, name: str, a: Any, b: Any) -> None:
        if a != b:
            self.problems.append(f"{name}: {a!r} vs {b!r}")

    @property
    def identical(self) -> bool:
        return not self.problems and self.max_abs == 0.0


def _value(x: Any) -> Any:
    if isinstance(x, tuple):  # torch's set_optimizer_state_dict hands Adam's betas back as a list
        return list(x)
    return x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x


def _mappings(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(v, Mapping) for v in x)


def compare_state(a: Mapping[str, Any], b: Mapping[str, Any], diff: Diff, where: str) -> None:
    if set(a) != set(b):
        diff.problems.append(f"{where}: keys differ: {sorted(set(a) ^ set(b))[:5]}")
    for k in sorted(set(a) & set(b), key=str):
        va, vb, name = a[k], b[k], f"{where}.{k}" if where else str(k)
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and (va.dim() > 0 or va.is_floating_point()):
            diff.tensor(name, va, vb)
        elif isinstance(va, Mapping) and isinstance(vb, Mapping):
            compare_state(va, vb, diff, name)
        elif _mappings(va) and _mappings(vb) and len(va) == len(vb):  # param_groups: entry by entry
            for i, (ga, gb) in enumerate(zip(va, vb)):
                compare_state(ga, gb, diff, f"{name}[{i}]")
        else:
            diff.exact(name, _value(va), _value(vb))


def compare_checkpoints(a: str, b: str, diff: Optional[Diff] = None) -> Diff:
    """Full weights and full optimizer state of two sharded fairscale checkpoints (any world sizes)."""
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    diff = diff if diff is not None else Diff()
    compare_state(materialize(consolidated_weights(ca)), materialize(consolidated_weights(cb)), diff, "weights")
    oa, ob = materialize(consolidated_optimizer(ca)), materialize(consolidated_optimizer(cb))
    compare_state(oa, ob, diff, "optimizer")
    return diff


def compare_losses(a: Sequence[float], b: Sequence[float], diff: Diff, first: int = 0) -> None:
    """Per-step losses; ``first``: how many steps came before the first entry (steps count from 1)."""
    if len(a) != len(b):
        diff.problems.append(f"losses: {len(a)} steps vs {len(b)}")
        return
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y and abs(x - y) > diff.tolerance * max(abs(x), 1e-12):
            diff.first_step = f"the loss of step {first + i + 1} differs first: {x:.9g} vs {y:.9g}"
            break
    diff.tensor("losses", torch.tensor(list(a), dtype=torch.float64), torch.tensor(list(b), dtype=torch.float64))


def compare_local(a: str, b: str) -> Diff:
    """Every stored tensor, optimizer moment and param_groups entry, rank by rank (same world size, fairscale)."""
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    diff = Diff()
    if ca.world_size != cb.world_size:
        diff.problems.append(f"world sizes {ca.world_size} vs {cb.world_size}")
        return diff
    for r in range(ca.world_size):
        compare_state(
            materialize(dict(ca.local_state(r, 0))), materialize(dict(cb.local_state(r, 0))), diff, f"rank{r}.model"
        )
        oa, ob = materialize(ca.optimizer_state(r)), materialize(cb.optimizer_state(r))
        compare_state(oa["state"], ob["state"], diff, f"rank{r}.optimizer.state")
        diff.exact(f"rank{r}.optimizer.param_groups", oa["param_groups"], ob["param_groups"])
    return diff

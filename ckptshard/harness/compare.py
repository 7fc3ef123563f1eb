"""Compare two checkpoints (weights, optimizer state) and loss curves, offline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Mapping, Sequence

import torch

from ..plan.consolidate import consolidated_weights
from ..plan.optimizer import consolidated_optimizer
from ..read.source import open_checkpoint
from ..read.tensor_data import materialize


@dataclass
class Diff:
    max_abs: float = 0.0
    max_rel: float = 0.0
    problems: List[str] = field(default_factory=list)  # structural: keys, dtypes, shapes, exact values

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

    def exact(self, name: str, a: Any, b: Any) -> None:
        if a != b:
            self.problems.append(f"{name}: {a!r} vs {b!r}")

    @property
    def identical(self) -> bool:
        return not self.problems and self.max_abs == 0.0


def _value(x: Any) -> Any:
    return x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x


def compare_state(a: Mapping[str, Any], b: Mapping[str, Any], diff: Diff, where: str) -> None:
    if set(a) != set(b):
        diff.problems.append(f"{where}: keys differ: {sorted(set(a) ^ set(b))[:5]}")
    for k in sorted(set(a) & set(b), key=str):
        va, vb = a[k], b[k]
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dim() > 0:
            diff.tensor(f"{where}.{k}", va, vb)
        elif isinstance(va, Mapping) and isinstance(vb, Mapping):
            compare_state(va, vb, diff, f"{where}.{k}")
        else:
            diff.exact(f"{where}.{k}", _value(va), _value(vb))


def compare_checkpoints(a: str, b: str) -> Diff:
    """Full weights and full optimizer state of two sharded checkpoints (any world sizes)."""
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    diff = Diff()
    compare_state(materialize(consolidated_weights(ca)), materialize(consolidated_weights(cb)), diff, "weights")
    oa, ob = materialize(consolidated_optimizer(ca)), materialize(consolidated_optimizer(cb))
    compare_state(oa["state"], ob["state"], diff, "optimizer.state")
    diff.exact("optimizer.param_groups", oa["param_groups"], ob["param_groups"])
    return diff


def compare_losses(a: Sequence[float], b: Sequence[float], diff: Diff) -> None:
    if len(a) != len(b):
        diff.problems.append(f"losses: {len(a)} steps vs {len(b)}")
        return
    diff.tensor("losses", torch.tensor(list(a), dtype=torch.float64), torch.tensor(list(b), dtype=torch.float64))


def compare_local(a: str, b: str) -> Diff:
    """Every stored tensor, optimizer moment and param_groups entry, rank by rank (same world size)."""
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

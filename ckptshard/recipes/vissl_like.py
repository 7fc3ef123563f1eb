"""The built-in verify-resume model as a recipe: a VISSL-like trunk and SwAV head with VISSL's wrapping flow
(fairscale FSDP; fp32 unflattened prototypes; the heads wrapped on their own, then the root)."""

from __future__ import annotations

from typing import Any, Tuple

import torch
import torch.nn as nn

from ..testing.fixtures import make_optimizer, wrap_fixture_model
from ..testing.model import VisslLikeModel, local_batch, loss_fn


class VisslLike:
    heads = ("heads.0",)
    container = "fairseq"
    tolerance = 1e-5

    def __init__(self, variant: str = "fp32") -> None:
        self.variant = variant  # fp32, mixed (fp16 compute), frozen (trunk not trained), groups (two groups)

    def build_model(self) -> nn.Module:
        return VisslLikeModel()

    def wrap(self, model: nn.Module) -> Any:
        # The harness builds every rank's model from one seed: the heads start identical without re-init.
        root = wrap_fixture_model(model, self.variant, init=None)
        for m in root.modules():  # batch statistics would depend on the per-rank batch, so on the world size
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
        return root

    def make_optimizer(self, root: nn.Module) -> torch.optim.Optimizer:
        return make_optimizer(root.parameters(), self.variant)

    def batch(self, step: int, rank: int, world_size: int) -> Tuple[torch.Tensor, ...]:
        return local_batch(step, rank, world_size)

    def loss(self, root: nn.Module, batch: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, *targets = batch
        return loss_fn(root(x), tuple(targets))


RECIPE = VisslLike("fp32")
MIXED = VisslLike("mixed")
FROZEN = VisslLike("frozen")
GROUPS = VisslLike("groups")

"""A tied-embedding language model under torch ``fully_shard`` (each block its own unit, then the root),
AdamW with weight decay and a step LR scheduler: verl's training loop in miniature. The harness saves and
resumes it as verl does (per-rank model, optimizer and extra-state files)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..testing.torch_fsdp_runs import VOCAB, TiedLM

GLOBAL_BATCH, LENGTH = 12, 5


class VerlFsdp2Recipe:
    def build_model(self) -> nn.Module:
        return TiedLM()

    def wrap(self, model: nn.Module) -> Any:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    def make_optimizer(self, root: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(root.parameters(), lr=1e-2, weight_decay=0.1)

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def batch(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=g)
        return tokens[rank * GLOBAL_BATCH // world_size : (rank + 1) * GLOBAL_BATCH // world_size]

    def loss(self, root: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = root(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


RECIPE = VerlFsdp2Recipe()

"""A small language model with tied input and output embeddings, under fairscale FSDP: three encoder layers
each in its own instance (one nested inside another), the root holding the embeddings, a 0-dim temperature
and a BatchNorm, and SGD with momentum."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..testing.transformer import VOCAB, TinyLM

GLOBAL_BATCH, LENGTH = 12, 6


class TransformerRecipe:
    def build_model(self) -> nn.Module:
        return TinyLM()

    def wrap(self, model: nn.Module) -> Any:
        from fairscale.nn import FullyShardedDataParallel as FSDP

        model.layers[0] = FSDP(model.layers[0])
        model.layers[1] = FSDP(model.layers[1])
        model.layers[2].linear1 = FSDP(model.layers[2].linear1)
        model.layers[2] = FSDP(model.layers[2])
        model.norm.eval()  # batch statistics would depend on the world size
        return FSDP(model)

    def make_optimizer(self, root: nn.Module) -> torch.optim.Optimizer:
        # Not Adam: an attention key bias has no true gradient, only rounding noise, which Adam scales up to
        # full-size steps whose sign depends on the reduction order: runs at two world sizes would part.
        return torch.optim.SGD(root.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)

    def batch(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(step))
        per = GLOBAL_BATCH // world_size
        return tokens[rank * per : (rank + 1) * per]

    def loss(self, root: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = root(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


RECIPE = TransformerRecipe()

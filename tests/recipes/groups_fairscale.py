"""A recipe written only against the public recipe API: a small classifier under fairscale FSDP (two trunk
blocks and a head, each its own instance, then the root), AdamW in two param groups (weight decay on
matrices only) and a linear warm-up LR scheduler."""

import torch
import torch.nn as nn
from fairscale.nn import FullyShardedDataParallel as FSDP

GLOBAL_BATCH, DIM, CLASSES = 12, 9, 5


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM), nn.GELU()) for _ in range(2)]
        )
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class GroupsRecipe:
    heads = ("head",)

    def build_model(self):
        return Classifier()

    def wrap(self, model):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(block)
        model.head = FSDP(model.head)
        return FSDP(model)

    def make_optimizer(self, root):
        matrices = [p for p in root.parameters() if p.dim() > 1]
        rest = [p for p in root.parameters() if p.dim() <= 1]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2)

    def make_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))

    def batch(self, step, rank, world_size):
        g = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
        y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)
        share = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
        return {"x": x[share], "y": y[share]}

    def loss(self, root, batch):
        return nn.functional.cross_entropy(root(batch["x"]), batch["y"])


RECIPE = GroupsRecipe()

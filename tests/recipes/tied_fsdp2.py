"""A recipe written only against the public recipe API: a language model whose output layer shares the
embedding's weight, under torch fully_shard (each block its own unit, then the root), AdamW and a cosine
LR schedule."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

VOCAB, DIM, GLOBAL_BATCH, LENGTH = 11, 8, 12, 6


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM)) for _ in range(2)]
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(h)


class TiedRecipe:
    heads = ("lm_head",)

    def build_model(self):
        return TiedModel()

    def wrap(self, model):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    def make_optimizer(self, root):
        return torch.optim.AdamW(root.parameters(), lr=2e-2, weight_decay=0.01)

    def make_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)

    def batch(self, step, rank, world_size):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(step))
        return tokens[rank * GLOBAL_BATCH // world_size : (rank + 1) * GLOBAL_BATCH // world_size]

    def loss(self, root, tokens):
        logits = root(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


RECIPE = TiedRecipe()

"""Recipes that break verify-resume's rules, or whose checkpoints miss state: each must be caught."""

import torch
import torch.distributed as dist
import torch.nn as nn
from groups_fairscale import Classifier, GroupsRecipe


class Scaled(Classifier):
    """Counts its forward calls in a non-persistent buffer that scales the output: state no checkpoint holds."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * (1 + 0.1 * self.calls)


class NonPersistentBuffer(GroupsRecipe):
    def build_model(self):
        return Scaled()


class HiddenScheduler(GroupsRecipe):
    """An LR scheduler the harness never sees: stepped inside loss(), so never saved."""

    make_scheduler = None

    def make_optimizer(self, root):
        optim = super().make_optimizer(root)
        self._sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
        return optim

    def loss(self, root, batch):
        if getattr(self, "_calls", 0):
            self._sched.step()
        self._calls = getattr(self, "_calls", 0) + 1
        return super().loss(root, batch)


class WorldSizeBatch(GroupsRecipe):
    """Eight samples per rank, whatever the world size: the global batch grows with it."""

    def batch(self, step, rank, world_size):
        g = torch.Generator().manual_seed(step * 100 + rank)
        return {"x": torch.randn(8, 9, generator=g), "y": torch.randint(0, 5, (8,), generator=g)}


class RankModel(GroupsRecipe):
    def build_model(self):
        torch.manual_seed(dist.get_rank())
        return Classifier()


class NoLoss:
    def build_model(self):
        return nn.Linear(2, 2)

    wrap = make_optimizer = batch = build_model


class Hang(GroupsRecipe):
    """Rank 1's batch() never returns from step 2 on (the parent's own check of batch() runs step 0); each rank
    writes its pid into $HANG_PIDS first, so a test can tell its ranks were all stopped."""

    def batch(self, step, rank, world_size):
        import os
        import time

        if dist.is_initialized() and os.environ.get("HANG_PIDS"):
            open(os.path.join(os.environ["HANG_PIDS"], str(os.getpid())), "w").close()
            while rank == 1 and step >= 2:
                time.sleep(1)
        return super().batch(step, rank, world_size)


NON_PERSISTENT = NonPersistentBuffer()
HANG = Hang()
HIDDEN_SCHEDULER = HiddenScheduler()
WORLD_SIZE_BATCH = WorldSizeBatch()
RANK_MODEL = RankModel()
NO_LOSS = NoLoss()

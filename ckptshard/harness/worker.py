"""One training process of a verify-resume run (spawned on every rank)."""

from __future__ import annotations

import os
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

from ..fsdp.loading import load_checkpoint
from ..testing.fixtures import make_optimizer, wrap_fixture_model
from ..testing.model import VisslLikeModel, local_batch, loss_fn

CONTAINER_FILES = {
    "fairseq": ("checkpoint_last-shard{}.pt", "fsdp_metadata"),
    "metaseq": ("checkpoint_last-model_part-0-shard{}.pt", "shard_metadata"),
}


def save_checkpoint(
    root: Any, optim: torch.optim.Optimizer, folder: str, rank: int, step: int, container: str = "fairseq"
) -> None:
    """One rank's file, as fairseq or metaseq save it."""
    name, meta_key = CONTAINER_FILES[container]
    os.makedirs(folder, exist_ok=True)
    torch.save(
        {
            "model": root.local_state_dict(),
            meta_key: root.local_metadata_dict(),
            "last_optimizer_state": optim.state_dict(),
            "optimizer_history": [{"num_updates": step}],
            "extra_state": {"epoch": 1},
            "cfg": {},
        },
        os.path.join(folder, name.format(rank)),
    )


def freeze_batchnorm(model: nn.Module) -> None:
    """BatchNorm in eval mode: batch statistics would depend on the per-rank batch, so on the world size."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def train_worker(rank: int, world_size: int, job: Dict[str, Any]) -> None:
    device = torch.device(job.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    torch.manual_seed(job["seed"])
    model = VisslLikeModel().to(device)
    load = job.get("load") or {}
    mode = load.get("mode")
    if mode == "full-before":  # into the plain model, before any wrapping
        load_checkpoint(model, load["path"])
    root = wrap_fixture_model(model, job["variant"], init=None if mode == "full-before" else "seed")
    freeze_batchnorm(root)
    optim = make_optimizer(root.parameters(), job["variant"])
    with_optim = optim if load.get("optimizer", True) else None
    if mode == "local":
        load_checkpoint(root, load["path"], with_optim)
    elif mode == "full-after":
        load_checkpoint(root, load["path"], with_optim, full_optimizer=load.get("optim_path"))
    elif mode == "full-before" and with_optim is not None:
        load_checkpoint(root, load["path"], with_optim, weights=False, full_optimizer=load.get("optim_path"))
    losses = []
    for step in range(job["start"], job["stop"]):
        x, *ys = (t.to(device) for t in local_batch(step, rank, world_size, job["seed"]))
        loss = loss_fn(root(x), tuple(ys))
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
        if job.get("save_at") == step + 1:
            save_checkpoint(root, optim, job["ckpt"], rank, step + 1, job["container"])
    save_checkpoint(root, optim, job["final"], rank, job["stop"], job["container"])
    if rank == 0:
        torch.save({"losses": losses}, os.path.join(job["final"], "losses.pt"))

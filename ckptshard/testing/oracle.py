"""What real fairscale FSDP at world size N saves for given full weights: the test oracle.

For each source fixture, a model wrapped at world size N loads the full
``state_dict()`` and the full optimizer state (``get_shard_from_optim_state_dict``),
and records every rank's ``local_state_dict()``, ``local_metadata_dict()``,
the VISSL parts' own local state, and the optimizer shard. It then loads
each candidate output (ckptshard's resharded files) with
``load_local_state_dict(strict=True)`` and ``optimizer.load_state_dict`` and
records what the model's full state looks like afterwards.
"""

from __future__ import annotations

import copy
import os
from typing import Dict, List

import torch

from ..fsdp.launch import run_world
from ..fsdp.state import init_param_attributes
from .fixtures import inner, make_optimizer, wrap_fixture_model
from .model import VisslLikeModel


def _oracle_worker(rank: int, world_size: int, jobs: List[Dict[str, str]]) -> None:
    for job in jobs:
        torch.manual_seed(1234)  # weights are overwritten by the load below
        root = wrap_fixture_model(VisslLikeModel(), job["variant"])
        optim = make_optimizer(root.parameters(), job["variant"])
        full = torch.load(job["full"], weights_only=True)
        root.load_state_dict(full)
        shard = None
        if job["full_optim"]:
            full_optim = torch.load(job["full_optim"], weights_only=True)
            shard = root.get_shard_from_optim_state_dict(copy.deepcopy(full_optim))
            optim.load_state_dict(copy.deepcopy(shard))
        m = inner(root)
        record = {
            "local": root.local_state_dict(),
            "meta": root.local_metadata_dict(),
            "trunk": m.trunk.local_state_dict(),
            "trunk_meta": m.trunk.local_metadata_dict(),
            "head": m.heads[0].local_state_dict(),
            "head_meta": m.heads[0].local_metadata_dict(),
            "optim": shard,
        }
        os.makedirs(job["out"], exist_ok=True)
        torch.save(record, os.path.join(job["out"], f"rank{rank}.pt"))
        candidate = job.get("candidate")
        if candidate:
            # A fresh model at N loads ckptshard's output strictly: weights and optimizer.
            torch.manual_seed(99)
            root2 = wrap_fixture_model(VisslLikeModel(), job["variant"])
            optim2 = make_optimizer(root2.parameters(), job["variant"])
            init_param_attributes(root2)
            ours = torch.load(os.path.join(candidate, f"checkpoint_last-shard{rank}.pt"), weights_only=True)
            root2.load_local_state_dict(ours["model"], strict=True)
            optim2.load_state_dict(ours["last_optimizer_state"])  # the model's own optimizer takes it
            after = root2.state_dict()
            loaded_optim = optim2.state_dict()
            if rank == 0:
                torch.save({"state_dict": after}, os.path.join(job["out"], "candidate_full.pt"))
            torch.save({"optim": loaded_optim}, os.path.join(job["out"], f"candidate_optim{rank}.pt"))


def build_oracles(world_size: int, jobs: List[Dict[str, str]]) -> None:
    """Run every job (dict with full, full_optim, variant, out, optional candidate) at ``world_size``."""
    run_world(_oracle_worker, world_size, jobs)

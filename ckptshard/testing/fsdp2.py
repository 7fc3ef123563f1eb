"""Load DCP checkpoints into torch's own FSDP2 (``fully_shard``) on gloo ranks.

The oracle for ``convert --to dcp``: the fixture model is wrapped with
``fully_shard`` the way its fairscale run was nested (each block, the gate,
the trunk, each prototype, the head, the root), loaded with ``dcp.load`` and
``set_model_state_dict``/``set_optimizer_state_dict``, and its full state is
gathered back with torch's own API for the test to compare offline.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import torch

from ..fsdp.launch import run_world
from .fixtures import LR, global_step
from .model import PROTOTYPES, VisslLikeModel


def fsdp2_model() -> Any:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1234)  # not the fixture's seed: loading must overwrite every value
    model = VisslLikeModel()
    trunk, head = model.trunk, model.heads[0]
    for block in trunk.blocks:
        fully_shard(block)
    fully_shard(trunk.gate)
    fully_shard(trunk)
    for j in range(len(PROTOTYPES)):
        fully_shard(getattr(head, f"prototypes{j}"))
    fully_shard(head)
    fully_shard(model)
    return model


def _load_worker(rank: int, world_size: int, jobs: List[Dict[str, Any]]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.utils._pytree import tree_map

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for job in jobs:
        model = fsdp2_model()
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=job["dcp"])
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optim, state["optim"])
        # At world size 1 the "full" state dict aliases the live parameters: copy it before stepping.
        result: Dict[str, Any] = tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
            {
                "model": get_model_state_dict(model, options=full),
                "optim": get_optimizer_state_dict(model, optim, options=full),
            },
        )
        if job.get("save"):  # torch's own DCP writer, for the reader's tests
            dcp.save(
                {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)},
                checkpoint_id=job["save"],
            )
        if job.get("next_step") is not None:
            result["loss"] = global_step(model, optim, rank, world_size, job["next_step"], 0)
            result["after"] = get_model_state_dict(model, options=full)
        if rank == 0:
            torch.save(result, job["out"])


def load_in_fsdp2(world_size: int, jobs: List[Dict[str, Any]]) -> None:
    """For each job ``{"dcp": folder, "out": file, "next_step": step or None, "save": folder or None}``,
    in one process group
    of ``world_size`` ranks: load the DCP folder into FSDP2 and save the gathered state (rank 0) to
    ``out``; with ``next_step``, also train that step (BatchNorm in eval mode) and save its global
    loss and the state after it; with ``save``, re-save the loaded state there with ``dcp.save``."""
    for job in jobs:
        os.makedirs(os.path.dirname(job["out"]) or ".", exist_ok=True)
    run_world(_load_worker, world_size, jobs)


def _save_sharded_worker(rank: int, world_size: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(7)
    full = {
        "cols": torch.randn(5, 7, generator=g),
        "rows": torch.randn(7, 3, 2, generator=g),
        "mid": torch.randn(3, 5, 4, generator=g),
    }
    state = {
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),  # tensor-parallel style: a run per row
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "mid": distribute_tensor(full["mid"], mesh, [Shard(1)]),
        "plain": full["cols"].double(),
    }
    dcp.save({"model": state}, checkpoint_id=out)
    if rank == 0:
        torch.save(full, out + ".full.pt")


def save_sharded_dcp(world_size: int, out: str) -> None:
    """A DCP folder torch writes from DTensors sharded along dims 0 and 1 (``out + ".full.pt"``: the values)."""
    run_world(_save_sharded_worker, world_size, out)

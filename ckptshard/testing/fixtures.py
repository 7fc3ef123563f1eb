"""Build real fairscale FSDP checkpoints: train a few steps on W ranks, save every format.

Layout of ``build_fixture(root, W)``'s output folder::

    fairseq/checkpoint_last-shard{r}.pt             model, fsdp_metadata, last_optimizer_state, cfg, ...
    metaseq/checkpoint_last-model_part-0-shard{r}.pt model, shard_metadata, last_optimizer_state, ...
    vissl/model_phase2.torch                         {"type": "shard_list", "shards": [...]}
    vissl/model_phase2_shard{r}.torch                classy_state_dict.base_model.{model,meta}.{trunk,heads}
    ref/full_state_dict.pt                           live model.state_dict() (rank 0)
    ref/full_optim.pt                                gather_full_optim_state_dict() (rank 0; not at world size 1)
    ref/losses.pt                                    per-step losses of rank 0
    ref/next_step.pt                                 (next_step=True: BatchNorm in eval mode throughout)
                                                     one more step: its global loss, the state_dict() after it
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

from ..fsdp.launch import run_world
from .model import VisslLikeModel, fixture_wrap_kwargs, local_batch, loss_fn

STEPS = 3
LR = 1e-2


def wrap_fixture_model(model: VisslLikeModel, variant: str, init: Optional[str] = "seed") -> Any:
    """Nested FSDP wrapping of the fixture trunk, then the library's VISSL-style head and root wrap."""
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ..fsdp.cpu_compat import cpu_fsdp_kwargs
    from ..fsdp.wrapping import wrap_heads_and_model

    cfg = fixture_wrap_kwargs(variant)
    base = cpu_fsdp_kwargs()
    if variant == "half":
        model.trunk.half()
        model.input_dtype = torch.float16
    if variant == "frozen":  # linear evaluation: a frozen trunk, only the head trains
        model.trunk.requires_grad_(False)
    trunk = model.trunk
    for i in range(len(trunk.blocks)):
        trunk.blocks[i] = FSDP(trunk.blocks[i], **base, **cfg["trunk"])
    trunk.gate = FSDP(trunk.gate, **base, **cfg["trunk"])
    model.trunk = FSDP(trunk, **base, **cfg["trunk"])
    # The root casts inputs to fp16 when mixed precision is on, as VISSL's root wrap does.
    return wrap_heads_and_model(
        model, head_config=cfg["head"], root_config=cfg["root"], prototypes_config=cfg["prototypes"], init=init
    )


def inner(root: Any) -> VisslLikeModel:
    """The user's module under the root FSDP wrapper."""
    return root.module.module


def train_steps(
    root: Any, optim: torch.optim.Optimizer, rank: int, world_size: int, steps: range, seed: int
) -> List[float]:
    losses = []
    for step in steps:
        x, *ys = local_batch(step, rank, world_size, seed)
        loss = loss_fn(root(x), tuple(ys))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def make_optimizer(params, variant: str) -> torch.optim.Optimizer:
    """Adam, or SGD with momentum for the pure-fp16 variant (Adam's eps underflows in fp16).

    Over the trainable parameters only, as training scripts build it: with a
    frozen trunk the optimizer numbers fewer entries than FSDP has flat parameters.
    """
    params = [p for p in params if p.requires_grad]
    if variant == "groups":  # a learning rate of its own for the head, listed first: ids out of model order
        return torch.optim.Adam([{"params": params[-3:], "lr": 2 * LR}, {"params": params[:-3]}], lr=LR)
    if variant == "half":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=LR)


def global_step(model: Any, optim: torch.optim.Optimizer, rank: int, world_size: int, step: int, seed: int) -> float:
    """One training step with BatchNorm in eval mode; the loss of the whole global batch.

    Eval mode and the mean over ranks make the loss the same at every world
    size (up to reduction order), so runs at different world sizes compare.
    """
    import torch.distributed as dist

    model.eval()
    x, *ys = local_batch(step, rank, world_size, seed)
    loss = loss_fn(model(x), tuple(ys))
    loss.backward()
    optim.step()
    optim.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world_size


def _fixture_worker(
    rank: int, world_size: int, out: str, variant: str, seed: int, steps: int, next_step: bool = False
) -> None:
    torch.manual_seed(seed)
    root = wrap_fixture_model(VisslLikeModel(), variant)
    optim = make_optimizer(root.parameters(), variant)
    if next_step:
        # BatchNorm statistics are per rank and per batch: in eval mode every rank keeps the same
        # buffers, so the next step's loss is the same at every world size.
        root.eval()
    losses = train_steps(root, optim, rank, world_size, range(steps), seed)
    full = root.state_dict()
    # fairscale cannot gather at world size 1 (no _full_param_padded on unsharded params), nor
    # with frozen parameters (it takes optimizer entry k for FSDP instance k), nor with several
    # param groups (it asserts one).
    full_optim = (
        root.gather_full_optim_state_dict(optim) if world_size > 1 and variant not in ("frozen", "groups") else None
    )
    local, meta = root.local_state_dict(), root.local_metadata_dict()
    osd = optim.state_dict()
    m = inner(root)
    trunk_sd, trunk_meta = m.trunk.local_state_dict(), m.trunk.local_metadata_dict()
    head_sd, head_meta = m.heads[0].local_state_dict(), m.heads[0].local_metadata_dict()
    save_containers(out, rank, world_size, local, meta, osd, trunk_sd, trunk_meta, [head_sd], [head_meta], steps)
    if rank == 0:
        os.makedirs(os.path.join(out, "ref"), exist_ok=True)
        torch.save(full, os.path.join(out, "ref", "full_state_dict.pt"))
        if full_optim is not None:
            torch.save(full_optim, os.path.join(out, "ref", "full_optim.pt"))
        torch.save(
            {"losses": losses, "variant": variant, "world_size": world_size}, os.path.join(out, "ref", "losses.pt")
        )
    if next_step:
        # gather_full_optim_state_dict left Python floats in the live state; torch's Adam steps on tensors.
        for st in optim.state.values():
            if isinstance(st.get("step"), float):
                st["step"] = torch.tensor(st["step"], dtype=torch.float32)
        loss = global_step(root, optim, rank, world_size, steps, seed)
        after = root.state_dict()
        if rank == 0:
            torch.save(
                {"loss": loss, "step": steps, "full_state_dict": after}, os.path.join(out, "ref", "next_step.pt")
            )


def save_containers(
    out: str,
    rank: int,
    world_size: int,
    local: Dict[str, torch.Tensor],
    meta: Dict[str, Any],
    osd: Dict[str, Any],
    trunk_sd: Dict[str, torch.Tensor],
    trunk_meta: Dict[str, Any],
    head_sds: List[Dict[str, torch.Tensor]],
    head_metas: List[Dict[str, Any]],
    steps: int,
) -> None:
    """One rank's files in the fairseq, metaseq and VISSL containers."""
    for d in ("fairseq", "metaseq", "vissl"):
        os.makedirs(os.path.join(out, d), exist_ok=True)
    fairseq_osd = dict(osd, loss_scale=128.0)  # fairseq's FP16 optimizer adds this
    torch.save(
        {
            "model": local,
            "fsdp_metadata": meta,
            "last_optimizer_state": fairseq_osd,
            "cfg": {"model": {"arch": "vissl_like"}, "optimization": {"lr": [LR]}},
            "args": None,
            "optimizer_history": [
                {
                    "criterion_name": "CrossEntropy",
                    "optimizer_name": "FairseqAdam",
                    "lr_scheduler_state": {"best": None},
                    "num_updates": steps,
                }
            ],
            "extra_state": {"epoch": 1, "train_iterator": {"epoch": 1, "iterations_in_epoch": steps}},
            "task_state": {},
        },
        os.path.join(out, "fairseq", f"checkpoint_last-shard{rank}.pt"),
    )
    torch.save(
        {
            "model": local,
            "shard_metadata": meta,
            "last_optimizer_state": osd,
            "cfg": {"model": {"arch": "vissl_like"}},
            "optimizer_history": [{"num_updates": steps}],
            "extra_state": {"epoch": 1},
        },
        os.path.join(out, "metaseq", f"checkpoint_last-model_part-0-shard{rank}.pt"),
    )
    torch.save(
        {
            "type": "shard",
            "phase_idx": 2,
            "iteration": steps,
            "train_phase_idx": 2,
            "classy_state_dict": {
                "base_model": {
                    "model": {"trunk": trunk_sd, "heads": head_sds},
                    "meta": {"trunk": trunk_meta, "heads": head_metas},
                },
                "optimizer": {"optim": osd, "param_groups_override": {}},
                "train": True,
            },
        },
        os.path.join(out, "vissl", f"model_phase2_shard{rank}.torch"),
    )
    if rank == 0:
        torch.save(
            {"type": "shard_list", "shards": [f"model_phase2_shard{r}.torch" for r in range(world_size)]},
            os.path.join(out, "vissl", "model_phase2.torch"),
        )


def build_fixture(
    out: str, world_size: int, variant: str = "mixed", seed: int = 0, steps: int = STEPS, next_step: bool = False
) -> str:
    """Train the fixture model on ``world_size`` gloo ranks and save every container into ``out``."""
    os.makedirs(out, exist_ok=True)
    run_world(_fixture_worker, world_size, out, variant, seed, steps, next_step)
    return out


CONTAINERS = {
    "fairseq": "fairseq",
    "metaseq": "metaseq",
    "vissl": os.path.join("vissl", "model_phase2.torch"),
}


def source_path(fixture_dir: str, container: str) -> str:
    return os.path.join(fixture_dir, CONTAINERS[container])

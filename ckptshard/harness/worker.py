"""One rank of a verify-resume run: the recipe's model, wrapping, optimizer and data, trained for a range of
steps, from scratch or from a checkpoint, saving the framework's own per-rank files."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..fsdp.launch import beat
from ..fsdp.loading import load_checkpoint
from .frameworks import (
    RecipeError,
    fairscale_cpu_defaults,
    framework_of,
    full_state,
    load_full,
    load_local,
    save_rank,
    scheduler_state,
    unsaved_buffers,
)
from .recipe import tensor_digests, to_device


def _call(recipe: Any, member: str, *args: Any) -> Any:
    """A recipe member, its own failures turned into one line that names it."""
    try:
        return getattr(recipe, member)(*args)
    except RecipeError:
        raise
    except Exception as e:
        raise RecipeError(f"recipe {member}() failed: {type(e).__name__}: {e}") from e


def step_seed(seed: int, step: int, rank: int) -> int:
    """Every step starts from its own RNG state (dropout, sampling in the model), so a resumed run draws
    what the uninterrupted one drew."""
    return (seed * 1_000_003 + step) * 4099 + rank


def _same_on_every_rank(model: torch.nn.Module, rank: int, world: int) -> None:
    digests = tensor_digests(model)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, digests)
    for r, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            names = sorted(set(theirs) ^ set(gathered[0])) or [n for n in theirs if theirs[n] != gathered[0][n]]
            raise RecipeError(
                f"recipe build_model() differs between ranks: {names[0]} on rank {r} is not rank 0's (every rank "
                "is seeded the same; a model must not depend on the rank or on unseeded randomness)"
            )


def _check_heads(recipe: Any, model: torch.nn.Module) -> None:
    modules = dict(model.named_modules())
    unknown = [h for h in getattr(recipe, "heads", ()) if h not in modules]
    if unknown:
        raise RecipeError(f"recipe heads: build_model()'s model has no module {unknown[0]!r}")


def recipe_worker(rank: int, world: int, job: Dict[str, Any]) -> None:
    try:
        _train(rank, world, job)
    except CheckpointError as e:  # a broken recipe rule or a bad checkpoint: one line for the user
        with open(f"{job['errors']}.rank{rank}", "w") as f:
            f.write(str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise


def _train(rank: int, world: int, job: Dict[str, Any]) -> None:
    recipe = job["recipe"].load()
    device = torch.device(job.get("device", "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    torch.manual_seed(job["seed"])
    model = _call(recipe, "build_model")
    _same_on_every_rank(model, rank, world)
    _check_heads(recipe, model)
    model = model.to(device)
    load: Dict[str, Any] = job.get("load") or {}
    mode = load.get("mode")
    trust = bool(load.get("trust_pickles"))
    if mode == "full-before":  # into the plain model, before any wrapping
        load_checkpoint(model, load["path"], trust_pickles=trust)
    with fairscale_cpu_defaults():
        root = _call(recipe, "wrap", model)
    framework = framework_of(root)
    optim = _call(recipe, "make_optimizer", root)
    sched = _call(recipe, "make_scheduler", optim) if callable(getattr(recipe, "make_scheduler", None)) else None
    with_optim = optim if load.get("optimizer", True) else None
    if mode == "local":
        load_local(framework, root, with_optim, load["path"], rank, world, trust)
    elif mode in ("full-before", "full-after"):
        load_full(framework, root, with_optim, load["path"], load["optim_path"], weights=mode == "full-after")
    if mode and sched is not None:
        _load_scheduler(sched, framework, load["scheduler_from"], trust)
    losses = []
    container = job["container"]
    for step in range(job["start"], job["stop"]):
        beat(job["beat"])
        torch.manual_seed(step_seed(job["seed"], step, rank))
        batch = to_device(_call(recipe, "batch", step, rank, world), device)
        loss = _call(recipe, "loss", root, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if sched is not None:
            sched.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if job.get("save_at") == step + 1:
            save_rank(framework, root, optim, sched, job["ckpt"], rank, world, step + 1, container)
    beat(job["beat"])
    save_rank(framework, root, optim, sched, job["final"], rank, world, job["stop"], container)
    full = full_state(framework, root, optim)
    if rank == 0:
        run = {
            "framework": framework,
            "losses": losses,
            "unsaved_buffers": unsaved_buffers(root),
            "scheduler": sched.state_dict() if sched is not None else None,
            "full": full,
        }
        torch.save(run, os.path.join(job["final"], "run.pt"))


def _load_scheduler(sched: Any, framework: str, folder: str, trust_pickles: bool) -> None:
    state: Optional[Dict[str, Any]] = scheduler_state(framework, folder, trust_pickles)
    if not isinstance(state, dict):
        raise RecipeError(f"{folder}: the recipe has an LR scheduler, and the checkpoint holds no state for it")
    sched.load_state_dict(state)

"""What verify-resume does per FSDP framework: save a rank's checkpoint files, load them back, take the
full state for comparison.

fairscale roots save fairseq's or metaseq's per-rank files (weights, metadata,
optimizer, the LR scheduler in ``optimizer_history``); torch ``fully_shard``
roots save verl's per-rank files (model, optimizer, ``extra_state`` with the
LR scheduler and RNG states).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import CheckpointError
from ..fsdp.loading import load_checkpoint
from ..fsdp.state import torch_full_state
from ..read.tensor_data import materialize
from ..read.torch_file import read_entry

CONTAINER_FILES = {
    "fairseq": ("checkpoint_last-shard{}.pt", "fsdp_metadata"),
    "metaseq": ("checkpoint_last-model_part-0-shard{}.pt", "shard_metadata"),
}
VISSL_SHARD, VISSL_LIST = "model_iteration_shard{}.torch", "model_iteration.torch"
VERL_FILES = ("model", "optim", "extra_state")
_WRAPPER_PARTS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_fpw_module|_checkpoint_wrapped_module)(?=\.|$)")


class RecipeError(CheckpointError):
    """The recipe broke a rule, or its own code failed; one line for the user."""


def _fsdp2_module_type() -> Optional[type]:
    for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        with contextlib.suppress(ImportError, AttributeError):
            module = __import__(where, fromlist=["FSDPModule"])
            return module.FSDPModule
    return None


def framework_of(root: nn.Module) -> str:
    """``"fairscale"`` or ``"fsdp2"``, from the type of the root ``wrap`` returned."""
    with contextlib.suppress(ImportError):
        from fairscale.nn import FullyShardedDataParallel

        if isinstance(root, FullyShardedDataParallel):
            return "fairscale"
    fsdp2 = _fsdp2_module_type()
    if fsdp2 is not None and isinstance(root, fsdp2):
        return "fsdp2"
    raise RecipeError(
        f"wrap() returned a {type(root).__name__}: verify-resume runs fairscale FullyShardedDataParallel "
        "and torch fully_shard roots"
    )


@contextlib.contextmanager
def fairscale_cpu_defaults() -> Iterator[None]:
    """fairscale FSDP instances built inside get the CPU settings (compute device, no bucketing) unless the
    recipe passes its own: a recipe stays the same on CPU and GPU."""
    from ..fsdp.cpu_compat import cpu_fsdp_kwargs

    defaults = cpu_fsdp_kwargs()
    try:
        from fairscale.nn import FullyShardedDataParallel
    except ImportError:
        defaults = {}
    if not defaults:
        yield
        return
    original = FullyShardedDataParallel.__init__

    def init(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        for k, v in defaults.items():
            kwargs.setdefault(k, v)
        original(self, module, *args, **kwargs)

    FullyShardedDataParallel.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        FullyShardedDataParallel.__init__ = original  # type: ignore[method-assign]


def clean_name(name: str) -> str:
    """A parameter or buffer name without the wrappers' own path components."""
    return _WRAPPER_PARTS.sub("", name).lstrip(".")


def unsaved_buffers(root: nn.Module) -> Dict[str, torch.Tensor]:
    """The live model's non-persistent buffers: state no checkpoint holds, which a resumed run must rebuild."""
    out = {}
    for prefix, m in root.named_modules():
        for name in getattr(m, "_non_persistent_buffers_set", ()):
            b = m._buffers.get(name)
            if b is not None:
                out[clean_name(f"{prefix}.{name}" if prefix else name)] = b.detach().cpu().clone()
    return out


def save_rank(
    framework: str, root: Any, optim: Any, sched: Any, folder: str, rank: int, world: int, step: int, container: str
) -> None:
    """This rank's files of a checkpoint after ``step`` optimizer steps."""
    os.makedirs(folder, exist_ok=True)
    if framework == "fairscale" and container == "vissl":
        _save_vissl(root, optim, sched, folder, rank, world, step)
        return
    if framework == "fairscale":
        name, meta_key = CONTAINER_FILES[container]
        torch.save(
            {
                "model": root.local_state_dict(),
                meta_key: root.local_metadata_dict(),
                "last_optimizer_state": optim.state_dict(),
                "optimizer_history": [
                    {"num_updates": step, "lr_scheduler_state": sched.state_dict() if sched is not None else None}
                ],
                "extra_state": {"epoch": 1},
                "cfg": {},
            },
            os.path.join(folder, name.format(rank)),
        )
        return
    import numpy as np

    torch.save(root.state_dict(), _verl(folder, "model", world, rank))
    torch.save(optim.state_dict(), _verl(folder, "optim", world, rank))
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    extra = {"lr_scheduler": sched.state_dict() if sched is not None else None, "rng": rng}
    torch.save(extra, _verl(folder, "extra_state", world, rank))
    if rank == 0:
        with open(os.path.join(folder, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world}, f)


def _vissl_parts(root: Any) -> Tuple[Any, List[Any]]:
    """The FSDP-wrapped ``trunk`` and ``heads`` of a VISSL model (BaseSSLMultiInputOutputModel) under the root."""
    found: Dict[str, Any] = {}
    for name, m in root.named_modules():  # the outermost module of a name: the FSDP wrapper, not what it wraps
        found.setdefault(_WRAPPER_PARTS.sub("", name).strip("."), m)
    trunk, heads = found.get("trunk"), found.get("heads")
    fsdp = [m for m in [trunk, *(heads or [])] if m is not None]
    if trunk is None or not heads or not all(hasattr(m, "local_state_dict") for m in fsdp):
        raise RecipeError(
            "container vissl: VISSL saves the model's `trunk` and each of its `heads` (a ModuleList), each "
            "FSDP-wrapped on its own; this model has no such modules"
        )
    return trunk, list(heads)


def _save_vissl(root: Any, optim: Any, sched: Any, folder: str, rank: int, world: int, step: int) -> None:
    """As VISSL saves a sharded checkpoint: trunk and heads' local state, the optimizer, a shard_list."""
    trunk, heads = _vissl_parts(root)
    torch.save(
        {
            "type": "shard",
            "phase_idx": 0,
            "iteration": step,
            "train_phase_idx": 0,
            "classy_state_dict": {
                "base_model": {
                    "model": {"trunk": trunk.local_state_dict(), "heads": [h.local_state_dict() for h in heads]},
                    "meta": {"trunk": trunk.local_metadata_dict(), "heads": [h.local_metadata_dict() for h in heads]},
                },
                "optimizer": {"optim": optim.state_dict(), "param_groups_override": {}},
                "lr_scheduler": sched.state_dict() if sched is not None else None,
                "train": True,
            },
        },
        os.path.join(folder, VISSL_SHARD.format(rank)),
    )
    if rank == 0:
        shards = [VISSL_SHARD.format(r) for r in range(world)]
        torch.save({"type": "shard_list", "shards": shards}, os.path.join(folder, VISSL_LIST))


def _verl(folder: str, kind: str, world: int, rank: int) -> str:
    return os.path.join(folder, f"{kind}_world_size_{world}_rank_{rank}.pt")


def load_local(
    framework: str, root: Any, optim: Optional[Any], folder: str, rank: int, world: int, trust_pickles: bool = False
) -> None:
    """Per-rank files at this world size (or, for fairscale, any checkpoint load_checkpoint takes)."""
    if framework == "fairscale":
        load_checkpoint(root, folder, optim, trust_pickles=trust_pickles)
        return
    path = _verl(folder, "model", world, rank)
    if not os.path.isfile(path):
        raise RecipeError(f"{folder}: no {os.path.basename(path)} (torch FSDP2 per-rank files at world size {world})")
    state = torch.load(path, weights_only=True)
    _check_same_model(root.state_dict(), state, path)
    root.load_state_dict(state)
    if optim is not None:
        optim.load_state_dict(torch.load(_verl(folder, "optim", world, rank), weights_only=True))


def _check_same_model(own: Dict[str, Any], saved: Dict[str, Any], path: str) -> None:
    """One line naming the first tensor where a checkpoint is not of the recipe's model (torch's own error is a
    multi-line RuntimeError raised inside a rank)."""
    for name in [*own, *(k for k in saved if k not in own)]:
        if name not in saved or name not in own:
            where = "the checkpoint lacks" if name not in saved else "the recipe's model has no"
            raise RecipeError(f"{path}: {where} {name}: a checkpoint of another model than the recipe's")
        a, b = own[name], saved[name]
        if hasattr(a, "shape") and hasattr(b, "shape") and tuple(a.shape) != tuple(b.shape):
            raise RecipeError(
                f"{path}: {name} is {list(b.shape)} in the checkpoint, {list(a.shape)} in the recipe's model: "
                "a checkpoint of another model than the recipe's"
            )


def load_full(
    framework: str, root: Any, optim: Optional[Any], full: str, full_optim: str, weights: bool = True
) -> None:
    """A consolidated state dict (and its optimizer state) into the wrapped root."""
    if framework == "fairscale":
        if weights or optim is not None:
            load_checkpoint(root, full, optim, weights=weights, full_optimizer=full_optim)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    if weights:
        set_model_state_dict(root, torch.load(full, weights_only=True), options=opts)
    if optim is not None:
        set_optimizer_state_dict(root, optim, torch.load(full_optim, weights_only=True), options=opts)


def scheduler_state(framework: str, folder: str, trust_pickles: bool = False) -> Any:
    """The LR scheduler state a checkpoint folder holds (rank 0's), or None.

    Only that entry is unpickled (``read_entry``): the files' other entries (model, RNG states) never run,
    and the entry itself holds plain values and tensors unless ``trust_pickles``."""
    if framework == "fairscale" and os.path.isfile(os.path.join(folder, VISSL_SHARD.format(0))):
        path, keys = os.path.join(folder, VISSL_SHARD.format(0)), ["classy_state_dict", "lr_scheduler"]
    elif framework == "fairscale":
        files = sorted(glob.glob(os.path.join(folder, "*shard0.pt"))) or sorted(glob.glob(os.path.join(folder, "*.pt")))
        if not files:
            return None
        path, keys = files[0], ["optimizer_history", -1, "lr_scheduler_state"]
    else:
        files = sorted(glob.glob(os.path.join(folder, "extra_state_world_size_*_rank_0.pt")))
        if not files:
            return None
        path, keys = files[0], ["lr_scheduler"]
    return materialize(read_entry(path, keys, trust_pickles))


def full_state(framework: str, root: Any, optim: Any) -> Optional[Dict[str, Any]]:
    """torch's own full model and optimizer state dicts of an FSDP2 root (a collective); None for fairscale,
    whose final files are consolidated offline."""
    return torch_full_state(root, optim) if framework == "fsdp2" else None


def local_files(folder: str) -> Dict[str, Any]:
    """Every per-rank file of an FSDP2 checkpoint, DTensors as their local pieces (resave comparisons)."""
    import logging

    # Outside a process group torch warns, once per DTensor, that its mesh cannot be looked up.
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    out: Dict[str, Any] = {}
    try:
        for path in sorted(glob.glob(os.path.join(folder, "*_world_size_*_rank_*.pt"))):
            name = os.path.basename(path)
            if not name.startswith("extra_state"):
                out[name] = _local(torch.load(path, weights_only=True))
    finally:
        mesh_log.setLevel(level)
    return out


def _local(x: Any) -> Any:
    if hasattr(x, "to_local"):
        return x.to_local()
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_local(v) for v in x)
    return x

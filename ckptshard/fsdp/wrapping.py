"""The VISSL-style wrapping flow for a trunk-plus-heads model, generalised.

VISSL's SwAV training wraps each ``prototypes{j}`` layer in full precision
and unflattened, wraps the head with the user's config, initialises the head
identically on every rank, resets the lazy-init state that initialisation
left behind, and only then wraps the whole model. Skipping any of these
gives ranks that disagree, or an outer wrap that starts from a stale
``_is_root``.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .cpu_compat import cpu_fsdp_kwargs
from .state import fsdp_instances

# SwAV prototypes: fp32, unflattened, inputs cast to fp32.
FP32_PROTOTYPES: Dict[str, Any] = {
    "flatten_parameters": False,
    "mixed_precision": False,
    "fp32_reduce_scatter": False,
    "force_input_to_fp32": True,
}
_PROTOTYPES = re.compile(r"prototypes\d+$")


def reset_lazy_init_recursive(module: nn.Module) -> int:
    """``_reset_lazy_init`` on every FSDP module under ``module`` whose ``_is_root`` is set.

    Returns how many were reset. Afterwards the next forward (or an outer
    wrap) starts from a clean state.
    """
    n = 0
    for m in fsdp_instances(module):
        if m._is_root is not None:
            m._reset_lazy_init()
            n += 1
    return n


def _init_head(head: Any, init: Optional[str], seed: int) -> None:
    """Give the head the same weights on every rank: fixed seed, or rank 0's broadcast."""
    if init is None:
        return
    with head.summon_full_params():
        if init == "seed":
            torch.manual_seed(seed)
            for m in head.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
        elif init == "broadcast":
            for t in list(head.parameters()) + list(head.buffers()):
                dist.broadcast(t.data, src=0)
        else:
            raise ValueError(f"init must be 'seed', 'broadcast' or None, not {init!r}")


def wrap_heads_and_model(
    model: nn.Module,
    *,
    head_config: Optional[Dict[str, Any]] = None,
    root_config: Optional[Dict[str, Any]] = None,
    prototypes_config: Optional[Dict[str, Any]] = None,
    init: Optional[str] = "seed",
    seed: int = 0,
    wrap_each_head: bool = False,
) -> Any:
    """Wrap ``model.heads`` and then ``model`` in fairscale FSDP, VISSL's way; the trunk is wrapped by the caller.

    Prototype layers stay fp32 and unflattened; each head is initialised
    identically on every rank; ``_is_root`` and lazy init are reset on every
    instance so the outer wrap starts clean.

    Args:
        model: a module with a ``heads`` ModuleList, its trunk already wrapped.
        head_config, root_config, prototypes_config: FSDP keyword arguments for the heads, the root and
            the prototype layers (mixed precision, flattening...).
        init: ``"seed"`` re-initialises each head's Linear layers under ``seed`` inside
            ``summon_full_params``; ``"broadcast"`` copies rank 0's head to every rank; ``None`` keeps the
            weights (a checkpoint was loaded before wrapping).
        seed: the seed of ``"seed"`` initialisation.
        wrap_each_head: wrap each head in its own FSDP instance.

    Returns:
        The FSDP root wrapping ``model``.

    Raises:
        ValueError: an unknown ``init``, or several heads without ``wrap_each_head``.
    """
    from fairscale.nn import FullyShardedDataParallel as FSDP

    base = cpu_fsdp_kwargs()
    heads = model.heads
    if len(heads) != 1 and not wrap_each_head:
        raise ValueError(f"the model has {len(heads)} heads; the wrapping flow takes one (pass wrap_each_head=True)")
    for j in range(len(heads)):
        head = heads[j]
        protos = []
        for name, child in list(head.named_children()):
            if _PROTOTYPES.match(name):
                wrapped = FSDP(child, **base, **{**FP32_PROTOTYPES, **(prototypes_config or {})})
                setattr(head, name, wrapped)
                protos.append(wrapped)
        head = FSDP(head, **base, **(head_config or {}))
        _init_head(head, init, seed)
        # summon_full_params made the head a root and ran lazy init: undo it.
        head._reset_lazy_init()
        for p in protos:
            p._reset_lazy_init()
        heads[j] = head
    trunk = getattr(model, "trunk", None)
    if trunk is not None:
        for m in fsdp_instances(trunk):
            m._is_root = None
    return FSDP(model, **base, **(root_config or {}))

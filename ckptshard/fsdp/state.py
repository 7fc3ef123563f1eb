"""Lazy-init bookkeeping of fairscale FSDP modules around loading state."""

from __future__ import annotations

from typing import Any, List

import torch.nn as nn


def fsdp_instances(module: nn.Module) -> List[Any]:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    return [m for m in module.modules() if isinstance(m, FSDP)]


def init_param_attributes(module: nn.Module) -> None:
    """Give every FSDP parameter its lazily-made attributes (``_fp32_shard``, ``_fp16_shard``...).

    ``load_local_state_dict`` on a model that never ran forward needs them at
    world size 1 with mixed precision: fairscale frees ``_fp16_shard`` there
    without having made it. Idempotent; changes no values and no ``_is_root``.
    """
    for m in fsdp_instances(module):
        for p in m.params:
            m._init_param_attributes(p)


def torch_full_state(root: nn.Module, optim: Any) -> dict:
    """torch's own full model and optimizer state dicts of a torch FSDP root (a collective), on the CPU."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(root, options=opts),
        "optim": get_optimizer_state_dict(root, optim, options=opts),
    }

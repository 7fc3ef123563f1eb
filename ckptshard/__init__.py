"""ckptshard: consolidate, shard and reshard FSDP checkpoints, weights and optimizer state, in bounded memory.

The library API is what ``__all__`` names; docs/api.md shows it in use.
Every other module is internal: its names may change between versions.
Names are imported on first use, so ``import ckptshard`` costs nothing
and does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any, List

from .errors import CheckpointError, InputChanged, NotSupported, OutputExists
from .version import __version__

__all__ = [
    "CheckpointError",
    "ConsolidateResult",
    "ConvertResult",
    "InputChanged",
    "NotSupported",
    "OutputExists",
    "ReshardResult",
    "Source",
    "__version__",
    "consolidate",
    "convert",
    "inspect_checkpoint",
    "load_checkpoint",
    "open_checkpoint",
    "open_source",
    "reshard",
    "shard",
    "verify",
    "verify_resume",
    "wrap_heads_and_model",
]

_HOME = {
    "ConsolidateResult": "execute.consolidate",
    "ConvertResult": "execute.convert",
    "ReshardResult": "execute.reshard",
    "Source": "sources.base",
    "consolidate": "execute.consolidate",
    "convert": "execute.convert",
    "inspect_checkpoint": "execute.inspect",
    "load_checkpoint": "fsdp.loading",
    "open_checkpoint": "read.source",
    "open_source": "sources.probe",
    "reshard": "execute.reshard",
    "shard": "execute.reshard",
    "verify": "execute.verify",
    "verify_resume": "harness.verify_resume",
    "wrap_heads_and_model": "fsdp.wrapping",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'ckptshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))

"""fairscale FSDP shards (fairseq, metaseq and VISSL containers, or any dict with fairscale's metadata)."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from ..plan.consolidate import consolidated_weights
from ..plan.optimizer import consolidated_optimizer
from ..read.source import ShardedCheckpoint, fingerprint
from .base import Source


def source_info(ckpt: ShardedCheckpoint) -> Dict[str, Any]:
    """The manifest's source block for one fairscale checkpoint (one model part)."""
    return {
        "files": [os.path.abspath(p) for p in ckpt.files.paths],
        "container": ckpt.container.kind,
        "world_size": ckpt.world_size,
        "fingerprint": fingerprint(ckpt),
    }


class FairscaleSource(Source):
    """``ckpt``: every rank's pickle, container and layout, checked when opened (``read.source``)."""

    kind = "fairscale"
    family = "fairscale FSDP shards"

    def __init__(self, path: str, ckpt: ShardedCheckpoint) -> None:
        super().__init__(path, ckpt.world_size, tuple(ckpt.files.paths))
        self.ckpt = ckpt

    def describe(self) -> Dict[str, Any]:
        return source_info(self.ckpt)

    def full_weights(self) -> Dict[str, Any]:
        return consolidated_weights(self.ckpt)

    def full_optimizer(self) -> Optional[Dict[str, Any]]:
        return consolidated_optimizer(self.ckpt) if self.ckpt.container.optimizer is not None else None

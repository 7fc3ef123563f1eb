"""fairscale FSDP shards (fairseq, metaseq and VISSL containers, or any dict with fairscale's metadata)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional

from ..plan.consolidate import consolidated_weights
from ..plan.legacy_ties import maybe_missing, restore_ties
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

    def __init__(
        self, path: str, ckpt: ShardedCheckpoint, like: Optional[Mapping[str, Any]] = None, like_path: str = ""
    ) -> None:
        super().__init__(path, ckpt.world_size, tuple(ckpt.files.paths))
        self.ckpt, self.like, self.like_path = ckpt, like, like_path  # like: fairscale 0.3's ties (``legacy``)

    @property
    def legacy(self) -> bool:
        """Saved by fairscale 0.3.x, whose metadata does not record shared (tied) parameters."""
        return any(i.legacy_flat is not None for part in self.ckpt.layout.parts for i in part.instances)

    def describe(self) -> Dict[str, Any]:
        return source_info(self.ckpt)

    def notes(self) -> List[str]:
        if not self.legacy:
            return []
        if self.like is not None:
            restored = restore_ties(consolidated_weights(self.ckpt), self.like, self.like_path)[1]
            return [f"restored from --like: {', '.join(restored)}"] if restored else []
        missing = maybe_missing(self.ckpt.layout.param_names())
        which = f"; perhaps {', '.join(missing[:5])}" if missing else ""
        return [
            "fairscale 0.3 shards do not record shared parameters: a parameter tied under two names is written "
            f"under its first name only{which}; --like MODEL.pt (torch.save of the model's state_dict()) restores them"
        ]

    def full_weights(self) -> Dict[str, Any]:
        weights = consolidated_weights(self.ckpt)
        return restore_ties(weights, self.like, self.like_path)[0] if self.like is not None else weights

    def full_optimizer(self) -> Optional[Dict[str, Any]]:
        return consolidated_optimizer(self.ckpt) if self.ckpt.container.optimizer is not None else None

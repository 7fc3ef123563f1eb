"""torch FSDP per-rank files: FSDP2 (DTensors), HSDP (FSDP2 replicas x shards), FSDP1 SHARDED_STATE_DICT
(ShardedTensors, and NO_SHARD at one rank) and FSDP1 LOCAL_STATE_DICT (flat parameters, read with the model's
full state dict); verl's layout or one file per rank."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from ..read.torch_ranks import TorchRanks
from .base import Source

FAMILIES = {
    "fsdp2": "torch FSDP2 per-rank files",
    "hsdp": "torch HSDP per-rank files (FSDP2 replicas x shards)",
    "fsdp1": "torch FSDP1 per-rank files (SHARDED_STATE_DICT)",
    "fsdp1-local": "torch FSDP1 LOCAL_STATE_DICT per-rank files",
}


def ranks_kind(ranks: TorchRanks) -> str:
    if ranks.flat is not None:
        return "fsdp1-local"
    if ranks.hsdp is not None:
        return "hsdp"
    return ranks.kind


class TorchRanksSource(Source):
    """``ranks``: every rank's model (and optimizer) state, checked when opened (``read.torch_ranks``)."""

    def __init__(self, path: str, ranks: TorchRanks) -> None:
        super().__init__(path, ranks.files.world_size, tuple(ranks.files.paths))
        self.ranks = ranks
        self.kind = ranks_kind(ranks)
        self.family = FAMILIES[self.kind]

    def describe(self) -> Dict[str, Any]:
        return {
            "files": [os.path.abspath(p) for p in self.inputs],
            "container": f"{self.kind}-verl" if self.ranks.files.verl else self.kind,
            "world_size": self.ranks.world_size,
        }

    def notes(self) -> List[str]:
        """What an output of these files should say: which HSDP replica's weights it holds."""
        if self.ranks.hsdp is None:
            return []
        replicas = self.ranks.hsdp[0]
        return [
            f"HSDP: the weights are replica 0's; the other {replicas - 1} replica(s)' weights were not compared "
            "(their optimizer files were: steps and param groups agree)"
        ]

    def hf_config_dir(self) -> Optional[str]:
        found = os.path.join(self.ranks.files.folder, "huggingface")
        return found if self.ranks.files.verl and os.path.isfile(os.path.join(found, "config.json")) else None

    def check(self) -> None:
        if self.ranks.flat is None:  # LOCAL_STATE_DICT: what the flat parameters hold needs the model (--like)
            self.full_weights()  # every rank's pieces agree and add up to the whole
            self.full_optimizer()

    def full_weights(self) -> Dict[str, Any]:
        return self.ranks.full_model()

    def full_optimizer(self) -> Optional[Dict[str, Any]]:
        return self.ranks.full_optimizer() if self.ranks.optims is not None else None

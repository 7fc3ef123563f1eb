"""A torch.distributed.checkpoint (DCP) folder: ``.metadata`` and its data files."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

from ..plan.dcp import MODEL, OPTIM, flat_tensors
from ..read.dcp import DcpCheckpoint, open_dcp
from .base import Source


class DcpSource(Source):
    """``dcp``: the nested state dict with tensors as Fills over the data files, opened on first use (it reads
    every chunk's frame, which ``inspect`` does not need: ``.metadata`` tells it all)."""

    kind = "dcp"
    family = "a DCP folder (torch.distributed.checkpoint)"

    def __init__(self, path: str, trust_pickles: bool = False) -> None:
        super().__init__(path, None, ())
        self.trust_pickles = trust_pickles
        self._dcp: Optional[DcpCheckpoint] = None

    @property
    def dcp(self) -> DcpCheckpoint:
        if self._dcp is None:
            self._dcp = open_dcp(self.path, self.trust_pickles)
        return self._dcp

    @property
    def inputs(self) -> Tuple[str, ...]:
        return tuple(os.path.join(self.dcp.folder, f) for f in self.dcp.files)

    def check(self) -> None:
        open_dcp(self.path, self.trust_pickles)  # every chunk's frame reads back as .metadata says

    def full_weights(self) -> Dict[str, Any]:
        """The ``model`` state dict inside (as FSDP2's ``dcp.save({"model": ..., "optim": ...})`` stores it), or
        the whole folder where it holds one state dict alone; a non-tensor entry is refused by name."""
        tree = self.dcp.tree
        inner = tree.get(MODEL)
        return flat_tensors(inner if isinstance(inner, Mapping) else tree, False, self.path)

    def full_optimizer(self) -> Optional[Dict[str, Any]]:
        optim = self.dcp.tree.get(OPTIM)
        return dict(optim) if isinstance(optim, Mapping) else None

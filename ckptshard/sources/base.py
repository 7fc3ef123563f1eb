"""A checkpoint of any family, opened: what every command asks of it, whatever the family."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError, NotSupported


class Source:
    """An opened checkpoint. Subclasses (one module each) hold the family's opened object.

    ``kind``: the family, as ``inspect --json`` and manifests name it (``fairscale``, ``model-parts``,
    ``fsdp2``, ``hsdp``, ``fsdp1``, ``fsdp1-local``, ``dcp``, ``full``); ``family``: the same in words, for
    messages; ``path``: as the user named it; ``world_size``: ranks that saved it (None where the files
    do not say: a DCP folder, a full state dict); ``inputs``: every file it was read from.
    """

    kind = ""
    family = ""

    def __init__(self, path: str, world_size: Optional[int], inputs: Tuple[str, ...]) -> None:
        self.path, self.world_size, self._inputs = path, world_size, inputs

    @property
    def inputs(self) -> Tuple[str, ...]:
        return self._inputs

    def describe(self) -> Dict[str, Any]:
        """The ``source`` block of an output's manifest."""
        return {"files": [os.path.abspath(p) for p in self.inputs], "container": self.kind}

    def notes(self) -> List[str]:
        """What an output of this source should say of it (printed as ``note:`` lines)."""
        return []

    def hf_config_dir(self) -> Optional[str]:
        """The folder of the model's Hugging Face config that came with the checkpoint (verl's ``huggingface/``),
        or None."""
        return None

    def check(self) -> None:
        """Read back what ``verify`` can check beyond the manifest's checksums (raises CheckpointError)."""

    def full_weights(self) -> Dict[str, Any]:
        """The model's full state dict, as Fills (planned, not read)."""
        raise self.refuse("consolidating its weights")

    def full_optimizer(self) -> Optional[Dict[str, Any]]:
        """The full optimizer state keyed as the family's own full format keys it, or None where the files
        hold none."""
        raise self.refuse("consolidating its optimizer state")

    def refuse(self, what: str, hint: str = "") -> CheckpointError:
        """The one-line error for a command that does not apply to this family."""
        return NotSupported(f"{self.path}: {what} does not apply to {self.family}" + (f": {hint}" if hint else ""))

"""One full state dict: a torch.save file, a safetensors file, or a folder of safetensors with its index."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from ..tensors import TensorRef, as_fill
from .base import Source


class FullStateSource(Source):
    """``refs``: every tensor of the state dict, by name, where its bytes are."""

    kind = "full"
    family = "a full state dict"

    def __init__(self, path: str, refs: Mapping[str, TensorRef], inputs: Tuple[str, ...]) -> None:
        super().__init__(path, None, inputs)
        self.refs = refs

    def full_weights(self) -> Dict[str, Any]:
        return {k: as_fill(v) for k, v in self.refs.items()}

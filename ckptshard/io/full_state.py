"""Read a full (unsharded) state dict lazily: torch.save or safetensors."""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Mapping

from ..dtypes import SAFETENSORS_CODE, StoredDType, to_torch
from ..errors import CheckpointError
from ..layout.boxes import strides
from .safe_load import TensorRef, load_lazy

_DTYPE_OF_CODE = {code: name for name, code in SAFETENSORS_CODE.items()}


def safetensors_refs(path: str, torch_free: bool = False) -> Dict[str, TensorRef]:
    """Every tensor of a safetensors file as a TensorRef; reads only the header.

    ``torch_free``: dtypes are StoredDTypes (no torch import), else torch's.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 * 1024 * 1024:
            raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from None
    out: Dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype_name = _DTYPE_OF_CODE.get(info.get("dtype"))
        if dtype_name is None:
            raise CheckpointError(f"{path}: {name}: unsupported dtype {info.get('dtype')}")
        dtype = StoredDType(dtype_name) if torch_free else to_torch(StoredDType(dtype_name))
        begin, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        ref = TensorRef(path, 8 + n + begin, dtype, shape, strides(shape))
        if ref.nbytes != end - begin or 8 + n + end > size:
            raise CheckpointError(f"{path}: {name}: data offsets do not fit shape or file (truncated?)")
        out[name] = ref
    return out


def index_refs(folder: str, torch_free: bool = False) -> Dict[str, TensorRef]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out: Dict[str, TensorRef] = {}
    for fname in sorted(set(index["weight_map"].values())):
        out.update(safetensors_refs(os.path.join(folder, fname), torch_free))
    return out


def full_state_refs(path: str, trust_pickles: bool = False, torch_free: bool = False) -> Mapping[str, TensorRef]:
    """A flat ``{name: tensor}`` state dict from a .safetensors file, an index folder or a torch.save file.

    ``torch_free``: read without torch where possible (StoredDTypes); a
    torch.save file the torch-free reader refuses still goes through torch.
    """
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
            raise CheckpointError(f"{path}: a folder without model.safetensors.index.json")
        return index_refs(path, torch_free)
    if path.endswith(".safetensors"):
        return safetensors_refs(path, torch_free)
    obj: Any = load_lazy(path, trust_pickles, torch_free)
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, TensorRef) for v in obj.values()):
        raise CheckpointError(f"{path}: not a flat {{name: tensor}} state dict")
    return obj

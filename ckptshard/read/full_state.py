"""Read a full (unsharded) state dict lazily: torch.save or safetensors."""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Mapping

from ..dtypes import StoredDType, to_torch
from ..errors import CheckpointError
from ..formats.safetensors import INDEX_JSON, header_entry
from ..layout.boxes import strides
from ..osio.inputs import input_file
from ..tensors import TensorRef
from .safe_load import load_lazy


def safetensors_refs(path: str, torch_free: bool = False) -> Dict[str, TensorRef]:
    """Every tensor of a safetensors file as a TensorRef; reads only the header.

    ``torch_free``: dtypes are StoredDTypes (no torch import), else torch's.
    """
    size = input_file(path).st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 * 1024 * 1024:
            raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    out: Dict[str, TensorRef] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end, shape, dtype_name = header_entry(info)
        if dtype_name is None:
            raise CheckpointError(f"{path}: {name}: malformed header entry (wants dtype, shape, data_offsets)")
        dtype = StoredDType(dtype_name) if torch_free else to_torch(StoredDType(dtype_name))
        ref = TensorRef(path, 8 + n + begin, dtype, shape, strides(shape))
        if ref.nbytes != end - begin or begin < 0 or 8 + n + end > size:
            raise CheckpointError(f"{path}: {name}: data offsets do not fit shape or file (truncated?)")
        out[name] = ref
    return out


def index_refs(folder: str, torch_free: bool = False) -> Dict[str, TensorRef]:
    where = os.path.join(folder, INDEX_JSON)
    try:
        with open(where) as f:
            index = json.load(f)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{where}: not JSON") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{where}: no weight_map of tensor names to file names")
    out: Dict[str, TensorRef] = {}
    for fname in sorted(set(weight_map.values())):
        fpath = os.path.join(folder, fname)
        if os.path.basename(fname) != fname or not os.path.lexists(fpath):
            raise CheckpointError(f"{where}: names {fname!r}, which is not in {folder}")
        out.update(safetensors_refs(fpath, torch_free))
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise CheckpointError(f"{where}: {missing[0]!r} is mapped to {weight_map[missing[0]]}, which does not hold it")
    return out


def full_state_refs(path: str, trust_pickles: bool = False, torch_free: bool = False) -> Mapping[str, TensorRef]:
    """A flat ``{name: tensor}`` state dict from a .safetensors file, an index folder or a torch.save file.

    ``torch_free``: read without torch where possible (StoredDTypes); a
    torch.save file the torch-free reader refuses still goes through torch.
    """
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, INDEX_JSON)):
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


def keeps_model_order(path: str) -> bool:
    """Whether the full state dict at ``path`` lists names in the model's order: torch.save keeps the order of
    ``state_dict()``; safetensors files (and so index folders) store names sorted."""
    return not (os.path.isdir(path) or path.endswith(".safetensors"))

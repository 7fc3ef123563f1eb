"""The safetensors format: a file's header, and the index-sharded folder's plan (no I/O)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..dtypes import SAFETENSORS_CODE, dtype_name
from ..errors import CheckpointError
from ..tensors import Fill

DTYPE_OF_CODE = {code: name for name, code in SAFETENSORS_CODE.items()}


def safetensors_header(
    tensors: Mapping[str, Fill], metadata: Optional[Mapping[str, str]]
) -> Tuple[bytes, Dict[str, int]]:
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets, pos = {}, 0
    for name in sorted(tensors):
        fill = tensors[name]
        code = SAFETENSORS_CODE.get(dtype_name(fill.dtype))
        if code is None:
            raise CheckpointError(f"{name}: dtype {fill.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": code,
            "shape": list(fill.shape),
            "data_offsets": [pos, pos + fill.nbytes],
        }
        offsets[name] = pos
        pos += fill.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def split_by_size(tensors: Mapping[str, Fill], max_bytes: int) -> List[List[str]]:
    """Group names, in name order, into files of at most ``max_bytes`` (a bigger tensor gets its own)."""
    groups: List[List[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


INDEX_JSON = "model.safetensors.index.json"  # what transformers looks for


def safetensors_index_plan(
    tensors: Mapping[str, Fill], max_bytes: int, metadata: Optional[Mapping[str, str]] = None
) -> Tuple[List[Tuple[str, Dict[str, Fill]]], Dict[str, Any]]:
    """The files (name, tensors) of an index-sharded safetensors folder, and its index.

    Pure: every process (``--jobs``, torchrun ranks) plans the same names.
    """
    groups = split_by_size(tensors, max_bytes)
    n = len(groups)
    files = [(f"model-{i:05d}-of-{n:05d}.safetensors", {k: tensors[k] for k in g}) for i, g in enumerate(groups, 1)]
    weight_map = {k: fname for fname, group in files for k in group}
    index = {
        "metadata": {"total_size": sum(f.nbytes for f in tensors.values()), **(metadata or {})},
        "weight_map": dict(sorted(weight_map.items())),
    }
    return files, index


def header_entry(info: Any) -> Tuple[int, int, Tuple[int, ...], Optional[str]]:
    """(begin, end, shape, dtype name) of one header entry; dtype None where the entry is malformed."""
    try:
        begin, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(s) for s in info["shape"])
        if any(s < 0 for s in shape):
            raise ValueError
        return begin, end, shape, DTYPE_OF_CODE.get(info["dtype"])
    except (KeyError, TypeError, ValueError):
        return 0, 0, (), None

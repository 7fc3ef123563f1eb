"""Write safetensors files and index-sharded folders from Fills, tensor data copied in place."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from ..formats.safetensors import INDEX_JSON, safetensors_header
from ..osio.atomic import open_empty, preallocate
from ..osio.hashing import Hashes
from ..tensors import Fill, Progress
from .copier import Copier


def write_safetensors(
    path: str,
    tensors: Mapping[str, Fill],
    copier: Copier,
    progress: Optional[Progress] = None,
    metadata: Optional[Mapping[str, str]] = None,
    hashes: Optional[Hashes] = None,
) -> None:
    """One safetensors file; tied tensors are stored as separate copies, as the format requires."""
    head, offsets = safetensors_header(tensors, metadata)
    total = len(head) + sum(f.nbytes for f in tensors.values())
    fd = open_empty(path)
    watch = hashes.watch(path) if hashes else None  # the file exists from here
    try:
        preallocate(fd, total)
        os.pwrite(fd, head, 0)
        for name in sorted(tensors):
            if watch:
                watch(len(head) + offsets[name])
            copier.fill(fd, len(head) + offsets[name], tensors[name], progress)
    finally:
        os.close(fd)
    if hashes:
        hashes.complete(path)


def write_index_json(folder: str, index: Mapping[str, Any]) -> str:
    with open(os.path.join(folder, INDEX_JSON), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return INDEX_JSON

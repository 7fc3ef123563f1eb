"""Read torch.distributed.checkpoint (DCP) folders, streaming.

Only ``.metadata`` and each chunk's small pickle are read; tensors become
byte runs of the data files, so no chunk is ever loaded whole. Writing is
in :mod:`.dcp_write` (no torch there).
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any, Dict, List, Mapping

import torch
from torch.distributed.checkpoint import metadata as dmd

from ..errors import CheckpointError
from ..layout.boxes import box_runs, numel
from .dcp_write import METADATA, is_dcp  # noqa: F401 (is_dcp: part of this module's reading API)
from .fill import Fill, Source, as_fill
from .safe_load import TensorRef, _to_refs, safe_torch_load


class _Slice(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset + length)`` of an open file."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.offset + self.pos) if n else b""
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.distributed.checkpoint.planner", "_Checkpointable"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch.layout pickles: a lookup by name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """``.metadata`` holds DCP's own dataclasses: anything else is refused, so no pickled code runs."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where}: refused to unpickle {module}.{name} (safe loading); "
            "pass --trust-pickles only if you trust this checkpoint"
        )


def read_metadata(folder: str, trust_pickles: bool = False) -> Any:
    where = os.path.join(folder, METADATA)
    try:
        with open(where, "rb") as f:
            meta = pickle.load(f) if trust_pickles else _MetadataUnpickler(f, where).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: not a DCP metadata file: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dmd.Metadata) or not isinstance(meta.storage_data, Mapping):
        raise CheckpointError(f"{where}: not a DCP metadata file written by FileSystemWriter")
    return meta


class DcpCheckpoint:
    """An opened DCP folder: the nested state dict with tensors as Fills over the data files."""

    def __init__(self, folder: str, tree: Dict[str, Any], files: List[str]) -> None:
        self.folder, self.tree, self.files = folder, tree, files


def _chunk_ref(fds: Dict[str, int], folder: str, info: Any, trust_pickles: bool, where: str) -> Any:
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{where}: stored with stream transforms {list(info.transform_descriptors)}: not supported")
    path = os.path.join(folder, info.relative_path)
    if path not in fds:
        if not os.path.isfile(path):
            raise CheckpointError(f"{where}: data file {info.relative_path} is missing")
        fds[path] = os.open(path, os.O_RDONLY)
    if info.offset + info.length > os.fstat(fds[path]).st_size:
        raise CheckpointError(f"{where}: {info.relative_path} ends before byte {info.offset + info.length} (truncated?)")
    obj = safe_torch_load(_Slice(fds[path], info.offset, info.length), f"{where} in {info.relative_path}", trust_pickles)
    return _to_refs(path, obj, info.offset)


def open_dcp(folder: str, trust_pickles: bool = False) -> DcpCheckpoint:
    """Open a DCP folder: reads ``.metadata`` and each chunk's pickle, no tensor data."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    meta = read_metadata(folder, trust_pickles)
    fds: Dict[str, int] = {}
    flat: Dict[str, Any] = {}
    try:
        for name, smd in meta.state_dict_metadata.items():
            if isinstance(smd, dmd.BytesStorageMetadata):
                info = meta.storage_data.get(dmd.MetadataIndex(name))
                if info is None:
                    raise CheckpointError(f"{folder}: {name}: no storage entry")
                value = _chunk_ref(fds, folder, info, trust_pickles, name)
                flat[name] = as_fill(value) if isinstance(value, TensorRef) else value
                continue
            shape, dtype = tuple(smd.size), smd.properties.dtype
            sources: List[Source] = []
            covered = 0
            for ch in smd.chunks:
                info = meta.storage_data.get(dmd.MetadataIndex(name, ch.offsets))
                if info is None:
                    raise CheckpointError(f"{folder}: {name}: chunk at {list(ch.offsets)} has no storage entry")
                ref = _chunk_ref(fds, folder, info, trust_pickles, name)
                if not isinstance(ref, TensorRef) or tuple(ref.shape) != tuple(ch.sizes) or ref.dtype != dtype:
                    raise CheckpointError(f"{folder}: {name}: chunk at {list(ch.offsets)} does not hold a "
                                          f"{dtype} tensor of {list(ch.sizes)}")
                for tstart, bstart, n in box_runs(shape, ch.offsets, ch.sizes):
                    sources.append(Source(ref, bstart, tstart, n))
                covered += numel(ch.sizes)
            if covered != numel(shape):
                raise CheckpointError(f"{folder}: {name}: chunks hold {covered} of {numel(shape)} elements")
            flat[name] = Fill(shape, dtype, tuple(sorted(sources, key=lambda s: s.dst_start)))
    finally:
        for fd in fds.values():
            os.close(fd)
    tree = unflatten_state_dict(flat, meta.planner_data) if isinstance(meta.planner_data, Mapping) and meta.planner_data else flat
    files = sorted({info.relative_path for info in meta.storage_data.values()}) + [METADATA]
    return DcpCheckpoint(folder, tree, files)

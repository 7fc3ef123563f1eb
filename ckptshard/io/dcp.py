"""Read and write torch.distributed.checkpoint (DCP) folders, streaming.

The format is ``FileSystemWriter``'s: data files ``__{i}_0.distcp`` in
which every chunk is a small ``torch.save`` of one tensor (or of one
non-tensor value), and ``.metadata``, a pickled ``Metadata`` that names each
chunk's box and byte range. ``torch.distributed.checkpoint.load`` and
``format_utils.dcp_to_torch_save`` read what is written here.

Writing: torch itself writes each chunk's ``torch.save`` frame, with the
tensor's bytes skipped (``skip_data`` over a fake tensor leaves a hole),
then the bytes are copied into the hole from the source files. Reading:
only ``.metadata`` and each chunk's small pickle are read; tensors become
byte runs of the data files, so no chunk is ever loaded whole.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch.distributed.checkpoint import metadata as dmd

from ..errors import CheckpointError
from ..layout.boxes import box_runs, numel
from ..plan.dcp import Chunk, DcpPlan, TensorEntry
from .fill import Copier, Fill, Progress, Source, as_fill
from .hashing import Hashes
from .safe_load import TensorRef, _to_refs, safe_torch_load
from .writers import placeholder

METADATA = ".metadata"
DCP_VERSION = "1.0.0"  # FileSystemWriter's CURRENT_DCP_VERSION when this was written


def is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


def _storage_info(relative_path: str, offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


class _HoleWriter(io.RawIOBase):
    """A seekable, write-only window of ``fd`` from byte ``base``.

    torch.save under ``skip_data`` seeks over each tensor's bytes; the
    forward seeks are recorded as holes, to be filled afterwards.
    """

    def __init__(self, fd: int, base: int) -> None:
        super().__init__()
        self.fd, self.base, self.pos, self.end = fd, base, 0, 0
        self.holes: List[Tuple[int, int]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = os.pwrite(self.fd, memoryview(b), self.base + self.pos)
        self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        new = offset if whence == io.SEEK_SET else self.pos + offset if whence == io.SEEK_CUR else self.end + offset
        if new > self.end:
            self.holes.append((self.end, new - self.end))
        self.pos = new
        self.end = max(self.end, new)
        return new

    def tell(self) -> int:
        return self.pos


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


# ---------------------------------------------------------------- writing


def _write_tensor_chunk(fd: int, at: int, chunk: Chunk, copier: Copier, progress: Optional[Progress]) -> int:
    """One chunk's torch.save frame at byte ``at``, data copied in; returns its length."""
    fake = placeholder(chunk.sizes, chunk.fill.dtype)
    w = _HoleWriter(fd, at)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(fake, w)
    nbytes = chunk.fill.nbytes
    if nbytes:
        holes = [start for start, n in w.holes if n == nbytes]
        if len(holes) != 1:
            raise AssertionError(f"torch.save left {len(holes)} holes of {nbytes} bytes for one tensor")
        copier.fill(fd, at + holes[0], chunk.fill, progress)
    return w.end


def _file_index(chunk: Chunk, paths: Dict[str, int]) -> int:
    """Chunks go to the data file of their source file: the source's sharding is kept."""
    srcs = chunk.fill.sources
    return paths[srcs[0].ref.path] if srcs else 0


def write_dcp(folder: str, plan: DcpPlan, copier: Copier, progress: Optional[Progress] = None,
              hashes: Optional[Hashes] = None) -> List[str]:
    """Write a planned DCP checkpoint into the existing ``folder``; returns the names of the files written.

    Tied tensors (one Fill under two names) are stored once and named twice.
    """
    entries, mapping = plan.entries, plan.mapping
    src_paths = sorted({c.fill.sources[0].ref.path for e in entries.values() if isinstance(e, TensorEntry)
                        for c in e.chunks if c.fill.sources})
    file_of = {p: i for i, p in enumerate(src_paths)}
    n_files = max(1, len(src_paths))
    names = [f"__{i}_0.distcp" for i in range(n_files)]
    fds = [os.open(os.path.join(folder, n), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for n in names]
    # Each data file is written front to back: what lies before its end is final.
    watch = [hashes.watch(os.path.join(folder, n)) if hashes else (lambda n: None) for n in names]
    ends = [0] * n_files
    placed: Dict[int, Tuple[int, int, int]] = {}  # id(chunk) -> (file, offset, length)
    sd_meta: Dict[str, Any] = {}
    storage: Dict[Any, Any] = {}
    try:
        for name, entry in entries.items():
            if not isinstance(entry, TensorEntry):
                buf = io.BytesIO()
                torch.save(entry, buf)
                os.pwrite(fds[0], buf.getbuffer(), ends[0])
                storage[dmd.MetadataIndex(name)] = _storage_info(names[0], ends[0], len(buf.getbuffer()))
                ends[0] += len(buf.getbuffer())
                watch[0](ends[0])
                sd_meta[name] = dmd.BytesStorageMetadata()
                continue
            fill, chunks = entry.fill, entry.chunks
            for c in chunks:
                if id(c) not in placed:
                    i = _file_index(c, file_of)
                    length = _write_tensor_chunk(fds[i], ends[i], c, copier, progress)
                    placed[id(c)] = (i, ends[i], length)
                    ends[i] += length
                    watch[i](ends[i])
                i, at, length = placed[id(c)]
                storage[dmd.MetadataIndex(name, c.offsets)] = _storage_info(names[i], at, length)
            sd_meta[name] = dmd.TensorStorageMetadata(
                properties=dmd.TensorProperties(dtype=fill.dtype),
                size=torch.Size(fill.shape),
                chunks=[dmd.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in chunks],
            )
    finally:
        for fd in fds:
            os.close(fd)
    meta = dmd.Metadata(state_dict_metadata=sd_meta, planner_data=mapping, storage_data=storage,
                        storage_meta=dmd.StorageMeta(), version=DCP_VERSION)
    with open(os.path.join(folder, METADATA), "wb") as f:
        pickle.dump(meta, f)
    return names + [METADATA]


# ---------------------------------------------------------------- reading

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

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

import functools
import io
import os
import pickle
import struct
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch.distributed.checkpoint import metadata as dmd

from ..errors import CheckpointError
from ..layout.boxes import box_runs, numel
from ..plan.dcp import Chunk, DcpPlan, TensorEntry
from .atomic import open_empty
from .fill import Copier, Fill, Progress, Source, as_fill
from .hashing import Hashes
from .safe_load import TensorRef, _to_refs, safe_torch_load
from .writers import placeholder
from .zip_crc import crc_of

METADATA = ".metadata"
DCP_VERSION = "1.0.0"  # FileSystemWriter's CURRENT_DCP_VERSION when this was written


def is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


def _storage_info(relative_path: str, offset: int, length: int) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


# ---------------------------------------------------------------- writing


class _FrameRecorder(io.RawIOBase):
    """A seekable sink that keeps what torch.save writes, as (position, bytes) runs.

    Under ``skip_data`` torch.save seeks over the tensor's bytes: the forward
    seeks are recorded as holes, to be filled from the sources.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pos = self.end = 0
        self.runs: List[Tuple[int, bytearray]] = []
        self.holes: List[Tuple[int, int]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b))
        if self.runs and self.runs[-1][0] + len(self.runs[-1][1]) == self.pos:
            self.runs[-1][1].extend(data)  # coalesce: a frame is a few pwrites, not dozens
        else:
            self.runs.append((self.pos, bytearray(data)))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        new = offset if whence == io.SEEK_SET else self.pos + offset if whence == io.SEEK_CUR else self.end + offset
        if new > self.end:
            self.holes.append((self.end, new - self.end))
        self.pos = new
        self.end = max(self.end, new)
        return new

    def tell(self) -> int:
        return self.pos


@functools.lru_cache(maxsize=4096)
def tensor_frame(sizes: Tuple[int, ...], dtype: torch.dtype
                 ) -> Tuple[Tuple[Tuple[int, bytes], ...], int, int, Tuple[int, ...]]:
    """torch.save's frame for one tensor: (runs of bytes, where its data starts, total length,
    where the data's CRC-32 goes).

    The frame depends on shape and dtype alone, so chunks of one shape share
    it; the CRC (0 under skip_data) is written per chunk (io/zip_crc.py).
    """
    rec = _FrameRecorder()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(placeholder(sizes, dtype), rec)
    nbytes = numel(sizes) * torch.empty((), dtype=dtype).element_size()
    holes = [start for start, n in rec.holes if n == nbytes]
    if nbytes and len(holes) != 1:
        raise AssertionError(f"torch.save left {len(holes)} holes of {nbytes} bytes for one tensor")
    data_at = holes[0] if nbytes else rec.end
    runs = tuple((at, bytes(b)) for at, b in rec.runs)
    return runs, data_at, rec.end, _crc_positions(runs, data_at + nbytes) if nbytes else ()


def _crc_positions(runs: Tuple[Tuple[int, bytes], ...], data_end: int) -> Tuple[int, ...]:
    """In a one-tensor frame: the CRC fields of the data record's descriptor and central directory entry."""
    after = next(b for at, b in runs if at == data_end)
    descriptor = data_end + (4 if after[:4] == b"PK\x07\x08" else 0)
    central = []
    for at, b in runs:
        pos = b.find(b"PK\x01\x02")
        while pos >= 0:
            n = struct.unpack_from("<H", b, pos + 28)[0]
            if b[pos + 46 : pos + 46 + n].endswith(b"/data/0"):
                central.append(at + pos + 16)
            pos = b.find(b"PK\x01\x02", pos + 4)
    if len(central) != 1:
        raise AssertionError("torch.save frame without exactly one central directory entry for data/0")
    return descriptor, central[0]


def _write_tensor_chunk(fd: int, at: int, chunk: Chunk, copier: Copier, progress: Optional[Progress],
                        path: str, hashes: Optional[Hashes]) -> int:
    """One chunk's torch.save frame at byte ``at``, data copied in and its CRC set; returns its length.

    With ``hashes`` the CRC is left to the hash pass, which reads the data anyway.
    """
    runs, data_at, length, crc_at = tensor_frame(tuple(chunk.sizes), chunk.fill.dtype)
    for pos, data in runs:
        os.pwrite(fd, data, at + pos)
    if chunk.fill.nbytes:
        if hashes:
            hashes.patch_crc(path, at + data_at, chunk.fill.nbytes, tuple(at + pos for pos in crc_at))
        copier.fill(fd, at + data_at, chunk.fill, progress)
        if not hashes:
            crc = struct.pack("<I", crc_of(fd, at + data_at, chunk.fill.nbytes, _crc_buffer()))
            for pos in crc_at:
                os.pwrite(fd, crc, at + pos)
    return length


@functools.lru_cache(maxsize=1)
def _crc_buffer() -> bytearray:
    return bytearray(8 << 20)


Item = Any  # a Chunk, or (name, value) for a non-tensor entry


def data_files(plan: DcpPlan) -> List[List[Item]]:
    """What each data file ``__{i}_0.distcp`` holds, in order.

    Chunks go to the file of their source (shard ``i`` -> file ``i``), so the
    source's sharding is kept and files can be written independently;
    non-tensor values and zero-filled chunks go to file 0. A tie's chunks
    are listed once.
    """
    chunks: List[Chunk] = []
    seen = set()
    for e in plan.entries.values():
        if isinstance(e, TensorEntry):
            for c in e.chunks:
                if id(c) not in seen:
                    seen.add(id(c))
                    chunks.append(c)
    paths = sorted({c.fill.sources[0].ref.path for c in chunks if c.fill.sources})
    index = {p: i for i, p in enumerate(paths)}
    files: List[List[Item]] = [[] for _ in range(max(1, len(paths)))]
    for name, e in plan.entries.items():
        if not isinstance(e, TensorEntry):
            files[0].append((name, e))
    for c in chunks:
        files[index[c.fill.sources[0].ref.path] if c.fill.sources else 0].append(c)
    return files


def write_data_file(path: str, items: List[Item], copier: Copier, progress: Optional[Progress] = None,
                    hashes: Optional[Hashes] = None) -> List[Tuple[int, int]]:
    """Write one data file, front to back; returns each item's (offset, length)."""
    fd = open_empty(path)
    watch = hashes.watch(path) if hashes else None
    placed, end = [], 0
    try:
        for item in items:
            if isinstance(item, Chunk):
                length = _write_tensor_chunk(fd, end, item, copier, progress, path, hashes)
            else:
                buf = io.BytesIO()
                torch.save(item[1], buf)
                length = os.pwrite(fd, buf.getbuffer(), end)
            placed.append((end, length))
            end += length
            if watch:
                watch(end)
    finally:
        os.close(fd)
    if hashes:
        hashes.complete(path)
    return placed


def data_file_names(files: List[List[Item]]) -> List[str]:
    return [f"__{i}_0.distcp" for i in range(len(files))]


def write_dcp(folder: str, plan: DcpPlan, copier: Copier, progress: Optional[Progress] = None,
              hashes: Optional[Hashes] = None) -> List[str]:
    """Write a planned DCP checkpoint into the existing ``folder``; returns the names of the files written.

    Tied tensors (one Fill under two names) are stored once and named twice.
    """
    files = data_files(plan)
    placements = [write_data_file(os.path.join(folder, n), items, copier, progress, hashes)
                  for n, items in zip(data_file_names(files), files)]
    return write_metadata(folder, plan, files, placements)


def write_metadata(folder: str, plan: DcpPlan, files: List[List[Item]], placements: List[List[Tuple[int, int]]]) -> List[str]:
    """``.metadata`` once every data file is written: each item's (offset, length) per file."""
    names = data_file_names(files)
    where: Dict[int, Any] = {}  # id(chunk) or entry name -> storage info
    for name, items, placed in zip(names, files, placements):
        for item, (at, length) in zip(items, placed):
            where[id(item) if isinstance(item, Chunk) else item[0]] = _storage_info(name, at, length)
    sd_meta: Dict[str, Any] = {}
    storage: Dict[Any, Any] = {}
    for name, e in plan.entries.items():
        if not isinstance(e, TensorEntry):
            storage[dmd.MetadataIndex(name)] = where[name]
            sd_meta[name] = dmd.BytesStorageMetadata()
            continue
        for c in e.chunks:
            storage[dmd.MetadataIndex(name, c.offsets)] = where[id(c)]
        sd_meta[name] = dmd.TensorStorageMetadata(
            properties=dmd.TensorProperties(dtype=e.fill.dtype),
            size=torch.Size(e.fill.shape),
            chunks=[dmd.ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in e.chunks],
        )
    meta = dmd.Metadata(state_dict_metadata=sd_meta, planner_data=plan.mapping, storage_data=storage,
                        storage_meta=dmd.StorageMeta(), version=DCP_VERSION)
    with open(os.path.join(folder, METADATA), "wb") as f:
        pickle.dump(meta, f)
    return names + [METADATA]


# ---------------------------------------------------------------- reading

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

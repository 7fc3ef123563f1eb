"""Write torch.distributed.checkpoint (DCP) folders, streaming, without torch.

The format is ``FileSystemWriter``'s: data files ``__{i}_0.distcp`` in
which every chunk is a small ``torch.save`` of one tensor (or of one
non-tensor value), and ``.metadata``, a pickled ``Metadata`` that names each
chunk's box and byte range. ``torch.distributed.checkpoint.load`` and
``format_utils.dcp_to_torch_save`` read what is written here.

Each chunk's frame is laid out by :func:`~ckptshard.formats.torch_save.lay_out_zip` with the
tensor's bytes left as a hole, and the bytes are copied into the hole from
the source files. ``.metadata`` is the pickle of DCP's own dataclasses,
written by name (:mod:`ckptshard.formats.dcp_metadata`). Importing torch can take
longer than the conversion, so nothing on this path imports it (a value the
torch-free writer does not know, in a non-tensor entry, goes through
``torch.save``).
"""

from __future__ import annotations

import functools
import io
import os
from typing import Any, Dict, List, Optional, Tuple

from ..dtypes import StoredDType, dtype_name
from ..formats.dcp_metadata import DCP_VERSION, metadata_pickle
from ..formats.dcp_names import METADATA
from ..formats.torch_pickle import Unsupported
from ..formats.torch_save import lay_out_zip, write_zip
from ..osio.atomic import open_empty
from ..osio.hashing import Hashes
from ..osio.zip_crc import crc_of, set_crc
from ..plan.dcp import Chunk, DcpPlan, TensorEntry
from ..tensors import Fill, Progress
from .copier import Copier


@functools.lru_cache(maxsize=4096)
def tensor_frame(
    sizes: Tuple[int, ...], dtype_id: str
) -> Tuple[Tuple[Tuple[int, bytes], ...], int, int, Tuple[int, ...]]:
    """torch.save's frame for one tensor: (runs of bytes, where its data starts, total length,
    where the data's CRC-32 goes).

    The frame depends on shape and dtype alone, so chunks of one shape share
    it; the CRC is written per chunk, once its data is in.
    """
    fill = Fill(tuple(sizes), StoredDType(dtype_id), ())
    skeleton = lay_out_zip(fill)
    runs = tuple((at, bytes(b)) for at, b in skeleton.runs)
    crc_at = skeleton.crcs[0][2] if skeleton.crcs else ()
    return runs, skeleton.offsets[id(fill)], skeleton.end, crc_at


def _write_tensor_chunk(
    fd: int, at: int, chunk: Chunk, copier: Copier, progress: Optional[Progress], path: str, hashes: Optional[Hashes]
) -> int:
    """One chunk's torch.save frame at byte ``at``, data copied in and its CRC set; returns its length.

    With ``hashes`` the CRC is left to the hash pass, which reads the data anyway.
    """
    runs, data_at, length, crc_at = tensor_frame(tuple(chunk.sizes), dtype_name(chunk.fill.dtype))
    for pos, data in runs:
        os.pwrite(fd, data, at + pos)
    if chunk.fill.nbytes:
        if hashes:
            hashes.patch_crc(path, at + data_at, chunk.fill.nbytes, tuple(at + pos for pos in crc_at))
        copier.fill(fd, at + data_at, chunk.fill, progress)
        if not hashes:
            set_crc(fd, crc_of(fd, at + data_at, chunk.fill.nbytes, _crc_buffer()), crc_at, base=at)
    return length


@functools.lru_cache(maxsize=1)
def _crc_buffer() -> bytearray:
    return bytearray(8 << 20)


Item = Any  # a Chunk, or (name, value) for a non-tensor entry


def _value_frame(value: Any) -> bytes:
    """torch.save of a non-tensor value (a step count, a learning rate, a config)."""
    buf = io.BytesIO()
    try:
        write_zip(buf, value)
    except Unsupported:  # a type the torch-free writer does not know: torch's own pickling
        import torch

        buf = io.BytesIO()
        torch.save(value, buf)
    return buf.getvalue()


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


def write_data_file(
    path: str, items: List[Item], copier: Copier, progress: Optional[Progress] = None, hashes: Optional[Hashes] = None
) -> List[Tuple[int, int]]:
    """Write one data file, front to back; returns each item's (offset, length)."""
    fd = open_empty(path)
    watch = hashes.watch(path) if hashes else None
    placed, end = [], 0
    try:
        for item in items:
            if isinstance(item, Chunk):
                length = _write_tensor_chunk(fd, end, item, copier, progress, path, hashes)
            else:
                length = os.pwrite(fd, _value_frame(item[1]), end)
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


def write_metadata(
    folder: str, plan: DcpPlan, files: List[List[Item]], placements: List[List[Tuple[int, int]]]
) -> List[str]:
    """``.metadata`` once every data file is written: each item's (offset, length) per file."""
    names = data_file_names(files)
    where: Dict[Any, Tuple[str, int, int]] = {}  # id(chunk) or entry name -> (file, offset, length)
    for name, items, placed in zip(names, files, placements):
        for item, (at, length) in zip(items, placed):
            where[id(item) if isinstance(item, Chunk) else item[0]] = (name, at, length)
    entries: Dict[str, Any] = {}
    for name, e in plan.entries.items():
        if isinstance(e, TensorEntry):
            entries[name] = (
                dtype_name(e.fill.dtype),
                tuple(e.fill.shape),
                [(tuple(c.offsets), tuple(c.sizes), where[id(c)]) for c in e.chunks],
            )
        else:
            entries[name] = where[name]
    with open(os.path.join(folder, METADATA), "wb") as f:
        f.write(metadata_pickle(entries, plan.mapping, DCP_VERSION))
    return names + [METADATA]

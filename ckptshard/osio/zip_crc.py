"""Correct CRC-32s for the tensor records of a torch.save file filled in place.

``torch.save`` under ``skip_data`` writes each tensor's zip record with CRC
0 (in the data descriptor that follows the data and in the central
directory). torch.load does not check them, but every zip tool does
(``unzip -t``, Python's ``zipfile``), so a filled file would look corrupt.
After a record is filled its CRC is computed from the bytes in place and
written into its data descriptor, which lies after the data, so
front-to-back hashing (``osio/hashing.py``) still sees each byte only when it is
final; the central directory is patched last. The CRC-32 comes from ISA-L
(the ``isal`` package), several times zlib's speed, and from zlib where
isal is not installed: the same value either way. (A record without a data
descriptor keeps its CRC in the local header, before the data: correct, but
hashing then trails the patch, which only torch.save's layout avoids.)
"""

from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple, Union

from ..formats.zip_records import data_start

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels: slower, same CRC
    from zlib import crc32

_CENTRAL_SIG = 0x02014B50
_DESCRIPTOR_SIG = b"PK\x07\x08"
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Record:
    name: str
    data_start: int
    size: int
    local_crc: int  # where the record's CRC goes before the central directory: descriptor or local header
    central_crc: int  # where the CRC of the central directory entry is


def records(path: str) -> Dict[int, Record]:
    """Every stored record of the zip at ``path``, by the offset its data starts at."""
    out: Dict[int, Record] = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
        infos = zf.infolist()
        central = zf.start_dir
        entries: List[int] = []
        for _ in infos:
            f.seek(central)
            head = f.read(46)
            if struct.unpack_from("<I", head)[0] != _CENTRAL_SIG:
                raise ValueError(f"{path}: unexpected central directory layout")
            n, e, c = struct.unpack_from("<HHH", head, 28)
            entries.append(central + 16)
            central += 46 + n + e + c
        for info, crc_at in zip(infos, entries):
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            start, flags = data_start(f, info)
            local_crc = info.header_offset + 14
            if flags & 0x8:  # sizes and CRC follow the data (torch.save's layout)
                f.seek(start + info.compress_size)
                local_crc = start + info.compress_size + (4 if f.read(4) == _DESCRIPTOR_SIG else 0)
            out[start] = Record(info.filename, start, info.file_size, local_crc, crc_at)
    return out


def set_crc(target: Union[int, memoryview, bytearray], crc: int, positions: Iterable[int], base: int = 0) -> None:
    """Write ``crc`` at each of ``positions`` (+ ``base``) of a file (an fd) or a buffer: the one place
    a zip record's CRC-32 is set, in its data descriptor or local header and in the central directory."""
    raw = struct.pack("<I", crc)
    for pos in positions:
        if isinstance(target, int):
            os.pwrite(target, raw, base + pos)
        else:
            target[base + pos : base + pos + 4] = raw


def crc_of(fd: int, start: int, size: int, buf: bytearray) -> int:
    crc, view = 0, memoryview(buf)
    while size > 0:
        got = os.preadv(fd, [view[: min(size, len(buf))]], start)
        if got <= 0:
            raise OSError(f"short read at byte {start}")
        crc = crc32(view[:got], crc)
        start, size = start + got, size - got
    return crc


def deferred_crcs(path: str, starts: List[int]) -> Optional[List[Tuple[int, int, Tuple[int, int]]]]:
    """For the records starting at ``starts``: (data start, size, where the CRC goes), in file order.

    None where some record keeps its CRC before its data (no data
    descriptor): it cannot be patched by a pass that reads front to back.
    """
    recs = records(path)
    out = []
    for start in sorted(starts):
        rec = recs.get(start)
        if rec is None:
            raise AssertionError(f"no zip record starts at byte {start}")
        if rec.local_crc < rec.data_start + rec.size:
            return None
        out.append((rec.data_start, rec.size, (rec.local_crc, rec.central_crc)))
    return out


class CrcFixer:
    """Call :meth:`filled` after each record is complete, :meth:`finish` once all are."""

    def __init__(self, path: str, fd: int) -> None:
        self._records = records(path)
        self._fd = fd
        self._buf = bytearray(_BLOCK)
        self._done: Dict[int, int] = {}

    def filled(self, data_start: int) -> None:
        rec = self._records.get(data_start)
        if rec is None:
            raise AssertionError(f"no zip record starts at byte {data_start}")
        crc = crc_of(self._fd, rec.data_start, rec.size, self._buf)
        set_crc(self._fd, crc, (rec.local_crc,))
        self._done[data_start] = crc

    def finish(self) -> None:
        for start, crc in self._done.items():
            set_crc(self._fd, crc, (self._records[start].central_crc,))

"""Zip structures torch.save files are made of: the local file header, and where a record's data starts."""

from __future__ import annotations

import struct
import zipfile
from typing import BinaryIO, Tuple

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, without its name and extra field
LOCAL_SIG = 0x04034B50


def data_start(f: BinaryIO, info: zipfile.ZipInfo) -> Tuple[int, int]:
    """Where ``info``'s data starts in the open zip ``f``, and its local header's flags."""
    f.seek(info.header_offset)
    local = LOCAL_HEADER.unpack(f.read(LOCAL_HEADER.size))
    if local[0] != LOCAL_SIG:
        raise ValueError(f"{info.filename}: bad local header")
    return info.header_offset + LOCAL_HEADER.size + local[9] + local[10], local[2]

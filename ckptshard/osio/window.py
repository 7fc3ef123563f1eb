"""Windows onto files: a read-only part of an open file as a file object, and when to map one."""

from __future__ import annotations

import io
import os
from typing import Any

# Runs below this are read and written through memory, not mapped: mapping a window costs an mmap, a
# munmap and, with threads, the mapping lock and TLB shootdowns per run, and copy_file_range of a few
# KiB costs several times a pread and a pwrite.
MAP_MIN = 256 << 10


class FileWindow(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of the open file ``fd``; positions are relative to ``offset``.

    DCP data files hold one torch.save zip per chunk back to back: ``zipfile``
    and ``torch.load`` read one of them through a window.
    """

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

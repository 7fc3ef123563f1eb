"""Start writing finished bytes to disk early, so the closing fsync has little left to do.

Outputs are fsynced before they are renamed into place. Left alone, the
kernel holds the dirty pages until that fsync and then writes everything at
once, after the copy is over. ``sync_file_range(SYNC_FILE_RANGE_WRITE)``
queues the writeback of a finished span right away and returns; the disk
then writes while the copy goes on. It promises nothing about durability:
the fsync stays. Linux only; elsewhere this is a no-op.
"""

from __future__ import annotations

from typing import Any, Optional

from .libc import bind

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait


def _bind() -> Optional[Any]:
    """libc's sync_file_range, bound on first use (--no-fsync runs never need it)."""
    return bind("sync_file_range", ("c_int", "c_int64", "c_int64", "c_uint"))


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Queue the dirty pages of ``[offset, offset + nbytes)`` of ``fd`` for writing; True if the kernel took it.

    Never raises: an fd that does not support it (a pipe, some filesystems)
    simply gets its data written by the final fsync.
    """
    fn = _bind() if nbytes > 0 else None
    if fn is None:
        return False
    return fn(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) == 0

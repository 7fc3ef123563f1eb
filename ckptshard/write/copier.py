"""Write planned tensors (:class:`~ckptshard.tensors.Fill`) into output files from byte ranges of source files.

Same-dtype runs are copied file to file by the kernel
(``os.copy_file_range``, or ``pwrite`` from a mapped window of the source
where the two offsets are not page-aligned alike), so memory stays flat
whatever the size; runs that change dtype go through a bounded buffer.
Elements no source covers are padding and stay zero (outputs are
pre-sized, and unwritten bytes of a file read as zero).
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any, Dict, Optional

from ..dtypes import dtype_name, itemsize_of, to_torch
from ..errors import CheckpointError
from ..osio.window import MAP_MIN
from ..read.tensor_data import read_flat
from ..tensors import Fill, Progress, Source

if TYPE_CHECKING:
    pass

BLOCK = 64 * 1024 * 1024
MAPPED_WINDOW = 8 << 20  # 32 MiB windows were no faster
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map a window's pages at once, not a fault at a time


def _plain_copy(s: Source, dtype: str) -> bool:
    """``s`` is copied byte for byte into an output of ``dtype`` (same dtype, contiguous source)."""
    return dtype_name(s.ref.dtype) == dtype and s.ref.contiguous


def _truncated(path: str, end: int) -> CheckpointError:
    return CheckpointError(f"{path}: truncated: data ends before byte {end}")


class Copier:
    """Executes Fills; keeps source files open across calls."""

    def __init__(self, use_copy_file_range: bool = True) -> None:
        self._fds: Dict[str, int] = {}
        self._fast = use_copy_file_range and hasattr(os, "copy_file_range")
        self._mappable = True  # until a source cannot be mapped: then the other ways, from there on

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Copier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fill(self, out_fd: int, out_offset: int, fill: Fill, progress: Optional[Progress] = None) -> None:
        isz = itemsize_of(fill.dtype)
        name = dtype_name(fill.dtype)
        for s in fill.sources:
            if s.length == 0:
                continue
            if _plain_copy(s, name):
                self._copy(
                    s.ref.path,
                    s.ref.offset + s.src_start * isz,
                    out_fd,
                    out_offset + s.dst_start * isz,
                    s.length * isz,
                )
            else:
                self._convert(out_fd, out_offset, isz, fill.dtype, s)
            if progress:
                progress(s.length * isz)

    @staticmethod
    def copies_only(fill: Fill) -> bool:
        """Every source of ``fill`` is a plain byte copy (no dtype conversion, no strided gather)."""
        name = dtype_name(fill.dtype)
        return all(s.length == 0 or _plain_copy(s, name) for s in fill.sources)

    def fill_memory(self, out: memoryview, fill: Fill) -> None:
        """Read ``fill``'s bytes into ``out`` (its size), each run straight into its place (for
        :meth:`copies_only` fills)."""
        isz = itemsize_of(fill.dtype)
        for s in fill.sources:
            if s.length == 0:
                continue
            start, n = s.dst_start * isz, s.length * isz
            src_off, fd, got = s.ref.offset + s.src_start * isz, self._fd(s.ref.path), 0
            while got < n:  # one read, unless it comes back short (an interrupted one; the end of the file)
                more = os.preadv(fd, [out[start + got : start + n]], src_off + got)
                if more == 0:
                    raise _truncated(s.ref.path, src_off + n)
                got += more

    def _copy(self, src_path: str, src_off: int, out_fd: int, out_off: int, n: int) -> None:
        fd = self._fd(src_path)
        if n < MAP_MIN:
            self._copy_read(src_path, fd, src_off, out_fd, out_off, n)
            return
        if self._mappable and (src_off - out_off) % mmap.PAGESIZE:
            if self._copy_mapped(src_path, fd, src_off, out_fd, out_off, n):
                return
            self._mappable = False
        if self._fast:
            try:
                while n > 0:
                    done = os.copy_file_range(fd, out_fd, min(n, 1 << 30), src_off, out_off)
                    if done == 0:
                        raise _truncated(src_path, src_off + n)
                    src_off, out_off, n = src_off + done, out_off + done, n - done
                return
            except OSError:
                self._fast = False  # e.g. across filesystems on old kernels: plain reads from here on
        self._copy_read(src_path, fd, src_off, out_fd, out_off, n)

    @staticmethod
    def _copy_read(src_path: str, fd: int, src_off: int, out_fd: int, out_off: int, n: int) -> None:
        while n > 0:
            chunk = os.pread(fd, min(n, BLOCK), src_off)
            if not chunk:
                raise _truncated(src_path, src_off + n)
            os.pwrite(out_fd, chunk, out_off)
            src_off, out_off, n = src_off + len(chunk), out_off + len(chunk), n - len(chunk)

    def _copy_mapped(self, src_path: str, fd: int, src_off: int, out_fd: int, out_off: int, n: int) -> bool:
        """Copy through a mapped window of the source; False where the file cannot be mapped.

        For ranges whose source and output offsets differ modulo a page,
        where ``copy_file_range`` is slower and ``pwrite`` from a mapping
        costs the same as at equal offsets (docs/performance.md). The kernel
        reads the mapping, so a source shorter than expected gives a short
        write (an error below), never SIGBUS; windows keep memory flat.
        """
        if os.fstat(fd).st_size < src_off + n:
            raise _truncated(src_path, src_off + n)
        while n > 0:
            base = src_off - src_off % mmap.ALLOCATIONGRANULARITY
            size = min(n, MAPPED_WINDOW - (src_off - base))
            try:
                window = mmap.mmap(fd, src_off - base + size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ, offset=base)
            except (OSError, ValueError):  # a file system that cannot map: copy_file_range or reads instead
                return False
            try:
                with memoryview(window)[src_off - base :] as data:
                    done = os.pwrite(out_fd, data, out_off)
            finally:
                window.close()
            if done <= 0:
                raise _truncated(src_path, src_off + n)
            src_off, out_off, n = src_off + done, out_off + done, n - done
        return True

    def _convert(self, out_fd: int, out_offset: int, isz: int, dtype: Any, s: Source) -> None:
        import torch

        dtype = to_torch(dtype)
        step = max(1, BLOCK // max(isz, s.ref.itemsize))
        for a in range(0, s.length, step):
            n = min(step, s.length - a)
            data = read_flat(s.ref, s.src_start + a, s.src_start + a + n).to(dtype)
            os.pwrite(out_fd, data.view(torch.uint8).numpy().tobytes(), out_offset + (s.dst_start + a) * isz)

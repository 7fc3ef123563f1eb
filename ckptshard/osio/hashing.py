"""XXH3-128 checksums of outputs while they are being written.

Writers fill every output front to back, one file after another: once bytes
``[0, n)`` of a file are final they say so (``advance(n)``), and one thread
trailing them hashes that span from the page cache, mapped (no copy into
a buffer of ours) where the filesystem allows. Copying
(``copy_file_range``, in the kernel) and hashing (``xxhash``, which
releases the GIL) then overlap instead of the hash re-reading every output
at the end.

The same pass computes the zip CRC-32s of torch.save records
(:meth:`Hashes.patch_crc`): the thread reads each byte once for both, and
writes each CRC into the descriptor and central directory entry after the
record before it hashes them. Until :meth:`Hashes.settled` (or
:meth:`Hashes.digest`) returns, such a file is not final: fsync and rename
it only after.

A small file that its writer put together in memory (``io/writers.py``)
is hashed by the writer from that buffer instead (:meth:`Hashes.hashed`).

Once a span is hashed the thread also queues its writeback
(:mod:`.writeback`): the disk writes during the copy instead of all at once
when the output is closed and fsynced.

XXH3-128 (the ``xxhash`` package, bindings of the reference library) is
the checksum rsync uses by default; ``xxh128sum`` (``xxhsum -H2``) prints the
same digests outside ckptshard. It runs at memory speed, several times
BLAKE3's and SHA-256's CPU speed (docs/performance.md), so it takes less of
the bandwidth the copy on the other core needs. It is not a
cryptographic hash, and need not be: the manifest that holds the digests
lies beside the files, so whoever could forge a file could rewrite its
manifest too; the digests find corruption and accidental changes.

Memory and open files stay bounded whatever the number of outputs: one
thread and one mapped buffer per run, and a writer that gets more than
``MAX_AHEAD`` complete files ahead of the hash waits for it to catch up.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
from typing import Callable, Deque, Dict, Iterator, Optional, Tuple

import xxhash

from .durability import durable
from .window import MAP_MIN
from .writeback import start_writeback
from .zip_crc import crc32, set_crc

ALGORITHM = "xxh3_128"  # the manifest's key for each file's digest
new_hash = xxhash.xxh3_128

BLOCK = 8 << 20
STEP = 256 << 10  # hash and CRC in turn over this much: a span stays in cache for both
MAX_AHEAD = 4

# Map every page of a window at once rather than a fault at a time: less CPU for the pass.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

Watermark = Callable[[int], None]  # "bytes [0, n) of the output are final"


class _File:
    def __init__(self, path: str, digest: Optional[str] = None) -> None:
        self.path = path
        # Now: the file may be renamed while it is hashed; RDWR for CRCs. None: hashed by its writer.
        self.fd = os.open(path, os.O_RDWR) if digest is None else -1
        self.mark = 0
        self.done = 0
        self.complete = digest is not None
        self.hash = new_hash() if digest is None else None
        self.crcs: Deque[Tuple[int, int, Tuple[int, ...]]] = collections.deque()  # (start, end, where), in order
        self.crc = 0  # of the front record, so far
        self.digest: Optional[str] = digest
        self.error: Optional[BaseException] = None


class Hashes:
    """The trailing hashes of one run's outputs, by path, computed by one thread in the order watched."""

    def __init__(self) -> None:
        self._durable = durable()  # else no early writeback either: the kernel writes back when it likes
        self._cond = threading.Condition()
        self._queue: Deque[_File] = collections.deque()  # watched, not yet hashed whole
        self._by_path: Dict[str, _File] = {}
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def watch(self, path: str) -> Watermark:
        """Start hashing ``path`` (which exists) as it is written; returns its ``advance``."""
        key = os.path.abspath(path)
        with self._cond:
            # Bounded lag: wait while many complete files are still to hash (never for one in progress).
            while sum(f.complete for f in self._queue) >= MAX_AHEAD and self._queue[0].complete:
                self._cond.wait()
            if key not in self._by_path:
                f = _File(key)
                self._by_path[key] = f
                self._queue.append(f)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="ckptshard hash", daemon=True)
                    self._thread.start()
                self._cond.notify_all()
            f = self._by_path[key]

        def advance(upto: int) -> None:
            with self._cond:
                if upto > f.mark:
                    f.mark = upto
                    self._cond.notify_all()

        return advance

    def hashed(self, path: str, fd: int, data: memoryview) -> None:
        """``path`` (open as ``fd``) was written whole from ``data`` (its every byte) by its writer, which
        hashes it here: the thread has nothing to read. Its writeback starts now where outputs are durable."""
        key = os.path.abspath(path)
        digest = new_hash(data).hexdigest()
        with self._cond:
            if key in self._by_path:
                raise AssertionError(f"{key}: already watched")
            self._by_path[key] = _File(key, digest)
        if self._durable:
            start_writeback(fd, 0, len(data))

    def patch_crc(self, path: str, start: int, size: int, positions: Tuple[int, ...]) -> None:
        """Once bytes ``[start, start + size)`` of watched ``path`` are hashed, write their CRC-32 at ``positions``.

        Records are given in file order, before the watermark passes
        ``start``; every position lies after the record and before the
        watermark's next step past it (a zip data descriptor, a central
        directory entry).
        """
        end = start + size
        if any(p < end for p in positions):
            raise AssertionError(f"CRC of [{start}, {end}) would be written before its end")
        with self._cond:
            f = self._by_path[os.path.abspath(path)]
            last = f.crcs[-1][1] if f.crcs else f.done
            if start < max(last, f.mark) or size <= 0:
                raise AssertionError(f"CRC record [{start}, {end}) given out of order or after it was hashed")
            f.crcs.append((start, end, tuple(positions)))

    def settled(self, path: str) -> None:
        """Wait until every CRC asked for ``path`` is written (the file is then final; its hash may trail)."""
        key = os.path.abspath(path)
        with self._cond:
            f = self._by_path.get(key)
            if f is None:
                return
        self.complete(key)
        with self._cond:
            while f.crcs and f.error is None:
                self._cond.wait()
        if f.error is not None:
            raise f.error

    def complete(self, path: str) -> None:
        """``path`` is written whole: the thread finishes its hash and moves on."""
        key = os.path.abspath(path)
        with self._cond:
            f = self._by_path.get(key)
            if f is not None:
                f.mark = max(f.mark, os.path.getsize(key))
                f.complete = True
                self._cond.notify_all()

    def moved(self, old: str, new: str) -> None:
        """``old`` was renamed to ``new`` (the hash reads an open file: it carries on)."""
        with self._cond:
            f = self._by_path.pop(os.path.abspath(old), None)
            if f is not None:
                self._by_path[os.path.abspath(new)] = f

    def digest(self, path: str) -> Optional[str]:
        """XXH3-128 of the finished ``path``, or None where it was not watched."""
        key = os.path.abspath(path)
        with self._cond:
            f = self._by_path.get(key)
        if f is None:
            return None
        self.complete(key)
        with self._cond:
            queue = list(self._queue)  # hashed in order: an unfinished earlier output would block this one
            if f in queue and not all(g.complete for g in queue[: queue.index(f)]):
                raise AssertionError(f"{key}: digest asked while an earlier output is still being written")
            while f.digest is None and f.error is None:
                self._cond.wait()
        if f.error is not None:
            raise f.error
        return f.digest

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for f in list(self._queue):
            os.close(f.fd)
        self._queue.clear()
        self._by_path.clear()

    def __enter__(self) -> Hashes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        buf = mmap.mmap(-1, BLOCK)  # the fallback's buffer, one for the run: fresh blocks made malloc arenas grow
        view = memoryview(buf)
        try:
            while True:
                with self._cond:
                    while not self._closed and (
                        not self._queue or (self._queue[0].done >= self._queue[0].mark and not self._queue[0].complete)
                    ):
                        self._cond.wait()
                    if self._closed:
                        return
                    f = self._queue[0]
                    upto = f.mark
                if f.done < upto:
                    try:
                        _hash_span(f, upto, view, self._cond, self._durable)
                    except OSError as e:
                        f.error = e
                with self._cond:
                    if f.error is not None or (f.complete and f.done >= f.mark):
                        if f.error is None:
                            f.digest = f.hash.hexdigest()
                        f.hash = None  # the entry stays (for digest lookups) without the hasher's state
                        os.close(f.fd)
                        self._queue.popleft()
                        self._cond.notify_all()
        finally:
            view.release()
            buf.close()


def _hash_span(f: _File, upto: int, view: memoryview, cond: threading.Condition, durable: bool) -> None:
    """Hash ``f`` from ``f.done`` to ``upto``, CRCs along the way, queueing each hashed block's writeback."""
    while f.done < upto:
        with cond:
            record = f.crcs[0] if f.crcs else None
        stop = upto
        if record is not None:  # reads stop at a record's edges: its CRC is written before the bytes after it are read
            stop = min(stop, record[0] if f.done < record[0] else record[1])
        start, stop = f.done, min(stop, f.done + BLOCK)
        in_record = record is not None and record[0] < stop <= record[1]
        with _span(f, start, stop, view) as data:
            # In steps that stay in the core's cache: the CRC reads what the hash just read.
            for at in range(0, len(data), STEP):
                with data[at : at + STEP] as step:
                    f.hash.update(step)
                    if in_record:
                        f.crc = crc32(step, f.crc)
        if durable:
            start_writeback(f.fd, start, stop - start)
        f.done = stop
        if record is not None and f.done == record[1]:
            set_crc(f.fd, f.crc, record[2])
            f.crc = 0
            with cond:
                f.crcs.popleft()
                cond.notify_all()


@contextlib.contextmanager
def _span(f: _File, start: int, stop: int, buf: memoryview) -> Iterator[memoryview]:
    """Bytes ``[start, stop)`` of ``f``: mapped from the page cache, or read into ``buf``.

    Mapping skips a copy of every output byte, a third of the hash's CPU. A span past the end of the file is read, never
    mapped: touching a mapping beyond EOF kills the process with SIGBUS.
    """
    mapped = None
    if stop - start >= MAP_MIN and os.fstat(f.fd).st_size >= stop:  # small spans: one read beats a mapping
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(f.fd, stop - base, _MAP_FLAGS, mmap.PROT_READ, offset=base)
        except (OSError, ValueError):  # a filesystem that cannot map: read instead
            mapped = None
    if mapped is None:
        n = os.preadv(f.fd, [buf[: stop - start]], start)
        if n != stop - start:
            raise OSError(f"{f.path}: shorter than {stop} bytes while hashing")
        yield buf[:n]
        return
    data = memoryview(mapped)[start - base :]
    try:
        yield data
    finally:
        data.release()
        mapped.close()

"""SHA-256 of an output while it is being written.

Writers fill every output front to back: once bytes ``[0, n)`` are final
they say so (``advance(n)``), and a thread trailing them hashes that span
from the page cache. Copying (``copy_file_range``, in the kernel) and
hashing (``hashlib``, which releases the GIL) then overlap instead of the
hash re-reading the whole output at the end.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import threading
from typing import Callable, Optional

BLOCK = 8 << 20

Watermark = Callable[[int], None]  # "bytes [0, n) of the output are final"


class TrailingHash:
    """SHA-256 of ``path``, computed by a thread that trails the writer's watermark.

    ``path`` must exist when this is made (the writer created it).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mark = 0
        self._done = 0
        self._closed = False
        self._error: Optional[BaseException] = None
        self._hash = hashlib.sha256()
        self._cond = threading.Condition()
        self._fd = os.open(path, os.O_RDONLY)  # now: the file may be renamed while it is hashed
        self._thread = threading.Thread(target=self._run, name=f"sha256 {os.path.basename(path)}", daemon=True)
        self._thread.start()

    def advance(self, upto: int) -> None:
        """Bytes ``[0, upto)`` will not change any more."""
        with self._cond:
            if upto > self._mark:
                self._mark = upto
                self._cond.notify()

    def hexdigest(self, size: int) -> str:
        """The digest of the whole file, ``size`` bytes long, once written."""
        self.advance(size)
        self._stop()
        if self._error is not None:
            raise self._error
        if self._done != size:
            raise AssertionError(f"{self.path}: hashed {self._done} of {size} bytes")
        return self._hash.hexdigest()

    def complete(self, size: int) -> None:
        """The writer is done: hash to ``size`` and let the thread end (its buffer goes with it)."""
        self.advance(size)
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def close(self) -> None:
        """Stop without a digest (the write failed)."""
        self._stop()

    def _run(self) -> None:
        fd = self._fd
        # One buffer, mapped and unmapped with the thread: fresh blocks per read made the
        # thread's malloc arena grow with the output.
        buf = mmap.mmap(-1, BLOCK)
        view = memoryview(buf)
        try:
            while True:
                with self._cond:
                    while self._done >= self._mark and not self._closed:
                        self._cond.wait()
                    upto = self._mark
                    if self._done >= upto and self._closed:
                        return
                while self._done < upto:
                    n = os.preadv(fd, [view[: min(BLOCK, upto - self._done)]], self._done)
                    if not n:
                        raise OSError(f"{self.path}: shorter than {upto} bytes while hashing")
                    self._hash.update(view[:n])
                    self._done += n
        except BaseException as e:  # reported by hexdigest
            self._error = e
        finally:
            os.close(fd)
            view.release()
            buf.close()


class Hashes:
    """The trailing hashes of one run's outputs, by path."""

    def __init__(self) -> None:
        self._by_path: "dict[str, TrailingHash]" = {}

    def watch(self, path: str) -> Watermark:
        """Start hashing ``path`` as it is written; returns its ``advance``."""
        key = os.path.abspath(path)
        if key not in self._by_path:
            self._by_path[key] = TrailingHash(key)
        return self._by_path[key].advance

    def complete(self, path: str) -> None:
        """``path`` is written whole: its hash finishes in the background."""
        h = self._by_path.get(os.path.abspath(path))
        if h is not None:
            h.complete(os.path.getsize(path))

    def moved(self, old: str, new: str) -> None:
        """``old`` was renamed to ``new`` (the hash reads an open file: it carries on)."""
        h = self._by_path.pop(os.path.abspath(old), None)
        if h is not None:
            self._by_path[os.path.abspath(new)] = h

    def digest(self, path: str) -> Optional[str]:
        """SHA-256 of the finished ``path``, or None where it was not watched."""
        h = self._by_path.pop(os.path.abspath(path), None)
        return None if h is None else h.hexdigest(os.path.getsize(path))

    def close(self) -> None:
        for h in self._by_path.values():
            h.close()
        self._by_path.clear()

    def __enter__(self) -> "Hashes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

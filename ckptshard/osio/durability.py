"""Whether outputs are made durable (fsynced) before they are renamed into place.

By default every output is fsynced, then renamed, then its folder fsynced:
once a command returns, a crash or power loss cannot leave a renamed output
with missing data. ``fsync=False`` (``--no-fsync``) skips the fsyncs and the
early writeback, as ``cp`` does: outputs are still written to a temporary
and renamed only when complete, so an interrupted run leaves nothing; the
data reaches the disk when the kernel writes it back.

The choice is per call (a context variable: writer threads run in a copy of
their command's context, ``--jobs`` workers are handed it at start), and
the environment variable below gives the default, so torchrun ranks started
with it set skip the fsyncs too.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Optional

ENV = "CKPTSHARD_NO_FSYNC"
_FSYNC: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("fsync", default=None)


def durable() -> bool:
    chosen = _FSYNC.get()
    return chosen if chosen is not None else os.environ.get(ENV, "") in ("", "0")


@contextlib.contextmanager
def fsyncing(fsync: Optional[bool]) -> Iterator[None]:
    """Inside the block, outputs are fsynced or not as ``fsync`` says (None: as the environment says)."""
    token = _FSYNC.set(fsync)
    try:
        yield
    finally:
        _FSYNC.reset(token)


def set_fsync(fsync: Optional[bool]) -> None:
    """For the whole of this context (a worker process's start): as :func:`fsyncing`."""
    _FSYNC.set(fsync)

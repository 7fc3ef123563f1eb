"""The files a command reads: regular files only, and unchanged from first read to last.

A training job may overwrite ``checkpoint_last-shard*.pt`` while a
conversion reads them. Pickles are read first and tensor data later (by
path, in other threads or processes), so a file replaced in between would
mix two checkpoints in one output. Every reader calls :func:`input_file`
before it opens a file: that refuses what is not a regular file (a FIFO
would block forever, ``/dev/zero`` never ends) and, inside
:func:`watching_inputs`, records the file's identity, size and times.
:func:`check_inputs_unchanged` compares them again; ``atomic_output`` calls
it before it renames an output into place, so an output is only ever
published from files that did not change while it was written.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import stat
from typing import Dict, Iterator, Tuple

from ..errors import CheckpointError, InputChanged

FileState = Tuple[int, int, int, int, int]  # device, inode, size, mtime_ns, ctime_ns

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)

# One dict per active watch (innermost last), per call: two commands run at once in two threads keep
# their own (writer threads run in a copy of their command's context). Reads outside any watch are
# checked, not recorded.
_WATCHES: contextvars.ContextVar[Tuple[Dict[str, FileState], ...]] = contextvars.ContextVar("watches", default=())


def _state(st: os.stat_result) -> FileState:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def input_file(path: str) -> os.stat_result:
    """Stat ``path`` (following links) and refuse anything but a regular file; record it while watched."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise CheckpointError(f"{path}: is {kind}, not a checkpoint file")
    watches = _WATCHES.get()
    if watches:
        key = os.path.abspath(path)
        for seen in watches:
            if key in seen and seen[key] != _state(st):
                raise _changed(path)
            seen.setdefault(key, _state(st))
    return st


def _changed(path: str) -> CheckpointError:
    return InputChanged(
        f"{path}: changed while ckptshard was reading it (is a job still writing it?); "
        "nothing was written: run again once the checkpoint is complete"
    )


def check_inputs_unchanged() -> None:
    """Raise if any file read under the active watches has changed or been replaced since its first read."""
    for seen in _WATCHES.get():
        for path, state in seen.items():
            try:
                now = _state(os.stat(path))
            except OSError:
                raise _changed(path) from None
            if now != state:
                raise _changed(path)


@contextlib.contextmanager
def watching_inputs() -> Iterator[None]:
    """Record every input read inside the block; outputs renamed inside it check them first."""
    token = _WATCHES.set((*_WATCHES.get(), {}))
    try:
        yield
    finally:
        _WATCHES.reset(token)

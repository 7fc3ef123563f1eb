"""Outputs appear whole or not at all.

Everything is written under a temporary name beside the final one, flushed
and fsynced, and renamed into place only once complete. Any exception,
SIGINT or SIGTERM on the way removes the temporary, so an interrupted run
leaves nothing that looks like a finished checkpoint.
"""
from __future__ import annotations

import contextlib
import os
import shutil  # free: zipfile, which every command imports, imports it too
from typing import Iterator

from ..errors import CheckpointError
from .durability import durable
from .libc import bind


def open_empty(path: str) -> int:
    """Open ``path`` for writing from empty, creating it: a read-write fd.

    Not ``O_TRUNC``: truncating an existing (even empty) file makes ext4 flush
    the whole file when it is closed (its ``auto_da_alloc`` guard for
    replace-by-truncate), which cost 0.75 s per 2 GiB output, serialised
    before the fsync. The temporaries from :func:`atomic_output` exist and
    are empty; only a file that holds bytes is truncated.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if os.fstat(fd).st_size:
        os.ftruncate(fd, 0)
    return fd


def preallocate(fd: int, size: int) -> None:
    """Give the empty file ``fd`` its final ``size``, its blocks allocated at once where the filesystem can.

    An output written front to back then needs no block allocation on the
    way, and lies in few extents: 2 GiB copied into one file took 0.593 s
    instead of 0.636 s here (consolidate: 0.621 against 0.635 s). Linux's
    ``fallocate``, not ``posix_fallocate``: glibc emulates the latter by
    writing zeros where the filesystem cannot, which would write the file
    twice. Where it cannot, the file is only extended (sparse).
    """
    fn = bind("fallocate", ("c_int", "c_int", "c_int64", "c_int64")) if size > 0 else None
    if fn is None or fn(fd, 0, 0, size) != 0:
        os.ftruncate(fd, size)


def check_output(final: str, overwrite: bool, inputs: tuple = ()) -> None:
    """Refuse an output that exists (unless ``overwrite``) or that is an input."""
    final_abs = os.path.realpath(final)
    for p in inputs:
        rp = os.path.realpath(p)
        if rp == final_abs or rp.startswith(final_abs.rstrip(os.sep) + os.sep):
            raise CheckpointError(f"{final}: output would overwrite the input {p}")
    parent = os.path.dirname(final_abs) or "."
    if not os.path.isdir(parent):
        raise CheckpointError(f"{final}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"{final}: folder {parent} is not writable")
    if os.path.lexists(final) and not overwrite:
        raise CheckpointError(f"{final}: exists; pass --overwrite to replace it")


def check_space(final: str, nbytes: int) -> None:
    """Refuse to start a write the disk cannot hold (plus 1% and 16 MiB of slack)."""
    parent = os.path.dirname(os.path.realpath(final)) or "."
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    need = int(nbytes * 1.01) + (16 << 20)
    if free < need:
        raise CheckpointError(
            f"{final}: needs {need / 2**30:.2f} GiB but {parent} has {free / 2**30:.2f} GiB free"
        )


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    if not durable():
        return
    if os.path.isdir(path):
        for root, _dirs, files in os.walk(path):
            for f in files:
                fsync_path(os.path.join(root, f))
            fsync_path(root)
    else:
        fsync_path(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def new_beside(parent: str, name: str, suffix: str, is_dir: bool) -> str:
    """Create an empty file or folder ``.{name}.<random>{suffix}`` in ``parent``, never an existing one.

    As ``tempfile.mkstemp``/``mkdtemp`` do (exclusive create), but with the
    usual permissions (the umask's) instead of private ones, and without
    importing ``tempfile`` (with ``random``, 1-3 ms of every command's start-up).
    """
    for _ in range(100):
        path = os.path.join(parent, f".{name}.{os.urandom(6).hex()}{suffix}")
        try:
            if is_dir:
                os.mkdir(path, 0o777)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: no free temporary name for {name}")


@contextlib.contextmanager
def atomic_output(final: str, is_dir: bool, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary path to write ``final`` into; rename it when the block ends cleanly."""
    final = os.path.abspath(final)
    parent, name = os.path.split(final)
    tmp = new_beside(parent, name, ".ckptshard-tmp", is_dir)
    try:
        yield tmp
        _fsync_tree(tmp)
        if os.path.lexists(final):
            if not overwrite:
                raise CheckpointError(f"{final}: appeared while writing; left it alone")
            old = new_beside(parent, name, ".ckptshard-old", is_dir=True)
            os.rename(final, os.path.join(old, name))
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        if durable():
            fsync_path(parent)
    except BaseException:
        _remove(tmp)
        raise

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
from typing import Iterator, Optional

from ..errors import CheckpointError, OutputExists
from .durability import durable
from .inputs import check_inputs_unchanged
from .libc import bind
from .manifest import check_replaceable, manifest_path_of_file, read_manifest_files


def open_empty(path: str) -> int:
    """Open ``path`` for writing from empty, creating it: a read-write fd.

    Not ``O_TRUNC``: truncating an existing (even empty) file makes ext4 flush
    the whole file when it is closed (its ``auto_da_alloc`` guard for
    replace-by-truncate), serialised before the fsync. The temporaries from :func:`atomic_output` exist and
    are empty; only a file that holds bytes is truncated.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if os.fstat(fd).st_size:
        os.ftruncate(fd, 0)
    return fd


def preallocate(fd: int, size: int) -> None:
    """Give the empty file ``fd`` its final ``size``, its blocks allocated at once where the filesystem can.

    An output written front to back then needs no block allocation on the
    way, and lies in few extents (faster to write: docs/performance.md). Linux's
    ``fallocate``, not ``posix_fallocate``: glibc emulates the latter by
    writing zeros where the filesystem cannot, which would write the file
    twice. Where it cannot, the file is only extended (sparse).
    """
    fn = bind("fallocate", ("c_int", "c_int", "c_int64", "c_int64")) if size > 0 else None
    if fn is None or fn(fd, 0, 0, size) != 0:
        os.ftruncate(fd, size)


def check_output(final: str, overwrite: bool, inputs: tuple = (), is_dir: bool = False) -> None:
    """Refuse an output that is, holds or would overwrite an input, or lies inside an input that is a folder
    read whole, or that exists unless ``overwrite`` and ckptshard wrote it; a file output's manifest
    (``OUT.manifest.json``) is checked the same way."""
    final_abs = os.path.realpath(final)
    created = [final_abs] if is_dir else [final_abs, manifest_path_of_file(final_abs)]
    for p in inputs:
        rp = os.path.realpath(p)
        for c in created:
            if rp == c or rp.startswith(c.rstrip(os.sep) + os.sep):
                raise CheckpointError(f"{final}: output would overwrite the input {p}")
            if os.path.isdir(rp) and c.startswith(rp.rstrip(os.sep) + os.sep):
                raise CheckpointError(f"{final}: output lies inside the input folder {p}; write it elsewhere")
    parent = os.path.dirname(final_abs) or "."
    if not os.path.isdir(parent):
        raise CheckpointError(f"{final}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"{final}: folder {parent} is not writable")
    limit = _name_max(parent)
    for c in created:
        if len(os.fsencode(os.path.basename(c))) > limit:
            raise CheckpointError(
                f"{final}: the name {os.path.basename(c)!r} is longer than the {limit} bytes {parent} allows"
            )
    if os.path.lexists(final) and not overwrite:
        raise OutputExists(f"{final}: exists; pass --overwrite to replace it")
    if os.path.lexists(final):
        check_replaceable(final, is_dir)
    if not is_dir and os.path.lexists(created[1]):
        if not overwrite:
            raise OutputExists(f"{final}: its manifest {created[1]} exists; pass --overwrite to replace it")
        if read_manifest_files(created[1]) is None:
            raise CheckpointError(f"{created[1]}: exists and is not a ckptshard manifest; left it alone")


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_space(final: str, nbytes: int) -> None:
    """Refuse to start a write the disk cannot hold (plus 1% and 16 MiB of slack)."""
    parent = os.path.dirname(os.path.realpath(final)) or "."
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    need = int(nbytes * 1.01) + (16 << 20)
    if free < need:
        raise CheckpointError(f"{final}: needs {need / 2**30:.2f} GiB but {parent} has {free / 2**30:.2f} GiB free")


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


TMP_SUFFIX = ".ckptshard-tmp"
OLD_SUFFIX = ".ckptshard-old"
_STEM_MAX = 120  # bytes of the output's name kept in its temporaries' names: any output name fits


def _stem(name: str) -> str:
    raw = os.fsencode(name)[:_STEM_MAX]
    return os.fsdecode(raw.decode("utf-8", "ignore").encode())


def new_beside(parent: str, name: str, suffix: str, is_dir: bool) -> str:
    """Create an empty file or folder ``.{name}.<random>{suffix}`` in ``parent``, never an existing one.

    As ``tempfile.mkstemp``/``mkdtemp`` do (exclusive create), but with the
    usual permissions (the umask's) instead of private ones, and without
    importing ``tempfile``. A long ``name`` is cut so the temporary's name
    stays within the filesystem's limit.
    """
    for _ in range(100):
        path = os.path.join(parent, f".{_stem(name)}.{os.urandom(6).hex()}{suffix}")
        try:
            if is_dir:
                os.mkdir(path, 0o777)
            else:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: no free temporary name for {name}")


def _lock(path: str) -> Optional[int]:
    """An fd holding an exclusive lock on ``path``; None if another process holds one (or none can be taken)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _leftovers(final: str) -> list:
    parent, name = os.path.split(os.path.abspath(final))
    head = f".{_stem(name)}."
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    return [
        os.path.join(parent, e)
        for e in sorted(entries)
        if e.startswith(head) and e.endswith((TMP_SUFFIX, OLD_SUFFIX)) and len(e) == len(head) + 12 + 14
    ]


def clean_leftovers(final: str) -> None:
    """Remove the temporaries an interrupted run (``kill -9``, power loss) left beside ``final``, saying so.

    A run holds a lock on its temporary while it writes; one that is locked
    belongs to a run still going, and is an error. An old output set aside
    while it was being replaced is put back if nothing took its place.
    """
    import warnings

    for path in _leftovers(final):
        try:
            fd = _lock(path)
        except FileNotFoundError:  # gone meanwhile
            continue
        if fd is None:
            raise CheckpointError(f"{final}: another ckptshard run is writing it now ({os.path.basename(path)})")
        try:
            kept = os.path.join(path, os.path.basename(final))
            if path.endswith(OLD_SUFFIX) and os.path.lexists(kept) and not os.path.lexists(final):
                os.rename(kept, final)
                warnings.warn(
                    f"{final}: put back the previous output, which an interrupted --overwrite had set "
                    f"aside in {os.path.basename(path)}",
                    stacklevel=2,
                )
            else:
                warnings.warn(f"removed {path}: left unfinished by an interrupted run", stacklevel=2)
            _remove(path)
        finally:
            os.close(fd)


def _replace(tmp: str, final: str, parent: str, name: str, is_dir: bool) -> None:
    """Put ``tmp`` in the place of the existing ``final``: the old one stays whole under its name until then."""
    if not is_dir:
        os.replace(tmp, final)  # one atomic step for a file
        return
    old = new_beside(parent, name, OLD_SUFFIX, is_dir=True)
    held = _lock(old)
    try:
        os.rename(final, os.path.join(old, name))
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(os.path.join(old, name), final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if held is not None:
            os.close(held)
        if os.path.isdir(old) and not os.listdir(old):
            os.rmdir(old)


@contextlib.contextmanager
def atomic_output(final: str, is_dir: bool, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary path to write ``final`` into; rename it when the block ends cleanly.

    Before the rename, every input the command read is checked unchanged
    (:func:`check_inputs_unchanged`). The temporary is locked while it is
    written, so a later run can tell it from one left by a killed run.
    """
    final = os.path.abspath(final)
    parent, name = os.path.split(final)
    clean_leftovers(final)
    tmp = new_beside(parent, name, TMP_SUFFIX, is_dir)
    held = _lock(tmp)
    try:
        yield tmp
        check_inputs_unchanged()
        _fsync_tree(tmp)
        if os.path.lexists(final):
            if not overwrite:
                raise CheckpointError(f"{final}: appeared while writing; left it alone")
            _replace(tmp, final, parent, name, is_dir)
        else:
            os.rename(tmp, final)
        if durable():
            fsync_path(parent)
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if held is not None:
            os.close(held)

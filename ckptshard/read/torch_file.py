"""Read a ``torch.save`` file's pickle without importing torch (see :mod:`ckptshard.formats.torch_pickle`)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import zipfile
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..formats.torch_distributed import Record
from ..formats.torch_pickle import (
    Unsupported,
    check_depth,
    check_zip_records,
    to_refs,
    unpickle_legacy,
    unpickle_zip,
)
from ..osio.inputs import input_file
from ..osio.window import FileWindow
from ..tree import Key, leaves


def torch_free_allowed() -> bool:
    """False where ``CKPTSHARD_TORCH_READER=1`` sends every read through torch."""
    return not os.environ.get("CKPTSHARD_TORCH_READER")


def read_torch_zip(
    path: str, offset: int = 0, length: Optional[int] = None, trusted: bool = False, inert: bool = False
) -> Any:
    """Unpickle ``path`` (zip-format torch.save) without torch; tensors become TensorRefs.

    ``offset``/``length``: the zip is that part of the file (a DCP chunk);
    TensorRefs still point into ``path``. ``trusted`` (--trust-pickles): any
    other global is imported, as torch.load would. Raises :class:`Unsupported` for
    anything it does not handle, including damaged files: the caller then
    uses torch.load, whose errors say why.
    """
    try:
        with open(path, "rb") as f:
            raw: Any = (
                f
                if offset == 0 and length is None
                else FileWindow(f.fileno(), offset, os.fstat(f.fileno()).st_size - offset if length is None else length)
            )
            with zipfile.ZipFile(raw) as zf:
                check_zip_records(zf, path)
                obj = unpickle_zip(zf, raw, offset, trusted, inert)
    except (Unsupported, CheckpointError):
        raise
    except Exception as e:  # damaged zip or pickle: torch.load will say what is wrong
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    check_depth(obj, path)
    return obj if inert else to_refs(path, obj)


def read_torch_legacy(path: str, trusted: bool = False, inert: bool = False) -> Any:
    """Unpickle ``path`` (legacy, non-zip torch.save) without torch; tensors become TensorRefs.

    ``trusted`` (--trust-pickles): any other global is imported, as torch.load would; it can run code.
    ``inert``: the tree as unpickled, any global outside the allow-list an inert record (see :func:`read_entry`).
    """
    try:
        with open(path, "rb") as f:
            obj = unpickle_legacy(f, os.fstat(f.fileno()).st_size, trusted, inert)
    except Unsupported:
        raise
    except Exception as e:  # damaged file: say what is wrong
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    check_depth(obj, path)
    return obj if inert else to_refs(path, obj)


# Inside a command (``reading_once``), each file's pickle is read once: the family probe and the family's own
# reader both ask for rank 0's. Keyed by the file's identity, so a file replaced in between is read again.
_READ: contextvars.ContextVar[Optional[Dict[Tuple[Any, ...], Any]]] = contextvars.ContextVar("read", default=None)


@contextlib.contextmanager
def reading_once() -> Iterator[None]:
    """Inside the block, :func:`read_torch_file` reads each file's pickle once and hands the same tree again."""
    token = _READ.set({})
    try:
        yield
    finally:
        _READ.reset(token)


def read_torch_file(path: str) -> Any:
    """:func:`read_torch_zip` or :func:`read_torch_legacy`, whichever format ``path`` is in."""
    st = input_file(path)
    seen = _READ.get()
    key = (os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if seen is not None and key in seen:
        return seen[key]
    tree = read_torch_zip(path) if zipfile.is_zipfile(path) else read_torch_legacy(path)
    if seen is not None:
        seen[key] = tree
    return tree


def read_entry(path: str, keys: Sequence[Key], trust_pickles: bool = False) -> Any:
    """``obj[keys[0]][keys[1]]...`` of the torch.save file ``path``, tensors as TensorRefs; None where a key is
    missing. Nothing else of the file runs: the other entries (a numpy RNG state, an object of the training
    code) are unpickled as inert records and dropped, and the entry taken may hold only what the torch-free
    reader accepts. A verl ``extra_state`` file's LR scheduler state is read this way, its RNG states never.

    ``trust_pickles``: ``torch.load(weights_only=False)`` of the whole file, which can run code.
    """
    input_file(path)
    where = f"{path}: {'.'.join(str(k) for k in keys)}"
    if trust_pickles:
        import torch

        obj: Any = torch.load(path, map_location="cpu", weights_only=False)  # --trust-pickles only
    else:
        try:
            zipped = zipfile.is_zipfile(path)
            obj = read_torch_zip(path, inert=True) if zipped else read_torch_legacy(path, inert=True)
        except Unsupported as e:
            raise CheckpointError(f"{path}: cannot read without --trust-pickles ({e})") from None
    for key in keys:
        if isinstance(obj, Record):
            raise CheckpointError(f"{where}: inside a pickled {obj.qualname}; --trust-pickles only if you trust it")
        if isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, (list, tuple)) and isinstance(key, int) and -len(obj) <= key < len(obj):
            obj = obj[key]
        else:
            return None
    if trust_pickles:
        return obj
    code = next((leaf for _, leaf in leaves(obj) if isinstance(leaf, Record)), None)
    if code is not None:
        raise CheckpointError(
            f"{where}: holds a pickled {code.qualname}, which would run code when loaded; "
            "pass --trust-pickles only if you trust this file"
        )
    try:
        return to_refs(path, obj)
    except Unsupported as e:
        raise CheckpointError(
            f"{where}: holds {e}, which is not unpickled without --trust-pickles (it could run code)"
        ) from None

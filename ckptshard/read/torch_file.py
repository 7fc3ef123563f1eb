"""Read a ``torch.save`` file's pickle without importing torch (see :mod:`ckptshard.formats.torch_pickle`)."""

from __future__ import annotations

import os
import zipfile
from typing import Any, Optional

from ..errors import CheckpointError
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


def torch_free_allowed() -> bool:
    """False where ``CKPTSHARD_TORCH_READER=1`` sends every read through torch."""
    return not os.environ.get("CKPTSHARD_TORCH_READER")


def read_torch_zip(path: str, offset: int = 0, length: Optional[int] = None, trusted: bool = False) -> Any:
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
                obj = unpickle_zip(zf, raw, offset, trusted)
    except (Unsupported, CheckpointError):
        raise
    except Exception as e:  # damaged zip or pickle: torch.load will say what is wrong
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    check_depth(obj, path)
    return to_refs(path, obj)


def read_torch_legacy(path: str, trusted: bool = False) -> Any:
    """Unpickle ``path`` (legacy, non-zip torch.save) without torch; tensors become TensorRefs.

    ``trusted`` (--trust-pickles): any other global is imported, as torch.load would; it can run code.
    """
    try:
        with open(path, "rb") as f:
            obj = unpickle_legacy(f, os.fstat(f.fileno()).st_size, trusted)
    except Unsupported:
        raise
    except Exception as e:  # damaged file: say what is wrong
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    check_depth(obj, path)
    return to_refs(path, obj)


def read_torch_file(path: str) -> Any:
    """:func:`read_torch_zip` or :func:`read_torch_legacy`, whichever format ``path`` is in."""
    input_file(path)
    return read_torch_zip(path) if zipfile.is_zipfile(path) else read_torch_legacy(path)

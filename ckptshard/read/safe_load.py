"""Load checkpoint files without running pickled code, and without reading data.

Files are unpickled with ``weights_only=True`` and ``map_location="meta"``:
tensors come back on the meta device carrying the byte offset of their data
in the file, so nothing but the pickle is read; each becomes a
:class:`~ckptshard.tensors.TensorRef`.
"""

from __future__ import annotations

import argparse
import contextlib
import pickle
import re
import threading
import warnings
import zipfile
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import CheckpointError
from ..formats.torch_pickle import Unsupported, check_depth, check_zip_records
from ..osio.inputs import input_file
from ..tensors import TensorRef
from .torch_file import read_torch_file, read_torch_legacy, torch_free_allowed

if TYPE_CHECKING:
    import torch

# Globals some real checkpoints need beyond torch's own weights-only set:
# fairseq's pre-hydra ``args`` is an argparse.Namespace.
SAFE_GLOBALS = [argparse.Namespace]


def _ref_of(path: str, t: torch.Tensor, at: int = 0) -> TensorRef:
    base = getattr(t.untyped_storage(), "_checkpoint_offset", None)
    if base is None:
        raise CheckpointError(f"{path}: cannot locate tensor data (not a zip-format torch.save file?)")
    return TensorRef(
        path=path,
        offset=at + int(base) + t.storage_offset() * t.element_size(),
        dtype=t.dtype,
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
    )


def meta_tensors_to_refs(path: str, obj: Any, at: int = 0) -> Any:
    """Every tensor of ``obj`` as a TensorRef into ``path``; ``at``: where the torch.save data starts in it."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _ref_of(path, obj, at)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = meta_tensors_to_refs(path, v, at)
        return out
    if isinstance(obj, list):
        return [meta_tensors_to_refs(path, v, at) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(meta_tensors_to_refs(path, v, at) for v in obj)
    return obj


def load_lazy(path: str, trust_pickles: bool = False, torch_free: bool = False) -> Any:
    """Unpickle ``path``; every tensor becomes a :class:`TensorRef`.

    With ``trust_pickles`` the file may run arbitrary code on load: only for
    files you made yourself. ``torch_free``: try the torch-free reader first
    (dtypes are then StoredDTypes; ``CKPTSHARD_TORCH_READER=1`` turns it off).
    """
    input_file(path)

    if torch_free and not trust_pickles and torch_free_allowed():
        try:
            return read_torch_file(path)
        except Unsupported:
            pass
    if not zipfile.is_zipfile(path):
        try:  # the legacy format: torch can only load it whole, the torch-free reader lazily
            if trust_pickles:
                warnings.warn(f"{path}: loading with full unpickling (--trust-pickles): it can run code", stacklevel=2)
            return read_torch_legacy(path, trust_pickles)
        except Unsupported as e:
            hint = "" if trust_pickles else "; if it holds other Python objects and you trust it, pass --trust-pickles"
            raise CheckpointError(
                f"{path}: not a zip-format torch.save checkpoint, nor a legacy one read lazily ({e}){hint}"
            ) from None
    try:
        with zipfile.ZipFile(path) as zf:
            check_zip_records(zf, path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        pass  # damaged: torch.load says how
    obj = safe_torch_load(path, path, trust_pickles)
    check_depth(obj, path)
    return meta_tensors_to_refs(path, obj)


_SAFE_GLOBALS_LOCK = threading.Lock()


@contextlib.contextmanager
def safe_globals() -> Iterator[None]:
    """torch's weights-only allow-list extended by :data:`SAFE_GLOBALS`, one thread at a time.

    ``torch.serialization.safe_globals`` changes a process-wide list and
    restores it on exit: one writer thread leaving it would take the entries
    away from another still loading. Loads onto the meta device read only
    pickles, so holding the lock costs little.
    """
    import torch

    with _SAFE_GLOBALS_LOCK, torch.serialization.safe_globals(SAFE_GLOBALS):
        yield


def safe_torch_load(f: Any, where: str, trust_pickles: bool = False) -> Any:
    """``torch.load(f)`` onto the meta device, weights-only unless ``trust_pickles``; errors name ``where``."""
    import torch

    try:
        if trust_pickles:
            warnings.warn(f"{where}: loading with full unpickling (--trust-pickles): it can run code", stacklevel=2)
            return torch.load(f, map_location="meta", weights_only=False)
        with safe_globals():
            return torch.load(f, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        msg = str(e)
        m = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", msg)
        if m:
            raise CheckpointError(
                f"{where}: refused to unpickle {m.group(1)} (safe loading); "
                "pass --trust-pickles only if you trust this file"
            ) from None
        raise CheckpointError(f"{where}: corrupted pickle: {_unpickler_detail(msg)}") from None
    except CheckpointError:
        raise
    except Exception as e:  # torch raises many types for damaged zips
        raise CheckpointError(f"{where}: cannot read checkpoint: {type(e).__name__}: {_first_line(e)}") from None


def _unpickler_detail(msg: str) -> str:
    """The informative line of torch's long weights-only failure message."""
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            rest = line.split("WeightsUnpickler error:", 1)[1].strip()
            if rest:
                return rest
    skip = ("Weights only load failed", "Check the documentation", "WeightsUnpickler error:", "Please file an issue")
    useful = [line for line in lines if not line.startswith(skip)]
    return useful[0][:200] if useful else "unreadable"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""

"""Load checkpoint files without running pickled code, and without reading data.

Files are unpickled with ``weights_only=True`` and ``map_location="meta"``:
tensors come back on the meta device carrying the byte offset of their data
in the file, so nothing but the pickle is read; each becomes a
:class:`~ckptshard.tensors.TensorRef`.

What torch offers here is detected, not looked up by version: torch up to
2.5 gives meta tensors no offset, and before 2.4 cannot widen its
weights-only allow-list. There torch still unpickles every file (its
verdict, its errors), and the offsets come from ckptshard's own reader of
the same pickle, whose tree must agree with torch's tensor for tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import pickle
import re
import threading
import warnings
import zipfile
from typing import TYPE_CHECKING, Any, Iterator, Optional

from ..dtypes import to_torch
from ..errors import CheckpointError
from ..formats.torch_pickle import Unsupported, check_depth, check_zip_records
from ..osio.inputs import input_file
from ..tensors import TensorRef
from ..tree import leaves, map_leaves
from .torch_file import read_torch_file, read_torch_legacy, read_torch_zip, torch_free_allowed

if TYPE_CHECKING:
    import torch

# Globals some real checkpoints need beyond torch's own weights-only set:
# fairseq's pre-hydra ``args`` is an argparse.Namespace.
SAFE_GLOBALS = [argparse.Namespace]
_SAFE_GLOBAL_NAMES = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}


@functools.cache
def torch_gives_offsets() -> bool:
    """Whether ``torch.load(map_location="meta")`` says where each storage's bytes are (torch newer than 2.5)."""
    import torch

    buf = io.BytesIO()
    torch.save(torch.zeros(1), buf)
    buf.seek(0)
    t = torch.load(buf, map_location="meta", weights_only=True)
    return getattr(t.untyped_storage(), "_checkpoint_offset", None) is not None


def torch_widens_allow_list() -> bool:
    """Whether torch's weights-only loading can take :data:`SAFE_GLOBALS` (torch 2.4+)."""
    import torch

    ser = torch.serialization
    return hasattr(ser, "safe_globals") or hasattr(ser, "add_safe_globals")


class NarrowAllowList(Unsupported):
    """torch refused one of :data:`SAFE_GLOBALS` and cannot be told to allow it: ckptshard's reader decides."""


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


def meta_tensors_to_refs(
    path: str, obj: Any, at: int = 0, length: Optional[int] = None, trust_pickles: bool = False
) -> Any:
    """Every tensor of ``obj`` (torch.load's, on the meta device) as a TensorRef into ``path``.

    ``at``/``length``: where the torch.save zip lies in ``path`` (a DCP frame).
    Where torch gives no offsets, ckptshard's reader of the same bytes does.
    """
    if not torch_gives_offsets():
        return _refs_agreeing_with(path, obj, at, length, trust_pickles)
    return _meta_to_refs(path, obj, at)


def _meta_to_refs(path: str, obj: Any, at: int) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return _ref_of(path, obj, at)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _meta_to_refs(path, v, at)
        return out
    if isinstance(obj, list):
        return [_meta_to_refs(path, v, at) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_meta_to_refs(path, v, at) for v in obj)
    return obj


def own_refs(path: str, at: int = 0, length: Optional[int] = None, trust_pickles: bool = False) -> Any:
    """ckptshard's reading of a zip-format torch.save in ``path``, with torch dtypes (as torch's reading has)."""
    try:
        obj = read_torch_zip(path, at, length, trusted=trust_pickles)
    except Unsupported as e:
        raise CheckpointError(
            f"{path}: this torch does not say where tensor data lies and ckptshard's reader cannot read it ({e}); "
            "a torch newer than 2.5 reads it"
        ) from None
    return map_leaves(obj, lambda x: dataclasses.replace(x, dtype=to_torch(x.dtype)) if isinstance(x, TensorRef) else x)


def _refs_agreeing_with(path: str, obj: Any, at: int, length: Optional[int], trust_pickles: bool) -> Any:
    """:func:`own_refs`, checked against torch's unpickling ``obj``: the same tree, tensor for tensor."""
    import torch

    ours = own_refs(path, at, length, trust_pickles)
    theirs = list(leaves(obj))
    mine = list(leaves(ours))
    if len(theirs) != len(mine):
        raise CheckpointError(f"{path}: torch and ckptshard's reader unpickle different trees")
    for (p1, t), (p2, ref) in zip(theirs, mine):
        if not isinstance(t, torch.Tensor):
            continue
        if p1 != p2 or not isinstance(ref, TensorRef) or (t.dtype, tuple(t.shape)) != (ref.dtype, ref.shape):
            raise CheckpointError(f"{path}: torch and ckptshard's reader disagree at {'.'.join(map(str, p1))}")
    return ours


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
    try:
        obj = safe_torch_load(path, path, trust_pickles)
    except NarrowAllowList:
        return own_refs(path)  # at least as strict as torch's list with SAFE_GLOBALS added
    check_depth(obj, path)
    return meta_tensors_to_refs(path, obj, trust_pickles=trust_pickles)


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

    ser = torch.serialization
    with _SAFE_GLOBALS_LOCK:
        if hasattr(ser, "safe_globals"):
            with ser.safe_globals(SAFE_GLOBALS):
                yield
        else:
            if hasattr(ser, "add_safe_globals"):  # torch 2.4: process-wide only; adding twice changes nothing
                ser.add_safe_globals(SAFE_GLOBALS)
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
        # torch 2.4+: "Unsupported global: GLOBAL x.y"; torch 2.0: "Unsupported class x.y"
        m = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)|Unsupported class ([\w.]+)", msg)
        name = m and (m.group(1) or m.group(2))
        if name in _SAFE_GLOBAL_NAMES and not torch_widens_allow_list():
            raise NarrowAllowList(name) from None
        if name:
            raise CheckpointError(
                f"{where}: refused to unpickle {name} (safe loading); pass --trust-pickles only if you trust this file"
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

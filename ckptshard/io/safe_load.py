"""Load checkpoint files without running pickled code, and without reading data.

Files are unpickled with ``weights_only=True`` and ``map_location="meta"``:
tensors come back on the meta device carrying the byte offset of their data
in the file, so nothing but the pickle is read. :class:`TensorRef` turns such
a tensor into a handle that reads byte ranges on demand.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import re
import threading
import warnings
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Tuple

from ..dtypes import to_torch, unpack_scalar
from ..errors import CheckpointError
from .inputs import input_file

if TYPE_CHECKING:
    import torch

# Globals some real checkpoints need beyond torch's own weights-only set:
# fairseq's pre-hydra ``args`` is an argparse.Namespace.
SAFE_GLOBALS = [argparse.Namespace]


@dataclass(frozen=True)
class TensorRef:
    """Where one stored tensor's bytes live: file, byte offset, dtype, shape.

    Only contiguous tensors can be read in ranges (flat parameter shards
    always are); others are read whole through their strides. ``dtype`` is a
    torch.dtype, or a StoredDType where the torch-free reader opened the file.
    """

    path: str
    offset: int
    dtype: Any
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def scalar(self) -> Any:
        """A one-element tensor's value as a Python number, read without torch where struct can."""
        if self.numel != 1:
            raise ValueError(f"{self.path}: a tensor of {self.numel} elements is not a scalar")
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            raw = f.read(self.itemsize)
        if len(raw) < self.itemsize:
            raise CheckpointError(f"{self.path}: truncated: tensor data ends early at byte {self.offset}")
        value = unpack_scalar(self.dtype, raw)
        return self.read().item() if value is None else value

    def read(self) -> "torch.Tensor":
        """The whole tensor, in fresh memory."""
        if self.contiguous:
            return self.read_flat(0, self.numel).reshape(self.shape)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride) if s > 0)
        flat = read_elements(self.path, self.offset, self.dtype, span, self.itemsize)
        return flat.as_strided(self.shape, self.stride).clone()

    def read_flat(self, start: int, stop: int) -> "torch.Tensor":
        """Elements ``[start, stop)`` of the flattened (contiguous) tensor."""
        if not self.contiguous:
            return self.read().reshape(-1)[start:stop].clone()
        return read_elements(
            self.path, self.offset + start * self.itemsize, self.dtype, stop - start, self.itemsize
        )


def read_scalars(refs: "list[TensorRef]") -> list:
    """The values of many one-element tensors, each file opened once (see :meth:`TensorRef.scalar`)."""
    fds: dict = {}
    out = []
    try:
        for ref in refs:
            if ref.numel != 1:
                raise ValueError(f"{ref.path}: a tensor of {ref.numel} elements is not a scalar")
            if ref.path not in fds:
                fds[ref.path] = os.open(ref.path, os.O_RDONLY)
            raw = os.pread(fds[ref.path], ref.itemsize, ref.offset)
            if len(raw) < ref.itemsize:
                raise CheckpointError(f"{ref.path}: truncated: tensor data ends early at byte {ref.offset}")
            value = unpack_scalar(ref.dtype, raw)
            out.append(ref.read().item() if value is None else value)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def read_elements(path: str, offset: int, dtype: Any, count: int, itemsize: int) -> "torch.Tensor":
    import torch

    out = torch.empty(count, dtype=to_torch(dtype))
    if count == 0:
        return out
    view = memoryview(out.view(torch.uint8).numpy())
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = f.readinto(view)
        while got < len(view):
            more = f.readinto(view[got:])
            if not more:
                raise CheckpointError(f"{path}: truncated: tensor data ends early at byte {offset + got}")
            got += more
    return out


def _ref_of(path: str, t: "torch.Tensor", at: int = 0) -> TensorRef:
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


def _to_refs(path: str, obj: Any, at: int = 0) -> Any:
    """Every tensor of ``obj`` as a TensorRef into ``path``; ``at``: where the torch.save data starts in it."""
    import torch

    if isinstance(obj, torch.Tensor):
        return _ref_of(path, obj, at)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = _to_refs(path, v, at)
        return out
    if isinstance(obj, list):
        return [_to_refs(path, v, at) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_to_refs(path, v, at) for v in obj)
    return obj


def load_lazy(path: str, trust_pickles: bool = False, torch_free: bool = False) -> Any:
    """Unpickle ``path``; every tensor becomes a :class:`TensorRef`.

    With ``trust_pickles`` the file may run arbitrary code on load: only for
    files you made yourself. ``torch_free``: try the torch-free reader first
    (dtypes are then StoredDTypes; ``CKPTSHARD_TORCH_READER=1`` turns it off).
    """
    input_file(path)
    from .pickle_reader import (  # imports us
        Unsupported,
        check_depth,
        check_zip_records,
        read_torch_file,
        read_torch_legacy,
        torch_free_allowed,
    )

    if torch_free and not trust_pickles and torch_free_allowed():
        try:
            return read_torch_file(path)
        except Unsupported:
            pass
    if not zipfile.is_zipfile(path):
        try:  # the legacy format: torch can only load it whole, the torch-free reader lazily
            if trust_pickles:
                warnings.warn(f"{path}: loading with full unpickling (--trust-pickles): it can run code")
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
    return _to_refs(path, obj)


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
            warnings.warn(f"{where}: loading with full unpickling (--trust-pickles): it can run code")
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
    lines = [l.strip() for l in msg.splitlines() if l.strip()]
    for l in lines:
        if "WeightsUnpickler error:" in l:
            rest = l.split("WeightsUnpickler error:", 1)[1].strip()
            if rest:
                return rest
    skip = ("Weights only load failed", "Check the documentation", "WeightsUnpickler error:", "Please file an issue")
    useful = [l for l in lines if not l.startswith(skip)]
    return useful[0][:200] if useful else "unreadable"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""

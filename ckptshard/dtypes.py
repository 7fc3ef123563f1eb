"""Element types known by name, and torch.Size, so that planning and copying need no torch.

A dtype here is either a ``torch.dtype`` or a :class:`StoredDType`, the
stand-in the torch-free reader (``formats/torch_pickle.py``) gives: both have
``is_floating_point``; :func:`dtype_name` names either and :func:`itemsize`
sizes either.
One run never mixes the two; :func:`to_torch` converts where torch is needed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
SAFETENSORS_CODE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
# torch.save's typed-storage class names (what its pickles name) -> dtype name.
STORAGE_CLASSES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_STRUCT = {
    "float64": "<d",
    "float32": "<f",
    "float16": "<e",
    "int64": "<q",
    "int32": "<i",
    "int16": "<h",
    "int8": "<b",
    "uint8": "<B",
    "bool": "<?",
}


@dataclass(frozen=True)
class StoredDType:
    """A dtype read from a checkpoint without torch; prints as torch's does (``torch.float32``)."""

    name: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.name]

    @property
    def is_floating_point(self) -> bool:
        return self.name in FLOATING

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    __str__ = __repr__


def dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32`` and for ``StoredDType("float32")``."""
    return dtype.name if isinstance(dtype, StoredDType) else str(dtype).rsplit(".", 1)[-1]


def itemsize_of(dtype: Any) -> int:
    """Bytes per element of either kind of dtype (``torch.dtype.itemsize`` is newer than torch 2.0)."""
    return ITEMSIZE.get(dtype_name(dtype)) or dtype.itemsize


def to_torch(dtype: Any) -> Any:
    """The ``torch.dtype`` of either kind (imports torch)."""
    if not isinstance(dtype, StoredDType):
        return dtype
    import torch

    return getattr(torch, dtype.name)


def unpack_scalar(dtype: Any, raw: bytes) -> Any:
    """One little-endian element as a Python number, or None where struct has no format for it."""
    name = dtype_name(dtype)
    if name == "bfloat16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    fmt = _STRUCT.get(name)
    return struct.unpack(fmt, raw)[0] if fmt else None


class Size(tuple):
    """``torch.Size`` without torch: a tuple that prints as torch's does and is saved as one."""

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"

    def __reduce__(self) -> Any:
        # Any other pickler (torch.save, pickle) writes a torch.Size; formats/torch_save.py
        # writes the same global without importing torch.
        import torch

        return (torch.Size, (tuple(self),))

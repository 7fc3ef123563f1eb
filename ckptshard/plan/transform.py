"""Select, rename and cast the tensors of a planned full state dict. Pure."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from ..dtypes import dtype_name
from ..errors import CheckpointError
from ..tensors import Fill

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --dtype -> torch's name


def cast_dtype(flag: Optional[str]) -> Any:
    """The torch.dtype a ``--dtype`` flag names (None: no cast); imports torch only when casting."""
    if not flag:
        return None
    if flag not in DTYPES:
        raise CheckpointError(f"--dtype {flag!r}: choose one of {', '.join(DTYPES)}")
    import torch

    return getattr(torch, DTYPES[flag])


def parse_renames(specs: Sequence[str]) -> Tuple[Tuple[str, str], ...]:
    out = []
    for s in specs:
        if "=" not in s:
            raise CheckpointError(f"--rename {s!r}: expected FROM=TO")
        a, b = s.split("=", 1)
        if not a:
            raise CheckpointError(f"--rename {s!r}: FROM is empty")
        out.append((a, b))
    return tuple(out)


def name_mapper(
    select: Sequence[str] = (), strip_prefix: Sequence[str] = (), rename: Sequence[Tuple[str, str]] = ()
) -> Callable[[str], Optional[str]]:
    """``name -> new name``, or None where ``select`` drops it: the naming rules of :func:`transform`."""

    def new_name(name: str) -> Optional[str]:
        if select and not any(name.startswith(p) for p in select):
            return None
        new = name
        for p in strip_prefix:
            if new.startswith(p):
                new = new[len(p) :]
                break
        for a, b in rename:
            new = new.replace(a, b)
        if not new:
            raise CheckpointError(f"{name}: renamed to an empty name")
        return new

    return new_name


def transform(
    tensors: Mapping[str, Fill],
    select: Sequence[str] = (),
    strip_prefix: Sequence[str] = (),
    rename: Sequence[Tuple[str, str]] = (),
    dtype: Any = None,
) -> Dict[str, Fill]:
    """Keep names starting with a ``select`` prefix, strip prefixes, replace
    ``FROM`` by ``TO`` in order, and cast floating-point tensors to ``dtype``
    (integers such as ``num_batches_tracked`` are kept). Tied tensors stay one
    Fill. Name collisions are refused.
    """
    cast: Dict[int, Fill] = {}
    out: Dict[str, Fill] = {}
    origin: Dict[str, str] = {}
    new_name = name_mapper(select, strip_prefix, rename)
    for name, fill in tensors.items():
        new = new_name(name)
        if new is None:
            continue
        if new in out:
            raise CheckpointError(f"{origin[new]} and {name} would both be named {new!r}")
        if dtype is not None and fill.dtype.is_floating_point and dtype_name(fill.dtype) != dtype_name(dtype):
            if id(fill) not in cast:
                cast[id(fill)] = Fill(fill.shape, dtype, fill.sources)
            fill = cast[id(fill)]
        out[new] = fill
        origin[new] = name
    if select and not out:
        raise CheckpointError(f"--select {list(select)} matches no tensor")
    return out

"""Read stored tensors' bytes into memory (torch tensors or Python numbers).

Conversions stream files to files (``ckptshard.write.copier``); these are
for what needs the values: 0-dim values such as an optimizer's ``step``, and
loading a checkpoint into a live model.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from ..dtypes import itemsize_of, to_torch, unpack_scalar
from ..errors import CheckpointError
from ..tensors import Fill, TensorRef
from ..tree import map_leaves

if TYPE_CHECKING:
    import torch

DIGEST_CHUNK = 8 << 20  # bytes read at a time when a tensor is only hashed


def read_elements(path: str, offset: int, dtype: Any, count: int) -> torch.Tensor:
    """``count`` elements of ``dtype`` from byte ``offset`` of ``path``, in fresh memory."""
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


def read_flat(ref: TensorRef, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened tensor."""
    if not ref.contiguous:
        return read_tensor(ref).reshape(-1)[start:stop].clone()
    return read_elements(ref.path, ref.offset + start * ref.itemsize, ref.dtype, stop - start)


def read_tensor(ref: TensorRef) -> torch.Tensor:
    """The whole tensor, in fresh memory."""
    if ref.contiguous:
        return read_flat(ref, 0, ref.numel).reshape(ref.shape)
    span = 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride) if s > 0)
    flat = read_elements(ref.path, ref.offset, ref.dtype, span)
    return flat.as_strided(ref.shape, ref.stride).clone()


def read_scalars(refs: Sequence[TensorRef]) -> List[Any]:
    """The values of one-element tensors as Python numbers, each file opened once; read without
    torch where struct knows the dtype."""
    fds: Dict[str, int] = {}
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
            out.append(read_tensor(ref).item() if value is None else value)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def read_scalar(ref: TensorRef) -> Any:
    """A one-element tensor's value as a Python number."""
    return read_scalars([ref])[0]


def fill_digest(fill: Fill, limit: Optional[int] = None) -> Optional[str]:
    """A SHA-256 of the Fill's bytes as stored (of its first ``limit`` bytes), read in chunks without torch;
    None where that needs torch (a cast, a strided source, a gap)."""
    size = itemsize_of(fill.dtype)
    want = fill.nbytes if limit is None else min(limit, fill.nbytes)
    digest, at = hashlib.sha256(), 0
    for s in sorted((s for s in fill.sources if s.length), key=lambda s: s.dst_start):
        if at >= want:
            break
        if s.dst_start * size != at or not s.ref.contiguous or str(s.ref.dtype) != str(fill.dtype):
            return None
        start, end = s.ref.offset + s.src_start * size, s.ref.offset + (s.src_start + s.length) * size
        end = min(end, start + want - at)
        with open(s.ref.path, "rb") as f:
            f.seek(start)
            while start < end:
                got = f.read(min(DIGEST_CHUNK, end - start))
                if not got:
                    raise CheckpointError(f"{s.ref.path}: truncated: tensor data ends early at byte {start}")
                digest.update(got)
                start += len(got)
                at += len(got)
    return digest.hexdigest() if at == want else None


def repeated_values(fills: Sequence[Tuple[str, Fill]], probe: int = 4096) -> Dict[str, str]:
    """Each name whose tensor repeats an earlier one's (same shape, dtype and bytes), mapped to the first
    name holding those values. Only tensors whose shape and dtype another shares are read, and of those
    whole only where their first ``probe`` bytes agree: one digest in memory per tensor, not its bytes."""
    shapes: Dict[Tuple[Any, ...], int] = {}
    for _, f in fills:
        key = (tuple(f.shape), str(f.dtype))
        shapes[key] = shapes.get(key, 0) + 1
    heads: Dict[Tuple[Any, ...], int] = {}
    keyed: List[Tuple[str, Fill, Tuple[Any, ...]]] = []
    for name, f in fills:
        key = (tuple(f.shape), str(f.dtype))
        if shapes[key] > 1:
            head = (*key, fill_digest(f, probe))
            if head[2] is not None:
                heads[head] = heads.get(head, 0) + 1
                keyed.append((name, f, head))
    first: Dict[Tuple[Any, ...], str] = {}
    out: Dict[str, str] = {}
    for name, f, head in keyed:
        if heads[head] < 2:
            continue
        full = (*head, fill_digest(f))
        if full[3] is None:
            continue
        if full in first:
            out[name] = first[full]
        else:
            first[full] = name
    return out


def read_fill(fill: Fill) -> torch.Tensor:
    """The Fill as an in-memory tensor (for loading into a live model)."""
    import torch

    dtype = to_torch(fill.dtype)
    out = torch.zeros(fill.numel, dtype=dtype)
    for s in fill.sources:
        if s.length:
            out[s.dst_start : s.dst_start + s.length] = read_flat(s.ref, s.src_start, s.src_start + s.length).to(dtype)
    return out.view(fill.shape)


def materialize(tree: object) -> object:
    """Every Fill of a tree read into memory; a Fill used twice becomes one tensor (ties)."""
    memo: Dict[int, Any] = {}

    def one(leaf: object) -> object:
        if isinstance(leaf, Fill):
            if id(leaf) not in memo:
                memo[id(leaf)] = read_fill(leaf)
            return memo[id(leaf)]
        if isinstance(leaf, TensorRef):
            return read_tensor(leaf)
        return leaf

    return map_leaves(tree, one)

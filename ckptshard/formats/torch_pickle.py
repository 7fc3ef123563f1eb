"""torch.save's pickles, read without importing torch: the restricted unpickler and its checks.

Importing torch costs seconds, more than copying a 2 GiB checkpoint;
``consolidate -> safetensors`` needs torch for nothing else. The unpickler
here takes an allow-list smaller than torch's ``weights_only`` one and
turns every tensor into a :class:`~ckptshard.tensors.TensorRef` whose dtype is a
:class:`~ckptshard.dtypes.StoredDType`. Anything outside the list (numpy
values, tensor subclasses, big-endian files...) raises :class:`Unsupported`,
and the caller falls back to ``torch.load``: this is a fast path, never a
second opinion on what a file means. What neither reader should accept
(duplicate or compressed zip records, absurd nesting) is a
:class:`~ckptshard.errors.CheckpointError` here, for both.

Both of torch.save's formats are read: the zip (torch >= 1.6) and the
legacy stream (``_use_new_zipfile_serialization=False``: magic number,
protocol and system-info pickles, the object's pickle, the sorted storage
keys, then each storage as an 8-byte element count and its bytes). For the
legacy one the storages' offsets follow from the counts, so it is read as
lazily as a zip; torch itself can only load it whole (no ``mmap``).
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
import struct
import zipfile
from typing import Any, BinaryIO, Callable, Dict, Optional, Tuple

from ..dtypes import ITEMSIZE, STORAGE_CLASSES, Size, StoredDType
from ..errors import CheckpointError
from ..layout.boxes import strides
from ..tensors import DTensorRef, TensorRef, numel
from ..tree import map_leaves
from .torch_distributed import (
    DTENSOR_NAMES,
    SHARDED_TENSOR_NAMES,
    DTensorPiece,
    DTensorType,
    PickledDTensor,
    Record,
    TemplateTensor,
    WrapperShell,
    finish_dtensor,
    finish_sharded_tensor,
    is_distributed_class,
    rebuild_wrapper_subclass,
    record_class,
    record_getattr,
)
from .torch_names import NO_STATE, Call, Global, NewObj
from .zip_records import data_start


class Unsupported(Exception):
    """The file uses something this reader does not handle: use torch.load."""


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = StoredDType(dtype)


class _TensorType:
    """``torch.Tensor`` / ``torch.nn.Parameter`` named as a rebuild target."""


class _BareDType:
    """A ``torch.<dtype>`` global: a DTensor's dtype is taken; one anywhere else in the tree is refused."""

    def __init__(self, name: str) -> None:
        self.dtype = StoredDType(name)


class _Storage:
    def __init__(self, dtype: StoredDType, offset: int, nbytes: int) -> None:
        self.dtype, self.offset, self.nbytes = dtype, offset, nbytes


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, shape: Tuple[int, ...], stride: Tuple[int, ...]) -> None:
        self.storage, self.offset, self.shape, self.stride = storage, offset, shape, stride


def _rebuild_tensor_v2(
    storage: _Storage,
    storage_offset: int,
    size: Tuple[int, ...],
    stride: Tuple[int, ...],
    requires_grad: bool,
    backward_hooks: Any,
    metadata: Any = None,
) -> _Tensor:
    if metadata or not isinstance(storage, _Storage):
        raise Unsupported("tensor with metadata, or not over a typed storage")
    return _Tensor(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: Any, requires_grad: bool, backward_hooks: Any, state: Any = None) -> Any:
    if state:
        raise Unsupported("parameter with state")
    return data


class _ShardedTensorType:
    """FSDP1's ``ShardedTensor`` named as a rebuild target (``module.name``: as the file names it)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


def _no_rows(dtype: StoredDType, shape: Tuple[int, ...]) -> _Tensor:
    rows = (0, *shape[1:])
    return _Tensor(_Storage(dtype, 0, 0), 0, rows, strides(rows))


def _getattr(owner: Any, name: str) -> Any:
    if isinstance(owner, _ShardedTensorType):
        owner = record_class(owner.module, owner.name)
    found = record_getattr(owner, name)
    if found is None:
        raise Unsupported(f"getattr of {owner!r:.40}")
    return found


def _plain_attributes(state: Any) -> bool:
    """A tensor's ``__dict__`` of flags only, which the data does not depend on: fairscale's
    ``state_dict()`` marks its tensors ``_has_been_cloned``, and torch before 2.6 saves that along."""
    return isinstance(state, dict) and all(
        isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))) for k, v in state.items()
    )


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: Tuple[Any, ...], state: Any) -> Any:
    if isinstance(new_type, (DTensorType, _ShardedTensorType)):
        shell = func(*args)
        finish = finish_dtensor if isinstance(new_type, DTensorType) else finish_sharded_tensor
        piece = finish(shell, state) if isinstance(shell, WrapperShell) else None
        if piece is not None and piece.local is None and isinstance(shell.dtype, _BareDType):
            piece.local = _no_rows(shell.dtype.dtype, shell.shape)  # FSDP1 gives a rank past the rows no shard
        if piece is None or not isinstance(piece.local, _Tensor) or not isinstance(piece.dtype, _BareDType):
            raise Unsupported("a DTensor of another shape than FSDP2 saves")
        piece.dtype = piece.dtype.dtype
        if piece.local.storage.dtype != piece.dtype:  # written as the wrapper says, read as the bytes are
            raise Unsupported(f"a DTensor that says {piece.dtype} over a local tensor of {piece.local.storage.dtype}")
        return piece
    if not isinstance(new_type, _TensorType) or (state and not _plain_attributes(state)):
        raise Unsupported("tensor subclass")
    return func(*args)


def _encode(text: str, encoding: str = "utf-8") -> bytes:
    return codecs.encode(text, encoding)  # protocol-2 pickles spell bytes this way


_ALLOWED: Dict[Tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("_codecs", "encode"): _encode,
    ("torch", "Size"): Size,
    ("torch", "Tensor"): _TensorType(),
    ("torch.nn.parameter", "Parameter"): _TensorType(),
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_wrapper_subclass"): rebuild_wrapper_subclass,
    # A DTensor's device and layout; anywhere else they are refused (inert records, see to_refs).
    ("torch", "device"): record_class("torch", "device"),
    ("torch.serialization", "_get_layout"): record_class("torch.serialization", "_get_layout"),
}
_STORAGE_TYPES = {name: _StorageType(dtype) for name, dtype in STORAGE_CLASSES.items()}


class _Unpickler(pickle.Unpickler):
    def __init__(
        self,
        f: Any,
        storage: Callable[[str, StoredDType], _Storage],
        legacy: bool = False,
        trusted: bool = False,
        inert: bool = False,
    ) -> None:
        super().__init__(f)
        self._storage = storage
        self._legacy = legacy
        self._trusted = trusted
        self._inert = inert

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and (module, name) == ("argparse", "Namespace"):  # fairseq's args: imported when met
            import argparse

            found = argparse.Namespace
        if found is None and module == "torch":
            found = _STORAGE_TYPES.get(name) or (_BareDType(name) if name in ITEMSIZE else None)
        if found is None and (module, name) in DTENSOR_NAMES:
            found = DTensorType(module, name)
        if found is None and (module, name) in SHARDED_TENSOR_NAMES:
            found = _ShardedTensorType(module, name)
        if found is None and (module, name) in (("__builtin__", "getattr"), ("builtins", "getattr")):
            found = _getattr  # only of a torch.distributed record: ShardedTensor's nested classes
        if found is None and is_distributed_class(module, name):  # a DTensor's spec and mesh: inert records
            found = record_class(module, name)
        if found is None and self._trusted:  # --trust-pickles: any global, as torch.load(weights_only=False)
            return super().find_class(module, name)
        if found is None and self._inert:  # kept as its arguments, never imported nor called (unpickle_zip)
            return record_class(module, name)
        if found is None:
            raise Unsupported(f"global {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        # zip: ("storage", type, key, location, numel); legacy adds view metadata (None unless a view)
        size = 6 if self._legacy else 5
        if not (
            isinstance(pid, tuple)
            and len(pid) == size
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and (not self._legacy or pid[5] is None)
        ):
            raise Unsupported(f"persistent id {pid!r:.80}")
        storage = self._storage(str(pid[2]), pid[1].dtype)
        if self._legacy:
            storage.nbytes = int(pid[4]) * pid[1].dtype.itemsize
        return storage


def _as_written(x: Any, memo: Dict[int, Any]) -> Any:
    """A DTensor's pickled objects as ``torch_names`` write them (:class:`PickledDTensor`); ``memo``: what one
    file's pickle shares (its mesh) stays shared."""
    if id(x) in memo:
        return memo[id(x)]
    if isinstance(x, Record):
        cls = type(x)
        if x.kwargs:
            raise Unsupported("a record made with keywords")
        args = tuple(_as_written(a, memo) for a in x.args)
        state = NO_STATE if x.pickled_state is None else _as_written(x.pickled_state, memo)
        out: Any = (Call if x.called else NewObj)(_class_written(cls), args, state)
    elif isinstance(x, _BareDType):
        out = Global.of("torch", x.dtype.name)
    elif isinstance(x, (DTensorType, _ShardedTensorType)):
        out = Global.of(x.module, x.name)
    elif isinstance(x, _Tensor):
        size = numel(x.shape) * x.storage.dtype.itemsize
        whole = x.offset == 0 and x.stride == strides(x.shape) and x.storage.nbytes == size
        out = TemplateTensor(x.shape, x.storage.dtype, whole)
    elif isinstance(x, Size):
        out = x
    elif isinstance(x, dict):
        out = type(x)((k, _as_written(v, memo)) for k, v in x.items())
    elif isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        out = type(x)(_as_written(v, memo) for v in x)
    elif x is None or isinstance(x, (bool, int, float, str)):
        out = x
    else:
        raise Unsupported(f"a {type(x).__name__} in a DTensor's pickle")
    memo[id(x)] = out
    return out


def _class_written(cls: Any) -> Any:
    """A record class as its pickle names it: a global, or ``getattr(<global>, name)`` for a nested class
    (ShardedTensor's ProcessGroupState; protocol 2 names getattr ``__builtin__``'s)."""
    if cls.owner is None:
        return Global.of(cls.module, cls.name)
    return Call(Global.of("__builtin__", "getattr"), (Global.of(cls.owner.module, cls.owner.name), cls.name))


def _pickled(piece: DTensorPiece, memo: Dict[int, Any]) -> Optional[PickledDTensor]:
    """The piece's own pickle, to write others by; None where it holds what cannot be written again."""
    if piece.pickled_state is None:
        return None
    try:
        return PickledDTensor(_as_written(piece.shell.args, memo), _as_written(piece.pickled_state, memo))
    except Unsupported:
        return None


def to_refs(path: str, obj: Any) -> Any:
    memo: Dict[int, Any] = {}

    def leaf(x: Any) -> Any:
        if isinstance(x, DTensorPiece):
            return DTensorRef(
                leaf(x.local),
                x.shape,
                x.dtype,
                x.placements,
                x.coordinate,
                x.sharded_tensor,
                x.requires_grad,
                _pickled(x, memo),
            )
        if isinstance(x, Record):
            raise Unsupported(f"a {x.qualname} outside a DTensor")
        if isinstance(x, _BareDType):
            raise Unsupported(f"a bare dtype ({x.dtype})")
        if isinstance(x, _Tensor):
            ref = TensorRef(
                path, x.storage.offset + x.offset * x.storage.dtype.itemsize, x.storage.dtype, x.shape, x.stride
            )
            span = (x.offset + 1 + sum((s - 1) * st for s, st in zip(x.shape, x.stride))) * x.storage.dtype.itemsize
            if ref.numel and span > x.storage.nbytes:
                raise Unsupported("tensor larger than its storage")
            return ref
        if isinstance(x, (_Storage, _StorageType, _TensorType)):
            raise Unsupported("a bare storage or type in the tree")
        return x

    return map_leaves(obj, leaf)


MAX_DEPTH = 100  # containers nested deeper are refused: no real checkpoint comes near, and writing them back
#                 would exhaust the pickler's recursion


def check_zip_records(zf: zipfile.ZipFile, where: str) -> None:
    """Refuse what torch.save never writes and readers resolve differently: two records of one name
    (this reader and torch's would each pick one) and compressed records (inflated whole: a zip bomb)."""
    names = zf.namelist()
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise CheckpointError(f"{where}: the zip holds two records named {dup!r}: damaged or crafted, not read")
    packed = next((i.filename for i in zf.infolist() if i.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise CheckpointError(
            f"{where}: zip record {packed!r} is compressed, which torch.save never does: "
            "unzip and re-save the checkpoint with torch.save"
        )


MAX_NODES = 10_000_000  # containers and leaves, counting a shared one at each place it appears


def check_depth(obj: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Refuse an object whose dicts, lists and tuples nest deeper than ``limit``, or that expands to more
    than MAX_NODES objects (a pickle can share one list many times over); walked without recursion."""
    stack = [(obj, 1)]
    visits = 0
    while stack:
        x, depth = stack.pop()
        visits += 1
        if visits > MAX_NODES:
            raise CheckpointError(f"{where}: expands to more than {MAX_NODES:,} objects; not read")
        if isinstance(x, dict):
            children = x.values()
        elif isinstance(x, (list, tuple)):
            children = x
        else:
            continue
        if depth > limit:
            raise CheckpointError(f"{where}: containers nested more than {limit} levels deep; not read")
        stack.extend((c, depth + 1) for c in children)


def unpickle_zip(zf: zipfile.ZipFile, raw: Any, base: int, trusted: bool = False, inert: bool = False) -> Any:
    """The object of an open torch.save zip; storages' offsets are ``base`` + their place in ``raw``.

    ``trusted`` (--trust-pickles): any other global is imported, as torch.load would; it can run code.
    ``inert``: any other global becomes an inert :class:`Record` (its arguments and state; nothing is imported
    or called), so one entry of a file can be taken while the rest (numpy RNG states, say) never runs; whoever
    takes the entry refuses a Record left in it (:func:`to_refs` does).
    """
    pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise Unsupported("not one data.pkl")
    prefix = pkls[0][: -len("data.pkl")]
    names = set(zf.namelist())
    if prefix + "byteorder" in names and zf.read(prefix + "byteorder").strip() != b"little":
        raise Unsupported("big-endian data")
    data = zf.read(pkls[0])
    seen: Dict[str, _Storage] = {}

    def storage(key: str, dtype: StoredDType) -> _Storage:
        if key not in seen:
            info = zf.getinfo(f"{prefix}data/{key}")
            if info.compress_type != zipfile.ZIP_STORED:
                raise Unsupported("compressed tensor data")
            if info.compress_size != info.file_size:  # stored: one size twice; torch's reader refuses a mismatch
                raise Unsupported(f"{info.filename}: sizes disagree in the central directory")
            start, _ = data_start(raw, info)
            seen[key] = _Storage(dtype, base + start, info.file_size)
        if seen[key].dtype != dtype:
            raise Unsupported("one storage read as two dtypes")
        return seen[key]

    return _Unpickler(io.BytesIO(data), storage, trusted=trusted, inert=inert).load()


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def unpickle_legacy(f: BinaryIO, end: int, trusted: bool = False, inert: bool = False) -> Any:
    """The object of a legacy (non-zip) torch.save stream ``f`` of ``end`` bytes; storages' offsets in ``f``.

    ``trusted``, ``inert``: as for :func:`unpickle_zip`.
    """

    def plain() -> Any:  # the small pickles around the object: no globals, no storages
        return _Unpickler(f, _no_storage, legacy=True).load()

    if plain() != _LEGACY_MAGIC or plain() != _LEGACY_PROTOCOL:
        raise Unsupported("not a torch.save file")
    info = plain()
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise Unsupported("big-endian data")
    seen: Dict[str, _Storage] = {}

    def storage(key: str, dtype: StoredDType) -> _Storage:
        if key not in seen:
            seen[key] = _Storage(dtype, -1, 0)
        if seen[key].dtype != dtype:
            raise Unsupported("one storage read as two dtypes")
        return seen[key]

    obj = _Unpickler(f, storage, legacy=True, trusted=trusted, inert=inert).load()
    keys = plain()
    if not isinstance(keys, list) or set(keys) != set(seen):
        raise Unsupported("storage keys do not match the pickle")
    pos = f.tell()
    for key in keys:  # each: int64 element count, then the bytes
        st = seen[key]
        f.seek(pos)
        head = f.read(8)
        if len(head) != 8 or struct.unpack("<q", head)[0] * st.dtype.itemsize != st.nbytes:
            raise Unsupported(f"storage {key}: size does not match the pickle")
        st.offset = pos + 8
        pos = st.offset + st.nbytes
    if pos > end:
        raise Unsupported("truncated")
    return obj


def _no_storage(key: str, dtype: StoredDType) -> _Storage:
    raise Unsupported("a storage outside the object's pickle")

"""Lay out a ``torch.save`` file without importing torch.

The counterpart of ``torch_pickle.py`` for the writers: reshard and
consolidate to ``.pt`` need torch only to lay out the file, and importing it
costs seconds. This lays out the same zip that ``torch.save`` writes
(records ``data.pkl``, ``.format_version``, ``.storage_alignment``,
``byteorder``, ``data/<key>``, ``version``, ``.data/serialization_id``;
data aligned to 64 bytes; sizes and CRC in data descriptors) and a
protocol-2 pickle made by Python's own pickler, with torch's names
(``torch._utils._rebuild_tensor_v2``, typed storages, ``torch.Size``)
written as globals. Tensor data is left as holes for the caller to fill,
and their CRCs for the hash pass or ``osio/zip_crc.py`` to set. No I/O here.

Only what the torch-free reader produces is written (dicts, lists, tuples,
strings, numbers, ``argparse.Namespace``, ``Size`` and Fills, of either
kind of dtype); anything else raises :class:`Unsupported` and the caller
uses torch.save. Past 4 GiB the file is zip64, as torch.save writes it:
8-byte sizes and offsets in extra fields, data descriptors and end records.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import io
import pickle
import struct
import types
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..dtypes import STORAGE_CLASSES, Size, dtype_name
from ..layout.boxes import strides
from ..tensors import DTensorFill, Fill
from . import torch_names
from .torch_names import NO_STATE, Call, Global, Literal, NewObj, RequiresGrad
from .torch_pickle import Unsupported
from .zip_records import LOCAL_HEADER, LOCAL_SIG

PREFIX = "archive"  # what torch.save names the folder when given a file object
ALIGN = 64
_ZIP32_LIMIT = 0xFFFFFFFF - (1 << 20)
FORCE_ZIP64 = False  # tests: the zip64 layout for small files too
_CLASS_OF_DTYPE = {dtype: name for name, dtype in STORAGE_CLASSES.items()}
_FLAGS = 0x0808  # sizes and CRC in a data descriptor; UTF-8 names (as torch's writer)


class _Storage:
    def __init__(self, key: str, fill: Fill | Literal) -> None:
        self.key, self.fill = key, fill


def _is_size(obj: Any) -> bool:
    # Size pickles as torch.Size elsewhere, so a tree sent to a --jobs worker holds torch.Size.
    return isinstance(obj, Size) or (type(obj).__name__ == "Size" and type(obj).__module__ == "torch")


def _check_plain(obj: Any) -> None:
    if type(obj) not in _PLAIN and not isinstance(obj, (_Storage, type, types.BuiltinFunctionType)):
        raise Unsupported(f"cannot write a {type(obj).__name__} without torch")


def _new_storage(storages: List[_Storage], fill: Fill | Literal, requires_grad: bool = False) -> tuple:
    """The arguments of ``fill``'s ``_rebuild_tensor_v2``, over a new storage (the next key) appended to
    ``storages``."""
    if dtype_name(fill.dtype) not in _CLASS_OF_DTYPE:
        raise Unsupported(f"dtype {fill.dtype}")
    storage = _Storage(str(len(storages)), fill)
    storages.append(storage)
    return (storage, 0, tuple(fill.shape), strides(fill.shape), requires_grad, collections.OrderedDict())


DTensorWriter = Callable[[Any], Call]  # a DTensorFill as the call torch.save writes for its DTensor


class _Pickler(pickle._Pickler):  # the Python pickler: its save() can be extended per object
    def __init__(self, f: Any, dtensors: Optional[DTensorWriter] = None) -> None:
        super().__init__(f, protocol=2)
        self.storages: List[_Storage] = []  # in key order; they keep the Fills alive while memo ids are in use
        self.dtensors = dtensors
        self.made: List[Any] = []  # objects made while pickling, kept alive while their ids are in the memo

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            cls = Global.of("torch", _CLASS_OF_DTYPE[dtype_name(obj.fill.dtype)])
            return ("storage", cls, obj.key, "cpu", obj.fill.numel)
        return None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, Global):
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
            self.memoize(obj)
            return
        if _is_size(obj):
            self.save_reduce(Global.of("torch", "Size"), (tuple(obj),), obj=obj)
            return
        if isinstance(obj, (Fill, Literal)):
            self._save_tensor(obj)
            return
        if isinstance(obj, RequiresGrad):
            self._save_tensor(obj.fill, requires_grad=True)
            return
        if isinstance(obj, (NewObj, Call)):
            self._save_object(obj)
            return
        if isinstance(obj, DTensorFill):
            self._save_dtensor(obj)
            return
        _check_plain(obj)
        super().save(obj, save_persistent_id)

    def _save_object(self, obj: NewObj | Call) -> None:
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        if isinstance(obj, Call):
            self.save_reduce(obj.func, tuple(obj.args), obj=obj)
        else:
            self.save(obj.cls)
            self.save(tuple(obj.args))
            self.write(pickle.NEWOBJ)
            self.memoize(obj)
        if obj.state is not NO_STATE:
            self.save(obj.state)
            self.write(pickle.BUILD)

    def _save_dtensor(self, fill: DTensorFill) -> None:
        memo = self.memo.get(id(fill))
        if memo is not None:  # a tie: one DTensor under two names
            self.write(self.get(memo[0]))
            return
        if self.dtensors is None:
            raise Unsupported("a DTensor, with no source DTensor to follow")
        call = self.dtensors(fill)
        self.made.append(call)
        self.save_reduce(call.func, tuple(call.args), obj=fill)

    def _save_tensor(self, fill: Fill | Literal, requires_grad: bool = False) -> None:
        memo = self.memo.get(id(fill))
        if memo is not None:  # a tie: the same tensor again, as torch.save writes it
            self.write(self.get(memo[0]))
            return
        args = _new_storage(self.storages, fill, requires_grad)
        self.save_reduce(Global.of("torch._utils", "_rebuild_tensor_v2"), args, obj=fill)


_PLAIN = {
    dict,
    collections.OrderedDict,
    list,
    tuple,
    str,
    bytes,
    int,
    float,
    bool,
    type(None),
    set,
    frozenset,
    argparse.Namespace,
}


class _FastPickler(pickle.Pickler):
    """The same pickle from Python's C pickler, many times faster: torch's names go out as :mod:`.torch_names`
    stand-ins, renamed by :func:`_pickle`. A reshard to many ranks of a model of many FSDP instances
    lays out thousands of tensors per file."""

    def __init__(self, f: Any) -> None:
        super().__init__(f, protocol=2)
        self.storages: List[_Storage] = []
        self.used: Set[str] = set()  # stand-in names written

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _Storage:
            name = _CLASS_OF_DTYPE[dtype_name(obj.fill.dtype)]
            self.used.add(name)
            return ("storage", torch_names.STORAGE[name], obj.key, "cpu", obj.fill.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Fill):
            self.used.add("_rebuild_tensor_v2")
            return (torch_names.REBUILD_TENSOR, _new_storage(self.storages, obj))
        if _is_size(obj):
            self.used.add("Size")
            return (torch_names.SIZE, (tuple(obj),))
        _check_plain(obj)
        return NotImplemented  # pickled as usual (a tie to an earlier object never gets here: the memo has it)


def _pickle(tree: Any, dtensors: Optional[DTensorWriter] = None) -> Tuple[bytes, List[_Storage]]:
    """torch.save's data.pkl of ``tree``, and its storages in key order. ``dtensors``: how to write its
    DTensorFills (the C pickler is not asked: it cannot write what they become)."""
    if dtensors is not None:
        buf = io.BytesIO()
        slow = _Pickler(buf, dtensors)
        slow.dump(tree)
        return buf.getvalue(), slow.storages
    buf = io.BytesIO()
    fast = _FastPickler(buf)
    fast.dump(tree)
    pkl = buf.getvalue()
    # Each stand-in is written once (then memoized); a string holding one's text would be renamed
    # too, so anything else goes through the Python pickler, which writes torch's names directly.
    module = torch_names.__name__.encode() + b"\n"
    if pkl.count(module) == len(fast.used) and all(pkl.count(torch_names.marker(n)) == 1 for n in fast.used):
        for name in fast.used:
            pkl = pkl.replace(torch_names.marker(name), torch_names.torch_global(name))
        return pkl, fast.storages
    buf = io.BytesIO()
    slow = _Pickler(buf)
    slow.dump(tree)
    return buf.getvalue(), slow.storages


def _padding(start: int) -> bytes:
    """The extra field that puts data on a 64-byte boundary when the field itself begins at ``start``."""
    pad = (-(start + 4)) % ALIGN
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


@dataclass
class Skeleton:
    """A torch.save zip laid out around its tensors' data, which is left to the caller."""

    offsets: Dict[int, int]  # each Fill's data offset, by id
    crcs: List[Tuple[int, int, Tuple[int, int]]]  # per tensor record with data: (start, size, where its CRC goes)
    runs: List[Tuple[int, bytearray]]  # every other byte: (offset, bytes), one run between two tensors' data

    @property
    def end(self) -> int:
        at, data = self.runs[-1]
        return at + len(data)


def write_zip(f: Any, tree: Any, dtensors: Optional[DTensorWriter] = None) -> Skeleton:
    """torch.save's zip of ``tree`` into the seekable ``f``, seeking over (never writing) tensor data."""
    skeleton = lay_out_zip(tree, dtensors)
    for at, data in skeleton.runs:
        f.seek(at)
        f.write(data)
    return skeleton


def lay_out_zip(tree: Any, dtensors: Optional[DTensorWriter] = None) -> Skeleton:
    """torch.save's zip of ``tree``, every byte but the tensors' data; no I/O. ``dtensors`` writes its
    DTensorFills (``dtensor_pickle.DTensorWriter``); without it they are :class:`Unsupported`."""
    pkl, storages = _pickle(tree, dtensors)
    small = [
        ("data.pkl", pkl),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGN).encode()),
        ("byteorder", b"little"),
    ]
    tail = [
        ("version", b"3\n"),
        (".data/serialization_id", str(int(hashlib.sha256(pkl).hexdigest(), 16))[:40].encode()),
    ]
    central: List[bytes] = []
    offsets: Dict[int, int] = {}
    holes: List[Tuple[int, int, int]] = []  # (data start, size, index of its central directory entry)
    records = len(small) + len(storages) + len(tail)
    nbytes = sum(len(d) for _, d in small + tail) + sum(st.fill.nbytes for st in storages)
    # zip64 (as torch.save does past 4 GiB): 8-byte sizes and offsets in extra fields, descriptors and end records.
    zip64 = FORCE_ZIP64 or nbytes + records * (256 + ALIGN) > _ZIP32_LIMIT or records > 0xFFFF
    version = 45 if zip64 else 0
    pos = 0
    runs: List[Tuple[int, bytearray]] = []

    def put(at: int, data: bytes) -> None:
        if runs and runs[-1][0] + len(runs[-1][1]) == at:
            runs[-1][1].extend(data)
        else:
            runs.append((at, bytearray(data)))

    def record(name: str, data: bytes, size: int) -> int:
        nonlocal pos
        raw_name = f"{PREFIX}/{name}".encode()
        z64 = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""  # sizes: 0 here, in the descriptor
        extra = z64 + _padding(pos + LOCAL_HEADER.size + len(raw_name) + len(z64))
        in_header = 0xFFFFFFFF if zip64 else 0
        header = LOCAL_HEADER.pack(
            LOCAL_SIG, version, _FLAGS, 0, 0, 0, 0, in_header, in_header, len(raw_name), len(extra)
        )
        start = pos + len(header) + len(raw_name) + len(extra)
        put(pos, header + raw_name + extra + data)
        crc = zlib.crc32(data) if data else 0
        descriptor = struct.pack("<IQQ" if zip64 else "<III", crc, size, size)
        put(start + size, b"PK\x07\x08" + descriptor)
        if zip64:
            entry = struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                version,
                version,
                _FLAGS,
                0,
                0,
                0,
                crc,
                0xFFFFFFFF,
                0xFFFFFFFF,
                len(raw_name),
                28,
                0,
                0,
                0,
                0,
                0xFFFFFFFF,
            )
            entry += raw_name + struct.pack("<HHQQQ", 1, 24, size, size, pos)
        else:
            entry = (
                struct.pack(
                    "<IHHHHHHIIIHHHHHII",
                    0x02014B50,
                    0,
                    0,
                    _FLAGS,
                    0,
                    0,
                    0,
                    crc,
                    size,
                    size,
                    len(raw_name),
                    0,
                    0,
                    0,
                    0,
                    0,
                    pos,
                )
                + raw_name
            )
        central.append(entry)
        pos = start + size + 4 + len(descriptor)
        return start

    for name, data in small:
        record(name, data, len(data))
    for st in storages:
        if isinstance(st.fill, Literal):  # bytes known now: written with the layout, CRC and all
            record(f"data/{st.key}", st.fill.data, st.fill.nbytes)
            continue
        offsets[id(st.fill)] = record(f"data/{st.key}", b"", st.fill.nbytes)
        if st.fill.nbytes:
            holes.append((offsets[id(st.fill)], st.fill.nbytes, len(central) - 1))
    for name, data in tail:
        record(name, data, len(data))
    cd = b"".join(central)
    if not zip64 and pos + len(cd) > _ZIP32_LIMIT:
        raise AssertionError("zip64 needed but not planned")  # the estimate above is an upper bound
    entry_at = [pos]
    for c in central:
        entry_at.append(entry_at[-1] + len(c))
    n = len(central)
    if zip64:
        end64 = pos + len(cd)
        put(
            pos,
            cd
            + struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, version, version, 0, 0, n, n, len(cd), pos)
            + struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
            + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), 0xFFFFFFFF, 0xFFFFFFFF, 0),
        )
    else:
        put(pos, cd + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(cd), pos, 0))
    # A record's CRC sits after its data: in its data descriptor (4 bytes past the signature) and its central entry.
    return Skeleton(offsets, [(start, size, (start + size + 4, entry_at[i] + 16)) for start, size, i in holes], runs)

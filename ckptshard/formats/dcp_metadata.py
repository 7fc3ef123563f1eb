"""DCP's ``.metadata``, pickled without importing torch.

``FileSystemWriter`` pickles a ``Metadata`` dataclass holding
``TensorStorageMetadata``/``BytesStorageMetadata`` per name and a
``MetadataIndex -> _StorageInfo`` map. Python's pickler writes each such
object as NEWOBJ of its class (a GLOBAL by name) and BUILD of its state:
the dataclass's ``__dict__``, or what its ``__getstate__`` returns
(``TensorProperties``: a tuple; ``_StorageInfo``: the fields not None).
Here the same opcodes are written for stand-ins that name torch's classes,
so the file unpickles, with torch, to objects equal to the ones
``dcp.save`` builds (tests/test_dcp.py compares them).
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..dtypes import Size
from .torch_save import _Global, _Pickler

METADATA = ".metadata"  # the file of a DCP folder that describes it
DCP_VERSION = "1.0.0"  # FileSystemWriter's CURRENT_DCP_VERSION when this was written

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_CONTIGUOUS = 0  # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT

Where = Tuple[str, int, int]  # data file, offset, length
TensorMeta = Tuple[str, Tuple[int, ...], List[Tuple[Tuple[int, ...], Tuple[int, ...], Where]]]  # dtype, shape, chunks


class _Obj:
    """An instance of a torch class: pickled as NEWOBJ ``cls`` then BUILD ``state`` (none if None)."""

    def __init__(self, name: str, state: Any, module: str = _META) -> None:
        self.cls, self.state = _Global.of(module, name), state


class _Call:
    """A value torch pickles as REDUCE: ``func(*args)``."""

    def __init__(self, func: _Global, args: tuple) -> None:
        self.func, self.args = func, args


class _MetaPickler(_Pickler):
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, (_Obj, _Call)):
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
                return
            if isinstance(obj, _Call):
                self.save_reduce(obj.func, obj.args, obj=obj)
                return
            self.save(obj.cls)
            self.write(b")\x81")  # EMPTY_TUPLE, NEWOBJ: cls.__new__(cls)
            self.memoize(obj)
            if obj.state is not None:
                self.save(obj.state)
                self.write(b"b")  # BUILD
            return
        super().save(obj, save_persistent_id)


def _properties(dtype: str) -> _Obj:
    layout = _Call(_Global.of("torch.serialization", "_get_layout"), ("torch.strided",))
    memory_format = _Call(_Global.of(_META, "_MEM_FORMAT_ENCODING"), (_CONTIGUOUS,))
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format encoding, pin_memory)
    return _Obj("TensorProperties", (_Global.of("torch", dtype), layout, False, memory_format, False))


def _index(fqn: str, offset: Optional[Tuple[int, ...]]) -> _Obj:
    # MetadataIndex.__init__ sets fqn and index, then offset only when given.
    state: Dict[str, Any] = {"fqn": fqn, "index": None}
    if offset is not None:
        state["offset"] = Size(offset)
    return _Obj("MetadataIndex", state)


def _storage(where: Where) -> _Obj:
    return _Obj("_StorageInfo", {"relative_path": where[0], "offset": where[1], "length": where[2]}, _FS)


def metadata_pickle(entries: Mapping[str, Any], mapping: Mapping[str, Any], version: str) -> bytes:
    """The bytes of ``.metadata``: ``entries`` maps each flattened name to its
    :data:`TensorMeta`, or to the :data:`Where` of a non-tensor value; ``mapping``
    is the planner's name -> path in the original state dict."""
    properties: Dict[str, _Obj] = {}
    state_dict_metadata: Dict[str, _Obj] = {}
    storage_data: Dict[_Obj, _Obj] = {}
    for name, e in entries.items():
        if len(e) == 3 and isinstance(e[2], list):
            dtype, shape, chunks = e
            if dtype not in properties:
                properties[dtype] = _properties(dtype)
            state_dict_metadata[name] = _Obj(
                "TensorStorageMetadata",
                {
                    "properties": properties[dtype],
                    "size": Size(shape),
                    "chunks": [
                        _Obj("ChunkStorageMetadata", {"offsets": Size(o), "sizes": Size(s)}) for o, s, _ in chunks
                    ],
                },
            )
            for offsets, _, where in chunks:
                storage_data[_index(name, offsets)] = _storage(where)
        else:
            state_dict_metadata[name] = _Obj("BytesStorageMetadata", None)
            storage_data[_index(name, None)] = _storage(e)
    storage_meta = _Obj("StorageMeta", {"checkpoint_id": None, "save_id": None, "load_id": None, "modules": []})
    meta = _Obj(
        "Metadata",
        {
            "state_dict_metadata": state_dict_metadata,
            "planner_data": dict(mapping),
            "storage_data": storage_data,
            "storage_meta": storage_meta,
            "version": version,
        },
    )
    buf = io.BytesIO()
    _MetaPickler(buf).dump(meta)
    return buf.getvalue()

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
from .torch_names import Call, Global, NewObj
from .torch_save import _Pickler

DCP_VERSION = "1.0.0"  # FileSystemWriter's CURRENT_DCP_VERSION when this was written

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_CONTIGUOUS = 0  # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT

Where = Tuple[str, int, int]  # data file, offset, length
TensorMeta = Tuple[str, Tuple[int, ...], List[Tuple[Tuple[int, ...], Tuple[int, ...], Where]]]  # dtype, shape, chunks


def _obj(name: str, state: Any, module: str = _META) -> NewObj:
    """An instance of a torch class: NEWOBJ ``cls`` then BUILD ``state`` (none if None)."""
    return NewObj(Global.of(module, name), (), state)


def _properties(dtype: str) -> NewObj:
    layout = Call(Global.of("torch.serialization", "_get_layout"), ("torch.strided",))
    memory_format = Call(Global.of(_META, "_MEM_FORMAT_ENCODING"), (_CONTIGUOUS,))
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format encoding, pin_memory)
    return _obj("TensorProperties", (Global.of("torch", dtype), layout, False, memory_format, False))


def _index(fqn: str, offset: Optional[Tuple[int, ...]]) -> NewObj:
    # MetadataIndex.__init__ sets fqn and index, then offset only when given.
    state: Dict[str, Any] = {"fqn": fqn, "index": None}
    if offset is not None:
        state["offset"] = Size(offset)
    return _obj("MetadataIndex", state)


def _storage(where: Where) -> NewObj:
    return _obj("_StorageInfo", {"relative_path": where[0], "offset": where[1], "length": where[2]}, _FS)


def metadata_pickle(entries: Mapping[str, Any], mapping: Mapping[str, Any], version: str) -> bytes:
    """The bytes of ``.metadata``: ``entries`` maps each flattened name to its
    :data:`TensorMeta`, or to the :data:`Where` of a non-tensor value; ``mapping``
    is the planner's name -> path in the original state dict."""
    properties: Dict[str, NewObj] = {}
    state_dict_metadata: Dict[str, NewObj] = {}
    storage_data: Dict[NewObj, NewObj] = {}
    for name, e in entries.items():
        if len(e) == 3 and isinstance(e[2], list):
            dtype, shape, chunks = e
            if dtype not in properties:
                properties[dtype] = _properties(dtype)
            state_dict_metadata[name] = _obj(
                "TensorStorageMetadata",
                {
                    "properties": properties[dtype],
                    "size": Size(shape),
                    "chunks": [
                        _obj("ChunkStorageMetadata", {"offsets": Size(o), "sizes": Size(s)}) for o, s, _ in chunks
                    ],
                },
            )
            for offsets, _, where in chunks:
                storage_data[_index(name, offsets)] = _storage(where)
        else:
            state_dict_metadata[name] = _obj("BytesStorageMetadata", None)
            storage_data[_index(name, None)] = _storage(e)
    storage_meta = _obj("StorageMeta", {"checkpoint_id": None, "save_id": None, "load_id": None, "modules": []})
    meta = _obj(
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
    _Pickler(buf).dump(meta)
    return buf.getvalue()

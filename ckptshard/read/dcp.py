"""Read torch.distributed.checkpoint (DCP) folders, streaming, without torch where possible.

Only ``.metadata`` and each chunk's small pickle are read; tensors become
byte runs of the data files, so no chunk is ever loaded whole. ``.metadata``
is unpickled into stand-ins named like DCP's own dataclasses (those names
only: no pickled code runs), and each chunk's torch.save frame by the
torch-free reader. Anything they do not handle (a class not on the list, a
frame the reader refuses) sends the whole folder through torch's classes and
``torch.load`` instead, so one run's dtypes are all of one kind;
``CKPTSHARD_TORCH_READER=1`` forces that. Writing is in :mod:`ckptshard.write.dcp_files`
(no torch there either).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..dtypes import ITEMSIZE, Size, StoredDType, dtype_name
from ..errors import CheckpointError
from ..formats.dcp_names import METADATA
from ..formats.dcp_state import unflatten_state_dict
from ..formats.torch_pickle import Unsupported
from ..layout.boxes import box_runs
from ..osio.inputs import input_file
from ..osio.window import FileWindow
from ..tensors import Fill, Source, TensorRef, as_fill, numel
from .safe_load import meta_tensors_to_refs, safe_torch_load
from .torch_file import read_torch_zip, torch_free_allowed

_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


class _Record:
    """A stand-in for one of DCP's dataclasses: its pickled state as attributes.

    Subclasses carry the class's name, so ``type(x).__name__`` reads the same
    for a stand-in and for torch's own class.
    """

    _TUPLE_STATE: Tuple[str, ...] = ()  # TensorProperties pickles its fields as a tuple

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and self._TUPLE_STATE and len(state) == len(self._TUPLE_STATE):
            self.__dict__.update(zip(self._TUPLE_STATE, state))
        elif isinstance(state, tuple) and len(state) == 2 and all(x is None or isinstance(x, dict) for x in state):
            for part in state:  # (__dict__, __slots__ values)
                self.__dict__.update(part or {})
        else:
            raise Unsupported(f"{type(self).__name__} state {type(state).__name__}")


_RECORDS: Dict[Tuple[str, str], type] = {
    (module, name): type(name, (_Record,), {"_TUPLE_STATE": fields})
    for module, name, fields in (
        (_META, "Metadata", ()),
        (_META, "TensorStorageMetadata", ()),
        (_META, "BytesStorageMetadata", ()),
        (_META, "ChunkStorageMetadata", ()),
        (_META, "MetadataIndex", ()),
        (_META, "StorageMeta", ()),
        (_META, "TensorProperties", ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")),
        (_FS, "_StorageInfo", ()),
        (_FS, "_StoragePrefix", ()),
    )
}
_STAND_IN_FUNCTIONS: Dict[Tuple[str, str], Callable[..., Any]] = {
    (_META, "_MEM_FORMAT_ENCODING"): lambda value: ("memory_format", value),
    ("torch.serialization", "_get_layout"): lambda name: name,
    ("torch", "Size"): Size,
}


# Plain Python classes .metadata may hold (planner data, paths); both unpicklers admit them.
_SAFE_BUILTINS = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _StandInUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _RECORDS.get((module, name)) or _STAND_IN_FUNCTIONS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in ITEMSIZE:
            return StoredDType(name)
        if (module, name) in _SAFE_BUILTINS:
            return super().find_class(module, name)
        raise Unsupported(f"global {module}.{name}")


def _stand_in_metadata(folder: str) -> Any:
    """``.metadata`` as stand-ins; :class:`Unsupported` for anything else (the caller then uses torch)."""
    try:
        with open(os.path.join(folder, METADATA), "rb") as f:
            meta = _StandInUnpickler(f).load()
    except Unsupported:
        raise
    except Exception as e:
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    if type(meta).__name__ != "Metadata" or not isinstance(getattr(meta, "storage_data", None), Mapping):
        raise Unsupported("not a Metadata")
    return meta


def dcp_metadata(folder: str, trust_pickles: bool = False) -> Any:
    """``.metadata`` for reading: stand-ins where possible (no torch), else :func:`read_metadata`'s."""
    if torch_free_allowed():
        try:
            return _stand_in_metadata(folder)
        except Unsupported:
            pass
    return read_metadata(folder, trust_pickles)


# torch's own classes for what the stand-ins stand in for, and what only torch reads.
_METADATA_GLOBALS = (
    set(_RECORDS)
    | set(_STAND_IN_FUNCTIONS)
    | _SAFE_BUILTINS
    | {
        ("torch.distributed.checkpoint.planner", "_Checkpointable"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """``.metadata`` with torch's classes: DCP's own dataclasses only, so no pickled code runs."""

    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where}: refused to unpickle {module}.{name} (safe loading); "
            "pass --trust-pickles only if you trust this checkpoint"
        )


def read_metadata(folder: str, trust_pickles: bool = False) -> Any:
    """``.metadata`` unpickled with torch's own classes (imports torch)."""
    from torch.distributed.checkpoint import metadata as dmd

    where = os.path.join(folder, METADATA)
    try:
        with open(where, "rb") as f:
            meta = pickle.load(f) if trust_pickles else _MetadataUnpickler(f, where).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: not a DCP metadata file: {type(e).__name__}: {e}") from None
    if not isinstance(meta, dmd.Metadata) or not isinstance(meta.storage_data, Mapping):
        raise CheckpointError(f"{where}: not a DCP metadata file written by FileSystemWriter")
    return meta


class DcpCheckpoint:
    """An opened DCP folder: the nested state dict with tensors as Fills over the data files.

    ``torch_free``: read without torch (dtypes are StoredDTypes).
    """

    def __init__(self, folder: str, tree: Dict[str, Any], files: List[str], torch_free: bool = False) -> None:
        self.folder, self.tree, self.files, self.torch_free = folder, tree, files, torch_free


ReadFrame = Callable[[str, int, int, str], Any]  # (data file, offset, length, what) -> object, tensors as TensorRefs


def _frame_torch_free(path: str, offset: int, length: int, where: str) -> Any:
    return read_torch_zip(path, offset, length)


def _frame_with_torch(trust_pickles: bool) -> ReadFrame:
    def read(path: str, offset: int, length: int, where: str) -> Any:
        fd = os.open(path, os.O_RDONLY)
        try:
            obj = safe_torch_load(FileWindow(fd, offset, length), where, trust_pickles)
            return meta_tensors_to_refs(path, obj, offset, length, trust_pickles)
        finally:
            os.close(fd)

    return read


def _index_key(idx: Any) -> Tuple[str, Optional[Tuple[int, ...]]]:
    """A MetadataIndex (torch's or a stand-in) as (name, chunk offsets or None)."""
    offset = getattr(idx, "offset", None)
    return str(idx.fqn), None if offset is None else tuple(int(x) for x in offset)


def _chunk(folder: str, info: Any, read: ReadFrame, where: str, sizes: Dict[str, int]) -> Any:
    """One chunk's frame; ``sizes`` caches each data file's size (one stat per file, not per chunk)."""
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(
            f"{where}: stored with stream transforms {list(info.transform_descriptors)}: not supported"
        )
    path = os.path.join(folder, info.relative_path)
    if path not in sizes:
        if not os.path.lexists(path):
            raise CheckpointError(f"{where}: data file {info.relative_path} is missing")
        sizes[path] = input_file(path).st_size
    if info.offset + info.length > sizes[path]:
        raise CheckpointError(
            f"{where}: {info.relative_path} ends before byte {info.offset + info.length} (truncated?)"
        )
    return read(path, int(info.offset), int(info.length), f"{where} in {info.relative_path}")


def _open(folder: str, meta: Any, read: ReadFrame) -> DcpCheckpoint:
    storage = {_index_key(k): v for k, v in meta.storage_data.items()}
    file_sizes: Dict[str, int] = {}
    flat: Dict[str, Any] = {}
    for name, smd in meta.state_dict_metadata.items():
        if type(smd).__name__ == "BytesStorageMetadata":
            info = storage.get((name, None))
            if info is None:
                raise CheckpointError(f"{folder}: {name}: no storage entry")
            value = _chunk(folder, info, read, name, file_sizes)
            flat[name] = as_fill(value) if isinstance(value, TensorRef) else value
            continue
        shape, dtype = tuple(int(x) for x in smd.size), smd.properties.dtype
        sources: List[Source] = []
        covered = 0
        for ch in smd.chunks:
            offsets, sizes = tuple(int(x) for x in ch.offsets), tuple(int(x) for x in ch.sizes)
            info = storage.get((name, offsets))
            if info is None:
                raise CheckpointError(f"{folder}: {name}: chunk at {list(offsets)} has no storage entry")
            ref = _chunk(folder, info, read, name, file_sizes)
            if (
                not isinstance(ref, TensorRef)
                or tuple(ref.shape) != sizes
                or dtype_name(ref.dtype) != dtype_name(dtype)
            ):
                raise CheckpointError(
                    f"{folder}: {name}: chunk at {list(offsets)} does not hold a {dtype} tensor of {list(sizes)}"
                )
            for tstart, bstart, n in box_runs(shape, offsets, sizes):
                sources.append(Source(ref, bstart, tstart, n))
            covered += numel(sizes)
        if covered != numel(shape):
            raise CheckpointError(f"{folder}: {name}: chunks hold {covered} of {numel(shape)} elements")
        flat[name] = Fill(shape, dtype, tuple(sorted(sources, key=lambda s: s.dst_start)))
    planner = meta.planner_data
    tree = unflatten_state_dict(flat, planner) if isinstance(planner, Mapping) and planner else flat
    files = sorted({info.relative_path for info in meta.storage_data.values()}) + [METADATA]
    return DcpCheckpoint(folder, tree, files, torch_free=read is _frame_torch_free)


def open_dcp(folder: str, trust_pickles: bool = False) -> DcpCheckpoint:
    """Open a DCP folder: reads ``.metadata`` and each chunk's pickle, no tensor data.

    Without torch where the stand-ins and the torch-free reader handle every
    part; otherwise the whole folder through torch, as one kind of dtype.
    """
    input_file(os.path.join(folder, METADATA))
    if torch_free_allowed():
        try:
            return _open(folder, _stand_in_metadata(folder), _frame_torch_free)
        except Unsupported:
            pass
    return _open(folder, read_metadata(folder, trust_pickles), _frame_with_torch(trust_pickles))

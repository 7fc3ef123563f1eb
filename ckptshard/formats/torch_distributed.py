"""Stand-ins for the ``torch.distributed`` objects a per-rank FSDP2 file pickles, read without torch.

``torch.save`` of a DTensor writes ``_rebuild_from_type_v2(
_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, size, stride, ...),
{"_local_tensor": <tensor>, "_spec": DTensorSpec(mesh=DeviceMesh(...),
placements=(Shard(dim=0),), tensor_meta=...)})``. The classes of the spec
move between torch releases (``torch.distributed._tensor`` before 2.5,
``torch.distributed.tensor`` since) and their private fields change (a
``mesh`` tensor, or a ``_layout``), so every global under
``torch.distributed`` unpickles as an inert :class:`Record` that only
remembers its arguments and state: nothing of torch is imported or run.
What ckptshard needs is then read off the records by field name: the
local tensor, the global shape and the placements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..dtypes import StoredDType

SHARDED_TENSOR_NAMES = {
    ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"),
    ("torch.distributed._shard.sharded_tensor", "ShardedTensor"),
}
DTENSOR_NAMES = {
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor._api", "DTensor"),
    ("torch.distributed._tensor", "DTensor"),
    ("torch.distributed._tensor.api", "DTensor"),
}


class Record:
    """An object of a ``torch.distributed`` class or call, kept as its arguments and state.

    ``called``: made by REDUCE (the class called) rather than NEWOBJ (only
    ``__new__``); ``pickled_state``: what BUILD gave, as it was (None if no
    BUILD). With the class's ``module`` and ``name`` they are the object's
    pickle, to be written again (``dtensor_pickle``).
    """

    qualname = "?"
    module = name = ""
    owner: Any = None  # a nested class reached by getattr(owner, name)

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        self = object.__new__(cls)
        self.args, self.kwargs, self.state = args, kwargs, {}
        self.called, self.pickled_state = False, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if is_distributed(self.module) and self.name not in CALLED_CLASSES:
            raise ValueError(f"{self.qualname} made by a call, which torch never pickles: a crafted file")
        self.called = True  # __new__ kept the arguments; REDUCE calls the class, NEWOBJ only __new__

    def __setstate__(self, state: Any) -> None:
        self.pickled_state = state
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state if isinstance(state, dict) else {"state": state}

    def field(self, name: str, position: Optional[int] = None) -> Any:
        """A field by name from the state or keyword arguments, else the positional argument."""
        if name in self.state:
            return self.state[name]
        if name in self.kwargs:
            return self.kwargs[name]
        if position is not None and len(self.args) > position:
            return self.args[position]
        return None

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


_RECORD_CLASSES: Dict[Tuple[str, str], type] = {}

# Only classes of torch.distributed are read from a DTensor's or ShardedTensor's pickle (their modules move
# between releases, and releases add fields and classes: DTensorSpec, DeviceMesh, _MeshLayout, Shard,
# ShardedTensorMetadata...). A function of it is refused: nothing of torch.distributed runs on load, here or
# in a file written back. A class is told by its name: CapWords, as torch names them, or one of the few
# classes it names in lower case.
LOWER_CASE_CLASSES = frozenset({"_remote_device"})  # a ShardedTensor's placement, torch.distributed.remote_device
# Enums pickle as a call of their class on the value; every other class is made without a call.
CALLED_CLASSES = frozenset({"MEM_FORMAT_ENCODING"})


def record_class(module: str, name: str) -> type:
    """One inert class per ``module.name`` (so two records of one class compare by class)."""
    key = (module, name)
    if key not in _RECORD_CLASSES:
        _RECORD_CLASSES[key] = type(
            name, (Record,), {"qualname": f"{module}.{name}", "module": module, "name": name, "__module__": __name__}
        )
    return _RECORD_CLASSES[key]


def record_getattr(owner: Any, name: str) -> Any:
    """``getattr(<record class>, name)``: how ShardedTensor pickles its nested ProcessGroupState class."""
    if not (isinstance(owner, type) and issubclass(owner, Record)) or not _class_name(name):
        return None
    module, _, outer = owner.qualname.rpartition(".")
    found = record_class(module, f"{outer}.{name}")
    found.owner, found.name = owner, name
    return found


def is_distributed(module: str) -> bool:
    return module == "torch.distributed" or module.startswith("torch.distributed.")


def _class_name(name: str) -> bool:
    return name.lstrip("_")[:1].isupper() or name in LOWER_CASE_CLASSES


def is_distributed_class(module: str, name: str) -> bool:
    """A class of torch.distributed (by its name: torch's functions are lower case), in any of its modules."""
    return is_distributed(module) and _class_name(name)


class DTensorType:
    """``DTensor`` named as a rebuild target (``module.name``: as the file names it)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class WrapperShell:
    """``_rebuild_wrapper_subclass``'s result before its state: the global dtype and shape; ``args``, all
    its arguments (the rest: storage offset, layout, device, requires_grad)."""

    def __init__(self, cls: Any, dtype: Any, size: Any, stride: Any, *rest: Any) -> None:
        self.cls, self.dtype = cls, dtype
        self.shape = tuple(int(s) for s in size)
        self.stride = tuple(int(s) for s in stride)
        self.args = (cls, dtype, size, stride, *rest)


def rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any, *rest: Any) -> WrapperShell:
    return WrapperShell(cls, dtype, size, stride, *rest)


class DTensorPiece:
    """One rank's DTensor as unpickled: ``local`` is the reader's tensor stand-in."""

    def __init__(self, shell: WrapperShell, local: Any, placements: Tuple[Tuple[str, int], ...], mesh: Any) -> None:
        self.dtype, self.shape, self.local, self.placements = shell.dtype, shell.shape, local, placements
        self.coordinate = coordinate_of(mesh)
        self.sharded_tensor = False
        self.requires_grad = False  # a ShardedTensor's recorded property (LOCAL_STATE_DICT's flat parameters: True)
        self.shell: WrapperShell = shell
        self.pickled_state: Any = None  # the state as unpickled: with the shell, a template to write others by


def placement(p: Any) -> Tuple[str, int]:
    """``("shard", dim)``, ``("strided_shard", dim)``, ``("replicate", -1)`` or ``("partial", -1)``."""
    name = p.qualname.rsplit(".", 1)[-1] if isinstance(p, Record) else type(p).__name__
    dim = p.field("dim", 0) if isinstance(p, Record) else None
    kinds = {"Shard": "shard", "_StridedShard": "strided_shard", "Replicate": "replicate", "Partial": "partial"}
    kind = kinds.get(name, name)
    return (kind, int(dim) if kind in ("shard", "strided_shard") and isinstance(dim, int) else -1)


def coordinate_of(mesh: Any) -> Optional[Tuple[int, ...]]:
    """This rank's coordinate in the pickled DeviceMesh, where it says it (it has for every release seen)."""
    coordinate = mesh.field("_coordinate_on_dim") if isinstance(mesh, Record) else None
    return tuple(int(c) for c in coordinate) if isinstance(coordinate, (list, tuple)) else None


def finish_dtensor(shell: WrapperShell, state: Any) -> Optional[DTensorPiece]:
    """The DTensor of ``shell`` and its pickled ``state``; None if the state is not a DTensor's."""
    pickled = state
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__): DTensor keeps its fields in slots
        state = {**(state[0] or {}), **(state[1] or {})}
    if not isinstance(state, dict) or "_local_tensor" not in state or not isinstance(state.get("_spec"), Record):
        return None
    spec = state["_spec"]
    placements = spec.field("placements", 1)
    if not isinstance(placements, (list, tuple)):
        return None
    piece = DTensorPiece(shell, state["_local_tensor"], tuple(placement(p) for p in placements), spec.field("mesh", 0))
    piece.pickled_state = pickled
    return piece


def _rows_only(metadata: Any) -> bool:
    """Whether a ShardedTensor's metadata has exactly one shard, at offset 0 (dim-0 chunks then, trivially)."""
    shards = metadata.field("shards_metadata", 0) if isinstance(metadata, Record) else None
    if not isinstance(shards, list) or len(shards) != 1 or not isinstance(shards[0], Record):
        return False
    offsets = shards[0].field("shard_offsets", 0)
    return isinstance(offsets, list) and all(o == 0 for o in offsets)


def finish_sharded_tensor(shell: WrapperShell, state: Any) -> Optional[DTensorPiece]:
    """FSDP1's SHARDED_STATE_DICT ShardedTensor as the DTensor it amounts to: one rank's rows of dim 0.

    Its state is ``(local_shards, metadata, process group state, sharding spec, init_rrefs)``;
    FSDP1 gives each rank at most one shard, a chunk of dimension 0 (the spec's ``dim``).
    None if the state is not that.
    """
    if not (isinstance(state, tuple) and len(state) >= 4 and isinstance(state[0], list)):
        return None
    shards, metadata, pg, spec = state[0], state[1], state[2], state[3]
    rank = pg.field("global_rank") if isinstance(pg, Record) else None
    dim = spec.field("dim") if isinstance(spec, Record) else None
    if dim is None and _rows_only(metadata):
        dim = 0  # one chunk (world size 1, or a single row): torch infers an enumerable spec of it
    if not isinstance(rank, int) or dim != 0 or len(shards) > 1:
        return None
    local = shards[0].field("tensor") if shards and isinstance(shards[0], Record) else None
    piece = DTensorPiece(shell, local, (("shard", 0),), None)
    piece.coordinate, piece.sharded_tensor, piece.pickled_state = (rank,), True, state
    props = metadata.field("tensor_properties", 2) if isinstance(metadata, Record) else None
    fields = props.field("state") if isinstance(props, Record) else None  # pickled as a tuple of its fields
    piece.requires_grad = isinstance(fields, tuple) and len(fields) > 2 and fields[2] is True
    return piece


@dataclass(frozen=True)
class TemplateTensor:
    """A tensor inside a template (a mesh's rank map): its shape and dtype, not its data."""

    shape: Tuple[int, ...]
    dtype: StoredDType
    contiguous: bool  # whole storage, offset 0, row-major


@dataclass(frozen=True, eq=False)
class PickledDTensor:
    """One source DTensor's pickle: ``_rebuild_wrapper_subclass``'s arguments and the DTensor's state
    (``(dict, slots)``), their torch objects as ``torch_names`` NewObj/Call/Global; ``dtensor_pickle``
    writes others by it."""

    shell: Tuple[Any, ...]
    state: Any


@dataclass(frozen=True)
class MeshPlace:
    """Rank ``rank`` of ``world`` ranks in the device mesh an output file's DTensors live on: 1-D (FSDP2), or
    ``shape`` ``(replicas, shards)`` (HSDP); ``dim_names`` as ``init_device_mesh``'s ``mesh_dim_names``."""

    world: int
    rank: int
    shape: Tuple[int, ...] = ()
    dim_names: Optional[Tuple[str, ...]] = None

    @property
    def mesh_shape(self) -> Tuple[int, ...]:
        return self.shape or (self.world,)

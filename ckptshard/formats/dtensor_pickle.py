"""FSDP2's DTensors and FSDP1's ShardedTensors pickled without torch, the source files' own pickles as templates.

A DTensor's pickle (see ``torch_distributed``) holds its spec and DeviceMesh:
private classes whose fields change between torch releases. Importing torch
to build a mesh of N ranks and let torch pickle it costs seconds on every
reshard. Instead the reader keeps each source DTensor's pickle
(``torch_distributed.PickledDTensor``, written by the torch that trained), and
:class:`DTensorWriter` writes it again with what depends on the world size,
the rank and the tensor changed: the local tensor, the global shape and
stride, the dtype, and the mesh's rank fields. A ShardedTensor is rebuilt
from its template's own classes: shards metadata for N, process-group
state, and the sharding spec torch would infer (chunked or enumerable).

A field is rewritten only if it is known to depend on nothing but those
(:data:`MESH_FIELDS`, :data:`SPEC_FIELDS`). Any other field, a mesh of more
than one dimension, or a layout not seen is :class:`Unsupported`, and the
writer lets torch pickle the file instead (``write/dtensor_mesh``).
The ``_hash`` fields are written as None: torch computes them again on first
use (they hash process-local strings, so a saved value is stale anyway).
No I/O and no torch here.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Dict, Optional, Tuple

from ..dtypes import dtype_name
from ..layout.boxes import strides
from .sharded_tensor_pickle import sharded_tensor_call
from .torch_distributed import MeshPlace, PickledDTensor, TemplateTensor
from .torch_names import NO_STATE, Call, Global, Literal, NewObj, rebuild_wrapper
from .torch_pickle import Unsupported


def _keep(value: Any, place: MeshPlace, world: int) -> Any:
    return value


def _rank(value: Any, place: MeshPlace, world: int) -> Any:
    _require(isinstance(value, int) and 0 <= value < world, "_rank")
    return place.rank


def _coordinate(value: Any, place: MeshPlace, world: int) -> Any:
    _require(isinstance(value, (tuple, list)) and len(value) == 1, "_coordinate_on_dim (a 1-D mesh)")
    return type(value)([place.rank])


def _flat_ranks(value: Any, place: MeshPlace, world: int) -> Any:
    _require(isinstance(value, (tuple, list)) and list(value) == list(range(world)), "_flatten_rank_map")
    return type(value)(range(place.world))


def _rank_tensor(value: Any, place: MeshPlace, world: int) -> Any:
    codes = {"int32": "i", "int64": "q"}
    _require(
        isinstance(value, TemplateTensor)
        and value.contiguous
        and value.shape == (world,)
        and value.dtype.name in codes,
        "the mesh's rank tensor",
    )
    data = struct.pack(f"<{place.world}{codes[value.dtype.name]}", *range(place.world))
    return Literal((place.world,), value.dtype, data)


def _flat_layout(world: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """A 1-D mesh's ``_FlatLayout`` (shape, stride): torch drops a mode of size 1, so one rank has none."""
    return ((world,), (1,)) if world > 1 else ((), ())


def _layout(value: Any, place: MeshPlace, world: int) -> Any:
    """``_MeshLayout(axes=(_FlatLayout(shape=(M,), stride=(1,)),))``, resized to N."""
    _require(isinstance(value, NewObj) and not value.args and isinstance(value.state, dict), "_layout")
    state: Dict[str, Any] = {}
    keys = set(value.state)
    if keys == {"axes"}:
        axes = value.state["axes"]
        _require(isinstance(axes, (tuple, list)) and len(axes) == 1, "_layout axes (a 1-D mesh)")
        state["axes"] = type(axes)(_layout(a, place, world) for a in axes)
    elif keys == {"shape", "stride"}:
        shape, stride = value.state["shape"], value.state["stride"]
        _require((tuple(shape), tuple(stride)) == _flat_layout(world), "_layout shape")
        new_shape, new_stride = _flat_layout(place.world)
        state.update(shape=type(shape)(new_shape), stride=type(stride)(new_stride))
    else:
        raise Unsupported(f"_layout fields {sorted(keys)}")
    return NewObj(value.cls, (), state)


def _group_infos(value: Any, place: MeshPlace, world: int) -> Any:
    """``[(tag, ranks, group name)]`` of the one process group a 1-D mesh over all ranks uses."""
    _require(isinstance(value, list) and len(value) == 1, "_dim_group_infos (a 1-D mesh)")
    info = value[0]
    _require(isinstance(info, (tuple, list)) and len(info) == 3, "_dim_group_infos entry")
    tag, ranks, name = info
    _require(isinstance(ranks, list) and ranks == list(range(world)), "_dim_group_infos ranks")
    return [type(info)((tag, list(range(place.world)), name))]


def _none(value: Any, place: MeshPlace, world: int) -> Any:
    return None


def _when(ok: Callable[[Any], bool], what: str) -> Callable[[Any, MeshPlace, int], Any]:
    def keep(value: Any, place: MeshPlace, world: int) -> Any:
        _require(ok(value), what)
        return value

    return keep


def _dim_names(value: Any, place: MeshPlace, world: int) -> Any:
    """The 1-D mesh's name as the output's place says (the source's, or the user's): a tuple, or None."""
    _require(value is None or (isinstance(value, (tuple, list)) and len(value) == 1), "dim names")
    return tuple(place.dim_names) if place.dim_names else None


# DeviceMesh fields and how each follows the rank and world size. torch pickles the mesh's __dict__: 2.13 and
# 2.15 a layout and a rank map (the first group below), 2.4 to 2.8 a mesh tensor (the second) with
# process-group infos (2.4, 2.6) or names (2.8).
MESH_FIELDS: Dict[str, Callable[[Any, MeshPlace, int], Any]] = {
    "_device_type": _keep,
    "_thread_id": _keep,
    "_mesh_dim_names": _dim_names,
    "_root_mesh": _when(lambda v: v is None, "_root_mesh (a mesh sliced from another)"),
    "_parent_mesh": _when(lambda v: v is None, "_parent_mesh (a mesh sliced from another)"),  # 2.4's _root_mesh
    "_flatten_mapping": _when(lambda v: v == {}, "_flatten_mapping"),
    "_preserve_rank_order": _when(lambda v: isinstance(v, bool), "_preserve_rank_order"),  # 2.15: a creation option
    "_dim_group_names": _when(lambda v: isinstance(v, list) and len(v) == 1, "_dim_group_names (a 1-D mesh)"),
    "_rank": _rank,
    "_coordinate_on_dim": _coordinate,
    "_flatten_rank_map": _flat_ranks,
    "_rank_map": _rank_tensor,
    "_layout": _layout,
    "_hash": _none,
    "device_type": _keep,
    "mesh": _rank_tensor,
    "mesh_dim_names": _dim_names,
    "_flatten_mesh_list": _flat_ranks,
    "_dim_group_infos": _group_infos,
}
# DTensorSpec fields besides mesh and tensor_meta: they follow the placements (rewritten where a DTensor is
# sharded on another dimension at the new world size: ``_shard_dims``).
SPEC_FIELDS = {"placements", "shard_order", "use_strided_shard_as_shard_order"}


def _shard_dims(spec: Dict[str, Any], wanted: Tuple[Tuple[str, int], ...]) -> Dict[str, Any]:
    """The spec's ``placements`` (and ``shard_order``, torch 2.10+: (tensor dim, mesh dims) entries) sharding
    each mesh dimension on the tensor dimension ``wanted`` says: each ``Shard`` is kept as pickled, its ``dim``
    changed."""
    kept = spec.get("placements")
    if not isinstance(kept, (tuple, list)) or len(kept) != len(wanted):
        raise Unsupported("placements over another number of mesh dimensions than the source's")
    moved: Dict[int, int] = {}
    placements = []
    for i, (p, (kind, dim)) in enumerate(zip(kept, wanted)):
        old = p.state.get("dim") if isinstance(p, NewObj) and isinstance(p.state, dict) else None
        if kind != "shard" or old == dim:
            placements.append(p)
            continue
        if not isinstance(old, int) or getattr(p.cls, "name", "") != "Shard":
            raise Unsupported("a placement other than Shard(dim) to move to another dimension")
        placements.append(NewObj(p.cls, p.args, {**p.state, "dim": dim}))
        moved[i] = dim
    if not moved:
        return spec
    out = {**spec, "placements": type(kept)(placements)}
    order = spec.get("shard_order")
    if order is not None:
        out["shard_order"] = type(order)(_order_entry(e, moved) for e in order)
    return out


def _order_entry(entry: Any, moved: Dict[int, int]) -> Any:
    ok = isinstance(entry, NewObj) and len(entry.args) == 2 and isinstance(entry.args[1], (tuple, list))
    if not ok:
        raise Unsupported("a shard_order entry of another shape")
    mesh_dims = entry.args[1]
    if not any(m in moved for m in mesh_dims):
        return entry
    dims = {moved.get(m) for m in mesh_dims}
    if len(dims) != 1:  # one tensor dimension sharded over mesh dimensions that now shard different ones
        raise Unsupported("a shard_order entry over mesh dimensions moved apart")
    return NewObj(entry.cls, (dims.pop(), mesh_dims), entry.state)


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise Unsupported(f"a DeviceMesh with another {what} than a 1-D mesh over all ranks")


def _pickled_mesh(template: Any) -> Optional[NewObj]:
    """The DeviceMesh in a DTensor's pickle (``(dict, slots)`` state, the spec in its slots); None if not there."""
    state = template.state if isinstance(template, PickledDTensor) else None
    slots = state[1] if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) else {}
    spec = slots.get("_spec")
    mesh = spec.state.get("mesh") if isinstance(spec, NewObj) and isinstance(spec.state, dict) else None
    return mesh if isinstance(mesh, NewObj) and isinstance(mesh.state, dict) else None


def mesh_dim_names(template: Any) -> Optional[Tuple[str, ...]]:
    """The mesh dimension names a source DTensor's pickle records (verl's FSDP2: ``("fsdp",)``, HSDP:
    ``("ddp", "fsdp")``); None where it records none."""
    mesh = _pickled_mesh(template)
    fields = mesh.state if mesh is not None else {}
    names = fields.get("_mesh_dim_names", fields.get("mesh_dim_names"))
    ok = isinstance(names, (tuple, list)) and all(isinstance(n, str) for n in names)
    return tuple(names) if ok else None


def _checked(template: Any) -> PickledDTensor:
    if not isinstance(template, PickledDTensor):
        raise Unsupported("no source DTensor pickle to follow")
    if len(template.shell) < 4 or not isinstance(template.shell[0], Global):
        raise Unsupported("a wrapper subclass call of another shape")
    return template


def with_mesh_tensors(template: PickledDTensor, tensors: Dict[str, Literal]) -> PickledDTensor:
    """``template`` (torch's pickle of a DTensor, read back) with its mesh's tensor fields (a rank map, a mesh
    tensor: read back as shapes only) given their bytes, ``tensors`` by field name. Every tensor field must
    have them."""
    mesh = _pickled_mesh(template)
    if mesh is None:
        raise Unsupported("a DTensor pickle without a DeviceMesh")
    for key, value in mesh.state.items():
        if key == "_hash":
            mesh.state[key] = None  # this process's hash of its strings: torch computes it again on use
        elif isinstance(value, TemplateTensor):
            given = tensors.get(key)
            if given is None or (given.shape, given.dtype) != (value.shape, value.dtype):
                raise Unsupported(f"the DeviceMesh's {key}: no bytes for it")
            mesh.state[key] = given
    return template


def _mesh_world(state: Dict[str, Any]) -> int:
    ranks = state.get("_flatten_rank_map", state.get("_flatten_mesh_list"))
    _require(isinstance(ranks, (tuple, list)) and len(ranks) > 0, "_flatten_rank_map")
    return len(ranks)


class DTensorWriter:
    """The call torch.save writes for each DTensorFill of one output file, at ``place``.

    One per file: the mesh is made once and every DTensor of the file
    refers to it, as every parameter of an FSDP2 model refers to one mesh.
    ``placed(placements)``: torch's own pickle of a DTensor of those placements on this rank's mesh
    (``write/dtensor_mesh.mesh_template``), or None. It is what a mesh of more than one dimension (HSDP)
    is written by, whose pickle holds its process groups' names, and what a 1-D mesh the rules do not know
    is written by: its mesh and spec as they are, with this DTensor's tensor in.
    """

    def __init__(self, place: MeshPlace, placed: Optional[Callable[[Any], Optional[PickledDTensor]]] = None) -> None:
        self.place = place
        self.placed = placed
        self._meshes: Dict[int, Tuple[Any, NewObj]] = {}  # by id of the template, which is kept alive here
        self._placed: Dict[Tuple[Any, ...], Optional[PickledDTensor]] = {}

    def __call__(self, fill: Any) -> Call:
        if fill.sharded_tensor:
            return sharded_tensor_call(fill, _checked(fill.pickled), self.place)
        if len(self.place.mesh_shape) == 1:
            try:
                return self._written(fill, _checked(fill.pickled), own_mesh=False)
            except Unsupported:
                if self.placed is None:
                    raise
        kind = tuple(fill.placements)
        if kind not in self._placed:  # one template object per file: its mesh pickled once, as torch does
            self._placed[kind] = self.placed(kind) if self.placed else None
        template = self._placed[kind]
        if template is None:
            raise Unsupported(f"a {self.place.mesh_shape} mesh, and no pickle of it made by torch")
        return self._written(fill, _checked(template), own_mesh=True)

    def _written(self, fill: Any, template: PickledDTensor, own_mesh: bool) -> Call:
        state = template.state
        if not (isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict)):
            raise Unsupported("a DTensor state other than (dict, slots)")
        shape = tuple(fill.shape)
        stride = strides(shape)
        dtype = Global.of("torch", dtype_name(fill.local.dtype))
        slots = dict(state[1])
        spec = slots.get("_spec")
        if not isinstance(spec, NewObj) or not isinstance(spec.state, dict) or spec.args:
            raise Unsupported("a DTensorSpec of another shape")
        spec_state = _shard_dims(spec.state, tuple(fill.placements))
        slots["_spec"] = NewObj(spec.cls, (), self._spec_state(spec_state, shape, stride, dtype, own_mesh))
        slots["_local_tensor"] = fill.local
        return rebuild_wrapper(template.shell, dtype, shape, stride, (state[0], slots))

    def _spec_state(
        self, spec: Dict[str, Any], shape: Tuple[int, ...], stride: Tuple[int, ...], dtype: Global, own_mesh: bool
    ) -> Any:
        out: Dict[str, Any] = {}
        for key, value in spec.items():
            if key == "mesh":
                out[key] = value if own_mesh else self._mesh(value)
            elif key == "tensor_meta":
                if not (isinstance(value, NewObj) and len(value.args) == 3 and value.state is NO_STATE):
                    raise Unsupported("a TensorMeta of another shape")
                size = value.args[0]
                out[key] = NewObj(value.cls, (type(size)(shape), stride, dtype), NO_STATE)
            elif key == "_hash":
                out[key] = None
            elif key in SPEC_FIELDS:
                out[key] = value
            else:
                raise Unsupported(f"DTensorSpec field {key}")
        if "mesh" not in out or "tensor_meta" not in out:
            raise Unsupported("a DTensorSpec without its mesh or tensor_meta")
        return out

    def _mesh(self, mesh: Any) -> NewObj:
        seen = self._meshes.get(id(mesh))
        if seen is not None and seen[0] is mesh:
            return seen[1]
        if not (isinstance(mesh, NewObj) and not mesh.args and isinstance(mesh.state, dict)):
            raise Unsupported("a DeviceMesh of another shape")
        world = _mesh_world(mesh.state)
        state = {}
        for key, value in mesh.state.items():
            rule = MESH_FIELDS.get(key)
            if rule is None:
                raise Unsupported(f"DeviceMesh field {key}")
            state[key] = rule(value, self.place, world)
        made = NewObj(mesh.cls, (), state)
        self._meshes[id(mesh)] = (mesh, made)
        return made

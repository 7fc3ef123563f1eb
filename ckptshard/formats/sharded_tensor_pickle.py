"""FSDP1's ShardedTensors pickled without torch, the source file's own ShardedTensor pickle as the template.

A SHARDED_STATE_DICT or LOCAL_STATE_DICT ShardedTensor pickles its local
shards, its metadata (every rank's shard, the size, the tensor properties),
the process group's ranks and sizes, and a sharding spec that torch infers
from the shards. For rank r of N they are rebuilt here from the template's
own classes; a part of another shape than those seen is :class:`Unsupported`
(``dtensor_pickle.DTensorWriter`` lets torch pickle the file then).
No I/O and no torch here.
"""

from __future__ import annotations

from typing import Any, List

from ..dtypes import Size, dtype_name
from ..layout.boxes import strides
from ..layout.dim_shards import chunk_sizes
from .torch_distributed import MeshPlace, PickledDTensor
from .torch_names import Call, Global, NewObj, RequiresGrad, rebuild_wrapper
from .torch_pickle import Unsupported


def sharded_tensor_call(fill: Any, template: PickledDTensor, place: MeshPlace) -> Call:
    """FSDP1's ShardedTensor of this rank's dim-0 chunk: its state ``(local shards, metadata, process
    group state, sharding spec, init_rrefs)`` built from the template's objects."""
    state = template.state
    shape = tuple(fill.shape)
    if not (isinstance(state, tuple) and len(state) == 5 and shape):
        raise Unsupported("a ShardedTensor of another shape")
    parts = _ShardedParts(template)
    rank, world = place.rank, place.world
    rows = [n for n in chunk_sizes(shape[0], world) if n]  # torch.chunk's chunks: ranks past them hold none
    starts = [sum(rows[:i]) for i in range(len(rows))]
    rest = list(shape[1:])
    zeros = [0] * len(rest)
    shards = [parts.shard_metadata([at, *zeros], [n, *rest], i) for i, (at, n) in enumerate(zip(starts, rows))]
    local = []
    if rank < len(rows):
        mine = parts.shard_metadata([starts[rank], *zeros], [rows[rank], *rest], rank)
        tensor = RequiresGrad(fill.local) if fill.requires_grad else fill.local  # LOCAL's flat parameters
        local = [NewObj(parts.shard.cls, (), (None, {"tensor": tensor, "metadata": mine}))]
    dtype = Global.of("torch", dtype_name(fill.local.dtype))
    props = NewObj(parts.properties.cls, (), (dtype, *parts.properties.state[1:]))
    meta = NewObj(parts.meta.cls, (), {"shards_metadata": shards, "size": Size(shape), "tensor_properties": props})
    pg = NewObj(parts.pg.cls, (), dict.fromkeys(PG_FIELDS[:2], rank) | dict.fromkeys(PG_FIELDS[2:], world))
    if _chunked(rows) != parts.chunked:
        raise Unsupported("a ShardedTensor whose sharding spec changes kind")
    if parts.chunked:
        spec = NewObj(parts.spec.cls, (), {"dim": 0, "placements": [s.state[1]["placement"] for s in shards]})
    else:
        spec = NewObj(parts.spec.cls, (), {"shards": shards})
    return rebuild_wrapper(template.shell, dtype, shape, strides(shape), (local, meta, pg, spec, state[4]))


PG_FIELDS = ("local_rank", "global_rank", "local_world_size", "global_world_size")  # ShardedTensor.ProcessGroupState


def _obj(x: Any, keys: Any, slots: bool = False) -> NewObj:
    """``x`` as a NewObj whose state (a dict, or ``(None, dict)`` for a slotted dataclass) has ``keys``."""
    state = x.state if isinstance(x, NewObj) else None
    if slots:
        state = state[1] if isinstance(state, tuple) and len(state) == 2 and state[0] is None else None
    if not (isinstance(state, dict) and set(state) == set(keys) and not x.args):
        raise Unsupported(f"a ShardedTensor part of another shape than {sorted(keys)}")
    return x


class _ShardedParts:
    """The objects of a template ShardedTensor, checked: their classes are what a new one is made of."""

    def __init__(self, template: PickledDTensor) -> None:
        shards, meta, pg, spec, _ = template.state
        if not (isinstance(shards, list) and len(shards) == 1):
            raise Unsupported("a template ShardedTensor without its local shard")
        self.shard = _obj(shards[0], ("tensor", "metadata"), slots=True)
        self.meta = _obj(meta, ("shards_metadata", "size", "tensor_properties"))
        listed = self.meta.state["shards_metadata"]
        if not isinstance(listed, list) or not listed:
            raise Unsupported("a ShardedTensor without shards metadata")
        self.shard_meta = _obj(listed[0], ("shard_offsets", "shard_sizes", "placement"), slots=True)
        self.device = _obj(self.shard_meta.state[1]["placement"], ("_worker_name", "_rank", "_device"))
        self.properties = self.meta.state["tensor_properties"]
        if not (isinstance(self.properties, NewObj) and isinstance(self.properties.state, tuple)):
            raise Unsupported("TensorProperties of another shape")
        # (dtype, layout, requires_grad, memory format, pin_memory), and since torch 2.15 strides: None for FSDP1's
        fields = self.properties.state
        if not (len(fields) == 5 or (len(fields) == 6 and fields[5] is None)):
            raise Unsupported("TensorProperties of another shape")
        self.pg = _obj(pg, PG_FIELDS)
        self.chunked = isinstance(spec, NewObj) and isinstance(spec.state, dict) and "placements" in spec.state
        self.spec = _obj(spec, ("dim", "placements") if self.chunked else ("shards",))
        if self.chunked and spec.state["dim"] != 0:
            raise Unsupported("a ShardedTensor chunked along another dimension")

    def shard_metadata(self, offsets: List[int], sizes: List[int], rank: int) -> NewObj:
        device = NewObj(self.device.cls, (), {**self.device.state, "_rank": rank})
        fields = {"shard_offsets": offsets, "shard_sizes": sizes, "placement": device}
        return NewObj(self.shard_meta.cls, (), (None, fields))


def _chunked(rows: List[int]) -> bool:
    """Whether torch infers a ChunkShardingSpec (not an enumerable one) for dim-0 shards of ``rows``: more
    than one shard, cut as ``torch.chunk`` cuts their total into as many pieces."""
    if len(rows) < 2:
        return False  # every offset zero: torch cannot tell a chunked dimension
    total = sum(rows)
    split = -(-total // len(rows))
    expected = [max(min(total, split * (i + 1)) - split * i, 0) for i in range(len(rows))]
    return sorted(rows) == sorted(expected)

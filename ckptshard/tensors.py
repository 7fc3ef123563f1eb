"""The data types every layer shares: stored tensors, planned tensors, and their sizes.

A :class:`TensorRef` says where one stored tensor's bytes lie (file, byte
offset, dtype, shape, strides); reading them is ``ckptshard.read.tensor_data``'s
work. A :class:`Fill` is an output tensor described by where its elements
come from: :class:`Source` runs of stored tensors. Elements no source covers
are padding and stay zero. Plans are trees (dicts, lists) with Fills for
leaves; ``ckptshard.write`` turns them into files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Tuple

from .dtypes import itemsize_of
from .tree import leaves, map_leaves


def numel(shape: Iterable[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for a 0-dim tensor)."""
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class TensorRef:
    """Where one stored tensor's bytes live: file, byte offset, dtype, shape.

    Only contiguous tensors can be read in ranges (flat parameter shards
    always are); others are read whole through their strides. ``dtype`` is a
    torch.dtype, or a StoredDType where the torch-free reader opened the file.
    """

    path: str
    offset: int
    dtype: Any
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize_of(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True)
class DTensorRef:
    """One rank's piece of a DTensor (torch FSDP2's per-rank files): its local tensor and the whole's shape.

    ``placements``: per mesh dimension, ``("shard", dim)``, ``("strided_shard", dim)``, ``("replicate", -1)``
    or ``("partial", -1)``. ``coordinate``: the rank's place in the device mesh, where the file says it.
    """

    local: TensorRef
    shape: Tuple[int, ...]
    dtype: Any
    placements: Tuple[Tuple[str, int], ...]
    coordinate: Optional[Tuple[int, ...]] = None
    sharded_tensor: bool = False  # FSDP1's SHARDED_STATE_DICT ShardedTensor, read as the DTensor it amounts to
    requires_grad: bool = False  # a ShardedTensor's recorded property
    pickled: Any = field(default=None, compare=False, repr=False)  # its pickle, to write others by (dtensor_pickle)

    @property
    def tie_key(self) -> Optional[Tuple[Any, ...]]:
        """Where its local tensor is stored, which the names of one tied parameter share; None if it is empty."""
        return (self.local.path, self.local.offset, self.local.shape) if self.local.numel else None


@dataclass(frozen=True)
class Source:
    ref: TensorRef
    src_start: int  # element offset in the (flattened) source tensor
    dst_start: int  # element offset in the output tensor
    length: int


@dataclass(frozen=True, eq=False)
class Fill:
    """An output tensor: shape, dtype and the sources of its elements.

    Identity matters: the same Fill in two places of an output tree is one
    tensor stored once (tied parameters in ``torch.save`` outputs).
    """

    shape: Tuple[int, ...]
    dtype: Any  # torch.dtype, or StoredDType (see ckptshard.dtypes)
    sources: Tuple[Source, ...]

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize_of(self.dtype)


@dataclass(frozen=True, eq=False)
class DTensorFill:
    """A DTensor to write (FSDP2's per-rank files): this rank's local tensor and the whole's shape.
    ``sharded_tensor``: written as FSDP1's SHARDED_STATE_DICT writes it, a ShardedTensor of dim-0 chunks.

    Identity matters as for Fill: a tied parameter is one DTensor under two names.
    """

    local: Fill
    shape: Tuple[int, ...]
    placements: Tuple[Tuple[str, int], ...]
    sharded_tensor: bool = False
    requires_grad: bool = False  # recorded in a ShardedTensor's properties (LOCAL_STATE_DICT's flat parameters)
    pickled: Any = field(default=None, compare=False, repr=False)  # a source DTensor's pickle, to write it by


Progress = Callable[[int], None]  # called with the bytes just written


def whole(ref: TensorRef) -> Fill:
    """A Fill that copies one stored tensor as it is."""
    return Fill(ref.shape, ref.dtype, (Source(ref, 0, 0, ref.numel),))


def as_fill(x: TensorRef | Fill) -> Fill:
    """A stored tensor or a planned one, as a Fill."""
    return x if isinstance(x, Fill) else whole(x)


def is_tensor(x: object) -> bool:
    """A stored (TensorRef) or planned (Fill) tensor."""
    return isinstance(x, (TensorRef, Fill))


def sources_in(fill: Fill, start: int, stop: int, dst_start: int = 0) -> Tuple[Source, ...]:
    """The sources of elements ``[start, stop)`` of ``fill``, re-based to ``dst_start``."""
    out = []
    for s in fill.sources:
        lo, hi = max(start, s.dst_start), min(stop, s.dst_start + s.length)
        if lo < hi:
            out.append(Source(s.ref, s.src_start + lo - s.dst_start, dst_start + lo - start, hi - lo))
    return tuple(out)


def with_fills(tree: Any) -> Any:
    """A plan tree with every stored tensor (TensorRef) that is copied as it is made a Fill."""
    return map_leaves(tree, lambda x: whole(x) if isinstance(x, TensorRef) else x)


def fills_in(tree: Any) -> List[Fill]:
    """Every distinct Fill of a plan tree, in tree order (a tie counts once)."""
    seen, out = set(), []
    for _, leaf in leaves(tree):
        if isinstance(leaf, DTensorFill):
            leaf = leaf.local
        if isinstance(leaf, Fill) and id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(leaf)
    return out


def tree_nbytes(tree: Any) -> int:
    """Tensor bytes of a plan tree, ties once."""
    return sum(f.nbytes for f in fills_in(tree))


def tree_pieces(tree: Any) -> int:
    """How many source runs the tensors of ``tree`` are copied from (each is copied on its own)."""
    return sum(len(f.sources) for f in fills_in(tree))

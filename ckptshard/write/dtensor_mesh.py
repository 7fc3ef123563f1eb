"""A device mesh for rank r of N, in this one process, so that torch itself pickles FSDP2's DTensors.

A DTensor's pickle holds its DeviceMesh, whose private fields change with
every torch release; the files torch FSDP2 at N would save are the ones
torch pickles. torch's ``fake`` process group (made for tests: collectives
do nothing) gives a mesh of any size and rank without other processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

from ..dtypes import StoredDType, dtype_name
from ..errors import CheckpointError
from ..formats.dtensor_pickle import with_mesh_tensors
from ..formats.torch_distributed import MeshPlace, PickledDTensor
from ..formats.torch_names import Literal
from ..formats.torch_pickle import Unsupported
from ..layout.dim_shards import chunk_sizes


@contextlib.contextmanager
def fake_mesh(
    world: int,
    rank: int,
    dtensors: bool = True,
    shape: Optional[Tuple[int, ...]] = None,
    dim_names: Optional[Tuple[str, ...]] = None,
) -> Iterator[Any]:
    """The CPU DeviceMesh of ``rank`` among ``world`` (1-D, or of ``shape``, its dimensions named
    ``dim_names``), under a fake process group torn down on exit.

    ``dtensors=False`` (FSDP1's ShardedTensors only) leaves ``torch.distributed.tensor`` unimported.
    """
    with _FAKE_GROUP, _fake_mesh(world, rank, dtensors, shape, dim_names) as mesh:
        yield mesh


# One fake process group at a time: it is the process's default group, and writer threads each make one.
_FAKE_GROUP = threading.Lock()


@contextlib.contextmanager
def _fake_mesh(
    world: int, rank: int, dtensors: bool, shape: Optional[Tuple[int, ...]], dim_names: Optional[Tuple[str, ...]]
) -> Iterator[Any]:
    import torch.distributed as dist

    if dist.is_initialized():
        raise CheckpointError(
            "writing torch FSDP files needs this process free of a process group: "
            "run the conversion as one process (not under torchrun, not inside training)"
        )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        constructors = []
        if dtensors:
            from torch.distributed.tensor import DTensor

            constructors.append(DTensor.__init__)
    except ImportError as e:
        import torch

        raise CheckpointError(
            f"writing torch FSDP files needs torch 2.5 or newer (DTensor, a fake process group); "
            f"this is torch {torch.__version__} ({e})"
        ) from None

    # Reading a written file back to find its tensors' offsets unpickles its mesh, and torch warns (once per
    # mesh) that the mesh's process groups are not this process's: they are the training ranks', as they should.
    import logging  # here: a module that torch's import brings anyway

    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with _dynamo_left_unimported(*constructors):
            yield init_device_mesh("cpu", shape or (world,), mesh_dim_names=dim_names)
    finally:
        dist.destroy_process_group()
        mesh_log.setLevel(level)


@contextlib.contextmanager
def _dynamo_left_unimported(*constructors: Any) -> Iterator[None]:
    """Let ``constructors`` (wrapped in ``torch._disable_dynamo``) run without importing ``torch._dynamo``.

    That wrapper imports dynamo on first call, only to exempt the function
    from tracing: in a process that has never imported dynamo nothing
    traces, and the import outweighs the rest of a reshard's torch work
    (docs/performance.md). The wrapper looks for the exempted function
    cached on the wrapped one; this caches the function itself there, and
    takes it away on exit, so later calls take torch's own path.
    """
    if "torch._dynamo" in sys.modules:
        yield
        return
    cached = []
    for c in constructors:
        fn = getattr(c, "__wrapped__", None)
        code = getattr(c, "__code__", None)
        if code is None or not code.co_filename.endswith("_compile.py"):
            continue  # not torch._compile's _disable_dynamo wrapper (other torch versions): torch's own path
        if fn is not None and getattr(fn, "__dynamo_disable", None) is None:
            fn.__dynamo_disable = fn
            cached.append(fn)
    try:
        yield
    finally:
        for fn in cached:
            if fn.__dict__.get("__dynamo_disable") is fn:
                del fn.__dynamo_disable


Placements = Tuple[Tuple[str, int], ...]


@functools.lru_cache(maxsize=16)  # a rank's model and optimizer files share their mesh
def mesh_template(place: MeshPlace, kind: Placements) -> Optional[PickledDTensor]:
    """torch's pickle of an empty DTensor of placements ``kind`` on ``place``'s mesh, read back as a template
    for ``DTensorWriter``, which puts each DTensor's own tensor in; None where this torch cannot make one
    (before 2.5). For meshes whose pickle the rules cannot write (HSDP's holds the names torch gives each
    rank's process groups): the file's data is still laid out and written without torch. Kept between runs
    (``template_cache``): torch is imported only to make one not kept yet."""
    import tempfile

    from . import template_cache

    key = template_cache.entry_key(place.world, place.rank, place.mesh_shape, place.dim_names, kind)
    kept = template_cache.load(key) if key is not None else None
    if kept is not None:
        try:
            return _template_in(*kept)
        except Exception:  # whatever a kept entry holds, it is used only if it reads back: else made again
            pass
    with tempfile.TemporaryDirectory() as d:
        made = _saved_by_torch(place, kind, os.path.join(d, "mesh.pt"))
        if made is None:
            return None
        template = _template_in(*made)
        if template is not None and key is not None:
            template_cache.store(key, *made)
        return template


def _template_in(path: str, tensors: Dict[str, Literal]) -> Optional[PickledDTensor]:
    """The DTensor ``x`` of the torch file ``path``, read by ckptshard's reader, with the mesh's ``tensors``
    put in; None where its pickle is not one the rules can fill."""
    from ..read.safe_load import own_refs

    template = own_refs(path)["x"].pickled
    try:
        return with_mesh_tensors(template, tensors) if template is not None else None
    except Unsupported:
        return None


def _saved_by_torch(place: MeshPlace, kind: Placements, path: str) -> Optional[Tuple[str, Dict[str, Literal]]]:
    """torch.save of an empty DTensor of ``kind`` on ``place``'s mesh into ``path``, and the mesh's tensors'
    bytes; None without a fake process group."""
    import torch

    try:
        with fake_mesh(place.world, place.rank, True, place.mesh_shape, place.dim_names) as mesh:
            dims = 1 + max((d for k, d in kind if k == "shard"), default=0)
            made = {"x": dtensor_of(torch.empty((0,) * dims), mesh, (0,) * dims, kind)}
            hash(mesh)  # as in a training process: torch releases that hash lazily then pickle a _hash
            tensors = {
                k: Literal(tuple(v.shape), StoredDType(dtype_name(v.dtype)), v.contiguous().numpy().tobytes())
                for k, v in vars(mesh).items()
                if isinstance(v, torch.Tensor)
            }
            torch.save(made, path)
    except CheckpointError:
        return None  # no fake process group here: torch's path says so
    return path, tensors


def dtensor_of(local: Any, mesh: Any, shape: Any, placements: Any) -> Any:
    """``DTensor.from_local`` of ``local`` with the whole's ``shape``, no communication."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    kinds = [Shard(dim) if kind == "shard" else Replicate() for kind, dim in placements]
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return DTensor.from_local(local, mesh, kinds, run_check=False, shape=tuple(shape), stride=tuple(reversed(stride)))


def sharded_tensor_of(local: Any, mesh: Any, shape: Any, placements: Any, requires_grad: bool = False) -> Any:
    """FSDP1's SHARDED_STATE_DICT ShardedTensor of ``local``, this rank's dim-0 chunk of ``shape`` (as
    ``torch.chunk`` cuts it: a rank past the last chunk holds no shard), no communication. Placements are
    CPU ones, as FSDP1 with ``offload_to_cpu`` (verl's) saves them."""
    # torch deprecates ShardedTensor (warning on every operation, torch.save's included); FSDP1's files hold
    # them all the same.
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
    return _sharded_tensor(local, mesh, shape, placements, requires_grad)


def _sharded_tensor(local: Any, mesh: Any, shape: Any, placements: Any, requires_grad: bool) -> Any:
    import torch
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharding_spec import ShardMetadata

    if placements != (("shard", 0),):
        raise AssertionError(f"FSDP1 shards dim 0, not {placements}")
    rank, world = mesh.get_local_rank(), mesh.size()
    rows = [n for n in chunk_sizes(shape[0], world) if n]  # torch.chunk's chunks: ranks past them hold none
    starts = [sum(rows[:r]) for r in range(len(rows))]
    rest = [0] * (len(shape) - 1)
    metadata = [
        ShardMetadata([at, *rest], [n, *shape[1:]], f"rank:{r}/cpu") for r, (at, n) in enumerate(zip(starts, rows))
    ]
    if requires_grad:  # the shard must say what the properties say (LOCAL_STATE_DICT's flat parameters)
        local = local.detach().requires_grad_(True)
    local_shards = [Shard.from_tensor_and_offsets(local, [starts[rank], *rest], rank)] if rank < len(rows) else []
    properties = TensorProperties(
        dtype=local.dtype,
        layout=torch.strided,
        requires_grad=requires_grad,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    meta = ShardedTensorMetadata(shards_metadata=metadata, size=torch.Size(shape), tensor_properties=properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, sharded_tensor_metadata=meta)

"""Write torch.save files from plan trees whose tensors are Fills.

The whole file is laid out first (pickle and zip records, every tensor's
place reserved) and tensor bytes are then filled in file order, so nothing
larger than a copy block is ever held in memory.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ..dtypes import Size, StoredDType, to_torch
from ..formats.torch_distributed import MeshPlace
from ..formats.torch_pickle import Unsupported
from ..formats.torch_save import Skeleton, lay_out_zip
from ..osio.atomic import open_empty, preallocate
from ..osio.hashing import Hashes
from ..osio.window import MAP_MIN
from ..osio.zip_crc import CrcFixer, crc32, deferred_crcs, set_crc
from ..read.safe_load import own_refs, safe_globals, torch_gives_offsets
from ..tensors import DTensorFill, DTensorRef, Fill, Progress, TensorRef, fills_in
from ..tree import leaves, map_leaves
from .copier import Copier

if TYPE_CHECKING:
    import torch


_FAKE_MODE: Any = None


def _dtensor_writer(place: MeshPlace) -> Any:
    # Imported here: only torch FSDP outputs hold DTensors and ShardedTensors.
    from ..formats.dtensor_pickle import DTensorWriter
    from .dtensor_mesh import mesh_template

    return DTensorWriter(place, functools.partial(mesh_template, place))


def _fake_mode() -> Any:
    """One FakeTensorMode per process: making one costs about a second."""
    global _FAKE_MODE
    if _FAKE_MODE is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        _FAKE_MODE = FakeTensorMode()
    return _FAKE_MODE


def placeholder(shape: Tuple[int, ...], dtype: Any) -> torch.Tensor:
    """A tensor for torch.save to lay out under ``skip_data``: its bytes are never written or read.

    ``torch.empty`` reserves address space only (untouched pages take no
    memory) and costs nothing; where the system refuses even that (strict
    overcommit, a tensor larger than memory), a fake tensor stands in.
    """
    import torch

    dtype = to_torch(dtype)
    try:
        return torch.empty(shape, dtype=dtype)
    except RuntimeError:
        with _fake_mode():
            return torch.empty(shape, dtype=dtype)


RECORD_OVERHEAD = 512  # bytes a tensor adds to a torch.save zip beyond its data: headers, alignment, pickle
FILE_OVERHEAD = 4096  # and a file: its other records and the central directory's end
DTENSOR_OVERHEAD = 8192  # a DTensor's spec and device mesh, pickled beside its local tensor


def torch_file_size_bound(tree: Any) -> int:
    """The bytes ``write_torch(tree)`` puts on disk (data, pickle, zip framing), or an upper estimate.

    Carried values (a framework's args, RNG states) can outweigh the tensors
    of a small shard many times over. Where the tree was read without torch
    its file is laid out here as it will be written, so the size is exact;
    otherwise the pickle is measured with each tensor as a placeholder.
    """
    import pickle

    fills = fills_in(tree)
    if all(isinstance(f.dtype, StoredDType) for f in fills):
        try:
            return lay_out_zip(tree).end
        except Unsupported:
            pass
    try:
        plain = map_leaves(
            tree, lambda x: None if isinstance(x, (Fill, DTensorFill)) else tuple(x) if isinstance(x, Size) else x
        )
        carried = len(pickle.dumps(plain, protocol=2))
    except Exception:  # a value only torch's pickler handles: count it generously
        carried = 1 << 20
    meshes = DTENSOR_OVERHEAD * sum(1 for _, x in leaves(tree) if isinstance(x, DTensorFill))
    return sum(f.nbytes for f in fills) + RECORD_OVERHEAD * len(fills) + carried + meshes + FILE_OVERHEAD


def write_torch(
    path: str,
    tree: Any,
    copier: Copier,
    progress: Optional[Progress] = None,
    trust_pickles: bool = False,
    hashes: Optional[Hashes] = None,
    place: Optional[MeshPlace] = None,
) -> None:
    """``torch.save`` of ``tree`` with every Fill leaf written as a tensor.

    The file is laid out without torch (``torch_save.lay_out_zip``) where
    the tree was read without it, else by torch itself (``skip_data`` over
    placeholder tensors); either way any torch reads it. Tensor bytes are
    then filled in place, front to back, each record's CRC set. With
    ``hashes`` the hash pass trailing the copy also computes and writes the
    CRCs: the file is final once ``hashes.settled(path)`` returns. A small
    file of many small runs is put together in memory instead
    (:func:`_in_memory`): the same bytes, written at once. DTensorFills
    become DTensors on rank ``place.rank`` of a 1-D mesh of ``place.world``:
    their source's pickles rewritten (``formats/dtensor_pickle``), or, where
    that does not know the pickle, torch's over a fake mesh (``dtensor_mesh``).
    """
    fills = fills_in(tree)
    targets: Optional[Dict[int, Tuple[int, Fill]]] = None
    deferred: Optional[List[Tuple[int, int, Tuple[int, int]]]] = None  # (data start, size, where its CRC goes)
    dtensors = _dtensor_writer(place) if place is not None else None
    # Read without torch: write without it too. torch before 2.5 cannot lay out a file without its data.
    if all(isinstance(f.dtype, StoredDType) for f in fills) or not torch_skips_data():
        try:
            skeleton = lay_out_zip(tree, dtensors)
        except Unsupported:
            skeleton = None
        if skeleton is not None and _in_memory(skeleton, fills):
            _write_torch_in_memory(path, skeleton, fills, copier, progress, hashes)
            return
        if skeleton is not None:
            write_laid_out(path, skeleton)
            targets = {id(f): (skeleton.offsets[id(f)], f) for f in fills if _laid_out(skeleton, f)}
            deferred = skeleton.crcs
    if targets is None:
        targets = _torch_skeleton(path, tree, trust_pickles, place)
    order = sorted(targets.values(), key=lambda t: t[0])
    if hashes is not None and deferred is None:  # torch laid it out: read its zip to learn where the CRCs go
        deferred = deferred_crcs(path, [o for o, f in order if f.nbytes])
    watch = hashes.watch(path) if hashes else None
    if hashes is not None and deferred is not None:  # the hash pass computes and writes the CRCs (one read)
        for start, size, where in deferred:
            hashes.patch_crc(path, start, size, where)
    else:
        deferred = None  # no hash pass, or CRCs before their data: set after each record is filled
    fd = os.open(path, os.O_RDWR)
    try:
        crcs = CrcFixer(path, fd) if deferred is None else None
        for offset, fill in order:
            if watch:
                watch(offset)
            copier.fill(fd, offset, fill, progress)
            if crcs and fill.nbytes:
                crcs.filled(offset)
        if crcs:
            crcs.finish()
    finally:
        os.close(fd)
    if hashes:
        hashes.complete(path)


IN_MEMORY_MAX = 32 << 20  # bytes: a torch.save output this small, of many small runs, is put together in memory
IN_MEMORY_MIN_RUNS = 256  # fewer runs cost little either way: the file-to-file path, kernel copies and all


def _in_memory(skeleton: Skeleton, fills: List[Fill]) -> bool:
    """Small file, small runs, plain copies: cheaper assembled in memory and written at once.

    Per run, the file-to-file path pays a read and a write, and the hash
    pass a read and a hand-off between threads (per zip record: it stops at
    each to write its CRC): a reshard of 64 shards of 400 FSDP instances to
    48 ranks is 115k runs of about 7 KiB. In memory a run is one read into
    its place; CRCs and the hash are computed from the buffer, which is
    written with one call. Bounded: ``IN_MEMORY_MAX`` per writer thread.
    """
    if skeleton.end > IN_MEMORY_MAX:
        return False
    pieces = sum(len(f.sources) for f in fills)
    return (
        pieces >= IN_MEMORY_MIN_RUNS
        and sum(f.nbytes for f in fills) < MAP_MIN * pieces
        and all(Copier.copies_only(f) for f in fills)
    )


def _write_torch_in_memory(
    path: str,
    skeleton: Skeleton,
    fills: List[Fill],
    copier: Copier,
    progress: Optional[Progress],
    hashes: Optional[Hashes],
) -> None:
    buf = bytearray(skeleton.end)
    view = memoryview(buf)
    try:
        for at, data in skeleton.runs:
            view[at : at + len(data)] = data
        for fill in fills:
            if not _laid_out(skeleton, fill):
                continue
            at = skeleton.offsets[id(fill)]
            copier.fill_memory(view[at : at + fill.nbytes], fill)
            if progress:
                progress(fill.nbytes)
        for start, size, where in skeleton.crcs:
            set_crc(view, crc32(view[start : start + size]), where)
        fd = open_empty(path)
        try:
            done = 0
            while done < len(buf):
                done += os.pwrite(fd, view[done:], done)
            if hashes is not None:
                hashes.hashed(path, fd, view)
        finally:
            os.close(fd)
    finally:
        view.release()


def torch_skips_data() -> bool:
    """Whether torch.save can lay out a file without writing tensor data (``skip_data``, torch 2.5+)."""
    import torch

    return hasattr(torch.serialization, "skip_data")


def _laid_out(skeleton: Skeleton, fill: Fill) -> bool:
    """Whether ``fill`` has a place in the file: a ShardedTensor past the last chunk pickles no shard."""
    if id(fill) in skeleton.offsets:
        return True
    if fill.nbytes:
        raise AssertionError("a tensor with data left out of the file's layout")
    return False


def _torch_skeleton(
    path: str, tree: Any, trust_pickles: bool, place: Optional[MeshPlace] = None
) -> Dict[int, Tuple[int, Fill]]:
    """torch.save's own layout of ``tree`` (placeholders under skip_data); each Fill's data offset, by id.
    DTensorFills become DTensors (ShardedTensors) of a fake mesh at ``place``."""
    kinds = {x.sharded_tensor for _, x in leaves(tree) if isinstance(x, DTensorFill)}
    if not kinds:
        return _torch_layout(path, tree, trust_pickles, None)
    if place is None:
        raise AssertionError("a DTensorFill needs a place in a mesh")
    from .dtensor_mesh import fake_mesh

    with fake_mesh(place.world, place.rank, False in kinds, place.mesh_shape, place.dim_names) as mesh:
        return _torch_layout(path, tree, trust_pickles, mesh)


def _torch_layout(path: str, tree: Any, trust_pickles: bool, mesh: Any) -> Dict[int, Tuple[int, Fill]]:
    import torch

    from .dtensor_mesh import dtensor_of, sharded_tensor_of

    fakes: Dict[int, torch.Tensor] = {}
    dtensors = False

    def to_fake(leaf: Any) -> Any:
        nonlocal dtensors
        if isinstance(leaf, TensorRef):
            raise AssertionError("TensorRef left in an output tree: wrap it in a Fill")
        if isinstance(leaf, Size):
            return torch.Size(leaf)
        if isinstance(leaf, DTensorFill):
            dtensors = True
            if id(leaf) not in fakes:
                local = placeholder(leaf.local.shape, leaf.local.dtype)
                if leaf.sharded_tensor:
                    fakes[id(leaf)] = sharded_tensor_of(local, mesh, leaf.shape, leaf.placements, leaf.requires_grad)
                else:
                    fakes[id(leaf)] = dtensor_of(local, mesh, leaf.shape, leaf.placements)
            return fakes[id(leaf)]
        if not isinstance(leaf, Fill):
            return leaf
        if id(leaf) not in fakes:
            fakes[id(leaf)] = placeholder(leaf.shape, leaf.dtype)
        return fakes[id(leaf)]

    skeleton = map_leaves(tree, to_fake)
    # skip_data would leave every storage unwritten, a DeviceMesh's own rank tensor too: with DTensors torch
    # writes them all, the placeholders' (untouched, so unallocated) zeros filled over next, as before torch 2.5.
    meshes = any(isinstance(x, DTensorFill) and not x.sharded_tensor for _, x in leaves(tree))
    with open(path, "wb") as f:
        if torch_skips_data() and not meshes:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(skeleton, f)
        else:
            torch.save(skeleton, f)
    del skeleton
    fakes.clear()
    # Read the skeleton's pickle back to learn where each tensor's bytes go.
    if dtensors or not torch_gives_offsets():  # ckptshard's reader gives a DTensor's local offset
        placed = own_refs(path, trust_pickles=trust_pickles)
    elif trust_pickles:
        placed = torch.load(path, map_location="meta", weights_only=False)
    else:
        with safe_globals():
            placed = torch.load(path, map_location="meta", weights_only=True)
    targets: Dict[int, Tuple[int, Fill]] = {}
    for (p1, leaf), (p2, meta) in zip(leaves(tree), leaves(placed)):
        if isinstance(leaf, DTensorFill) and isinstance(meta, DTensorRef) and p1 == p2:
            targets[id(leaf.local)] = (meta.local.offset, leaf.local)
            continue
        if not isinstance(leaf, Fill) or id(leaf) in targets:
            continue
        if isinstance(meta, TensorRef) and p1 == p2:
            targets[id(leaf)] = (meta.offset, leaf)
            continue
        if p1 != p2 or not isinstance(meta, torch.Tensor):
            raise AssertionError(f"skeleton structure differs at {p1} / {p2}")
        base = meta.untyped_storage()._checkpoint_offset
        targets[id(leaf)] = (int(base) + meta.storage_offset() * meta.element_size(), leaf)
    del placed
    return targets


def write_skeleton(path: str, tree: Any) -> Skeleton:
    """Write ``tree`` as torch.save would, tensor data left as holes: each Fill's data offset (by id), and
    where each tensor record's CRC goes (the writer knows: nobody reads the zip back to find out)."""
    skeleton = lay_out_zip(tree)
    write_laid_out(path, skeleton)
    return skeleton


def write_laid_out(path: str, skeleton: Skeleton) -> None:
    """Write ``skeleton``'s bytes to a new file at ``path``, its tensor data left as holes."""
    fd = open_empty(path)
    try:
        preallocate(fd, skeleton.end)
        # One write per run, not a seek and a write per zip field: those queue behind busy copy threads.
        for at, data in skeleton.runs:
            os.pwrite(fd, data, at)
    finally:
        os.close(fd)


def save_plain(path: str, obj: Any) -> None:
    """``torch.save(obj, path)`` for an object without tensors (e.g. VISSL's shard_list), torch-free if possible."""
    try:
        write_skeleton(path, obj)
    except Unsupported:
        import torch

        torch.save(obj, path)

"""Open a sharded checkpoint: every rank's file, its container and layout.

Opening reads only the pickles (tensors stay on disk as TensorRefs), checks
that the ranks agree with each other, and builds the layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..errors import CheckpointError
from ..formats.torch_pickle import Unsupported
from ..layout.chunking import padding
from ..layout.model import Part, ShardedLayout, layout_from_metadata
from ..tensors import TensorRef
from ..tree import get_path, leaves
from .containers import Container, PartSpec, detect
from .discover import ShardFiles, find_shards
from .safe_load import load_lazy
from .tensor_data import read_scalar
from .torch_file import read_torch_file, torch_free_allowed


@dataclass
class ShardedCheckpoint:
    files: ShardFiles
    container: Container
    objs: List[Any]  # each rank's unpickled file; tensors are TensorRefs
    layout: ShardedLayout
    trust_pickles: bool = False
    # Checks and plans computed once and asked for per output file (plan.optimizer.check_optimizer).
    memo: Dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def local_state(self, rank: int, part_index: int) -> Mapping[str, TensorRef]:
        return get_path(self.objs[rank], self.container.parts[part_index].weights)

    def optimizer_state(self, rank: int) -> Optional[Mapping[str, Any]]:
        if self.container.optimizer is None:
            return None
        return get_path(self.objs[rank], self.container.optimizer)

    def extra_keys(self, part_index: int) -> List[str]:
        """Stored tensors that are neither flat params, their aliases nor buffers: carried as is."""
        part = self.layout.parts[part_index]
        known = (
            {inst.local_key(fp) for inst, fp in part.flat_params()}
            | set(part.buffer_keys)
            | {a for a, _ in part.aliases}
        )
        return [k for k in self.local_state(0, part_index) if k not in known]


def _check_state_dict(sd: Any, where: str) -> Mapping[str, TensorRef]:
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{where}: local state dict is a {type(sd).__name__}, not a dict")
    for k, v in sd.items():
        if not isinstance(v, TensorRef):
            raise CheckpointError(f"{where}: local state dict entry {k!r} is not a tensor")
    return sd


def _load_all(paths: Tuple[str, ...], trust_pickles: bool, torch_free: bool) -> List[Any]:
    """Every rank's file unpickled, tensors as TensorRefs.

    ``torch_free``: try the torch-free reader first (see formats/torch_pickle.py);
    if it cannot read any one file, every file goes through torch.load, so
    one checkpoint's dtypes are all of one kind. ``CKPTSHARD_TORCH_READER=1``
    turns the torch-free reader off.
    """
    if torch_free and not trust_pickles and torch_free_allowed():
        try:
            return [read_torch_file(p) for p in paths]
        except Unsupported:
            pass
    return [load_lazy(p, trust_pickles) for p in paths]


def open_checkpoint(src: str, trust_pickles: bool = False, torch_free: bool = False) -> ShardedCheckpoint:
    """Open a sharded checkpoint: every rank's pickle (no tensor data), its container and layout, checked.

    Args:
        src: a folder of shards, one shard file (its siblings are found) or a VISSL shard_list file.
        trust_pickles: unpickle without the weights-only safety net (files you trust only).
        torch_free: read the pickles without importing torch where possible; tensors' dtypes are then
            ``StoredDType``s, and writers lay out .pt files without torch too.

    Returns:
        ``ShardedCheckpoint``: ``files``, ``container``, ``layout`` (parts, FSDP instances, flat
        parameters), ``world_size``, and each rank's objects with tensors as ``TensorRef``s.

    Raises:
        CheckpointError: a missing, extra or damaged shard, ranks that disagree (metadata, padding,
            buffers, progress counters), metadata that does not describe the data.
    """
    files = find_shards(src)
    objs = _load_all(files.paths, trust_pickles, torch_free)
    container = detect(objs[0], files.paths[0])
    for r, obj in enumerate(objs[1:], start=1):
        other = detect(obj, files.paths[r])
        if other != container:
            raise CheckpointError(f"{files.paths[r]}: a {other.kind} file among {container.kind} shards")
    parts = [_part_layout(files, objs, spec) for spec in container.parts]
    ckpt = ShardedCheckpoint(files, container, objs, ShardedLayout(len(objs), tuple(parts)), trust_pickles)
    check_same_save(ckpt)
    return ckpt


# Values that identify one save of one run, where the container has them.
_PROGRESS_PATHS = {
    "fairseq": [
        ("optimizer_history", -1, "num_updates"),
        ("extra_state", "epoch"),
        ("extra_state", "train_iterator", "epoch"),
        ("extra_state", "train_iterator", "iterations_in_epoch"),
    ],
    "metaseq": [
        ("optimizer_history", -1, "num_updates"),
        ("extra_state", "epoch"),
        ("extra_state", "train_iterator", "epoch"),
        ("extra_state", "train_iterator", "iterations_in_epoch"),
    ],
    "vissl": [("iteration",), ("phase_idx",), ("train_phase_idx",), ("type",)],
    "plain": [("step",), ("iteration",), ("epoch",)],
}


def _progress_values(ckpt: ShardedCheckpoint, rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for path in _PROGRESS_PATHS.get(ckpt.container.kind, []):
        try:
            v = get_path(ckpt.objs[rank], path)
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[".".join(map(str, path))] = v
    osd = ckpt.optimizer_state(rank)
    if isinstance(osd, Mapping) and isinstance(osd.get("state"), Mapping):
        for pid, entry in sorted(osd["state"].items(), key=lambda kv: str(kv[0]))[:1]:
            step = entry.get("step") if isinstance(entry, Mapping) else None
            if isinstance(step, TensorRef) and step.numel == 1:
                step = read_scalar(step)
            if isinstance(step, (int, float)):
                out[f"optimizer step of entry {pid}"] = float(step)
    return out


def check_same_save(ckpt: ShardedCheckpoint) -> None:
    """Refuse shards from different steps or runs: progress counters must agree on every rank."""
    want = _progress_values(ckpt, 0)
    for r in range(1, ckpt.world_size):
        got = _progress_values(ckpt, r)
        for key in sorted(set(want) | set(got)):
            if want.get(key) != got.get(key):
                raise CheckpointError(
                    f"{ckpt.files.paths[r]}: {key} is {got.get(key)!r} but rank 0 has {want.get(key)!r}: "
                    "shards from different steps or runs"
                )


def _aliases(part: Part, sds: List[Mapping[str, TensorRef]]) -> Tuple[Tuple[str, str], ...]:
    """Stored keys that are, on every rank, the very tensor of an unflattened parameter (same storage and view).

    FSDP with ``flatten_parameters=False`` shards a tied parameter once, in
    place, and ``state_dict`` then lists the one tensor under both names;
    torch.save keeps it one storage. Its metadata names only the first.
    """
    unflat = [inst.local_key(fp) for inst, fp in part.flat_params() if not fp.flattened]
    known = {inst.local_key(fp) for inst, fp in part.flat_params()} | set(part.buffer_keys)
    out = []
    for key in sds[0]:
        if key not in known:
            target = next((t for t in unflat if all(sd.get(key) == sd[t] for sd in sds)), None)
            if target is not None:
                out.append((key, target))
    return tuple(out)


def _part_layout(files: ShardFiles, objs: List[Any], spec: PartSpec) -> Part:
    sds = [_check_state_dict(get_path(o, spec.weights), f"{p} [{spec.label}]") for o, p in zip(objs, files.paths)]
    metas = [get_path(o, spec.metadata) for o in objs]
    numels = [{k: v.numel for k, v in sd.items()} for sd in sds]
    dtypes = {k: v.dtype for k, v in sds[0].items()}
    part = layout_from_metadata(spec.label, spec.prefix, metas, numels, dtypes)
    # local_metadata_dict() lists every named buffer, state_dict() only the
    # persistent ones: a listed buffer no rank stored is non-persistent.
    part = dataclasses.replace(
        part,
        unstored_buffers=tuple(b for b, k in zip(part.buffers, part.buffer_keys) if not any(k in sd for sd in sds)),
        aliases=_aliases(part, sds),
    )
    for r, sd in enumerate(sds):
        for name in part.stored_buffers:
            if name not in sd:
                raise CheckpointError(
                    f"{files.paths[r]} [{spec.label}]: buffer {name!r} stored by other ranks, not this one"
                )
        for inst, fp in part.flat_params():
            ref = sd[inst.local_key(fp)]
            if ref.dtype != fp.dtype:
                raise CheckpointError(f"{files.paths[r]}: {inst.local_key(fp)} is {ref.dtype}, rank 0 has {fp.dtype}")
            if ref.shape != fp.local_shape(len(objs)) and not inst.no_broadcast_optim_state:
                raise CheckpointError(
                    f"{files.paths[r]}: {inst.local_key(fp)} has shape {list(ref.shape)}, "
                    f"FSDP stores {list(fp.local_shape(len(objs)))}"
                )
            if not ref.contiguous:
                raise CheckpointError(f"{files.paths[r]}: {inst.local_key(fp)} is not stored contiguously")
        for name in part.stored_buffers:
            if (sd[name].shape, sd[name].dtype) != (sds[0][name].shape, sds[0][name].dtype):
                raise CheckpointError(
                    f"{files.paths[r]} [{spec.label}]: buffer {name!r} is {sd[name].dtype} "
                    f"{list(sd[name].shape)}, rank 0 has {sds[0][name].dtype} "
                    f"{list(sds[0][name].shape)}"
                )
    check_padding_zero(part, sds, files.paths)
    return part


def _nonzero(raw: bytes, itemsize: int, floating: bool) -> bool:
    """True if ``raw`` (little-endian elements) holds a value other than zero (or, for floats, -0.0)."""
    if not floating:
        return any(raw)
    return any(b & 0x7F if i % itemsize == itemsize - 1 else b for i, b in enumerate(raw))


def check_padding_zero(part: Part, sds: List[Mapping[str, TensorRef]], paths: Tuple[str, ...]) -> None:
    """Refuse a shard whose padding holds values: FSDP pads with zeros, which training keeps zero.

    Metadata that lies about where the padding starts (a member made
    smaller, the padding made larger by as much) is self-consistent
    arithmetic; only the data shows it, as values where padding should be.
    """
    world = len(sds)
    for r, sd in enumerate(sds):
        fd = None
        try:
            for inst, fp in part.flat_params():
                pad = 0 if inst.no_broadcast_optim_state else padding(fp.numel, world, r)
                if not pad:
                    continue
                ref = sd[inst.local_key(fp)]
                if fd is None:
                    fd = os.open(ref.path, os.O_RDONLY)
                start = ref.offset + (ref.numel - pad) * ref.itemsize
                raw = os.pread(fd, pad * ref.itemsize, start)
                if len(raw) < pad * ref.itemsize:
                    raise CheckpointError(f"{paths[r]}: truncated: tensor data ends early at byte {start + len(raw)}")
                if _nonzero(raw, ref.itemsize, "float" in str(ref.dtype)):
                    raise CheckpointError(
                        f"{paths[r]} [{part.label}]: {inst.local_key(fp)}: its last {pad} elements are padding "
                        "by the metadata but hold values: the metadata's names, shapes or padding do not "
                        "describe this data"
                    )
        finally:
            if fd is not None:
                os.close(fd)


def fingerprint(ckpt: ShardedCheckpoint) -> str:
    """A short hash of what identifies the checkpoint: layout and non-tensor values of rank 0."""
    h = hashlib.sha256()
    h.update(repr(ckpt.layout).encode())
    for path, leaf in leaves(ckpt.objs[0]):
        if isinstance(leaf, TensorRef):
            h.update(repr((path, leaf.dtype, leaf.shape)).encode())
        else:
            h.update(repr((path, leaf)).encode())
    return h.hexdigest()[:16]

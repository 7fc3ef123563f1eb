"""The layout of a fairscale sharded checkpoint, read from its metadata.

A checkpoint has one or more *parts*, each an FSDP root that saved its own
``local_state_dict()`` and ``local_metadata_dict()`` (fairseq and metaseq have
one part; VISSL saves the trunk and each head separately). A part holds FSDP
*instances*; an instance holds *flat params* (``flat_param_0``, or one per
parameter with ``flatten_parameters=False``); a flat param is the
concatenation of its *members*, the logical parameters.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..dtypes import Size
from ..errors import CheckpointError
from .chunking import chunk_size, padding


def join(*names: str) -> str:
    return ".".join(n for n in names if n)


# Wrapper modules whose state-dict hooks drop their own attribute name from every key below them:
# fairscale's (its metadata drops these too) and torch's activation checkpoint/offload wrappers
# (``checkpoint_wrapper``), whose name fairscale's metadata keeps in fsdp_path, parameter and buffer
# names although state_dict() and local_state_dict() both leave it out.
HIDDEN_BY_STATE_DICT = ("_fsdp_wrapped_module", "_fpw_module", "_checkpoint_wrapped_module")


def state_dict_name(name: str) -> str:
    """A module path as ``state_dict()`` spells it: hook-hidden wrapper names left out."""
    if "_wrapped_module" not in name and "_fpw_module" not in name:
        return name
    return ".".join(p for p in name.split(".") if p not in HIDDEN_BY_STATE_DICT)


@dataclass(frozen=True)
class Member:
    """One logical parameter inside a flat param."""

    name: str  # relative to the instance, as in the metadata
    shape: Tuple[int, ...]
    offset: int  # first element inside the flat param
    numel: int


@dataclass(frozen=True)
class FlatParam:
    key: str  # backing name in the metadata: "flat_param_0", or "weight"
    members: Tuple[Member, ...]
    numel: int
    dtype: Any  # torch.dtype, or StoredDType (see ckptshard.dtypes)

    def shard_numel(self, world_size: int) -> int:
        return chunk_size(self.numel, world_size)

    @property
    def flattened(self) -> bool:
        return self.key.startswith("flat_param")

    def local_shape(self, world_size: int) -> Tuple[int, ...]:
        """Shape of each rank's stored tensor: FSDP leaves an unflattened
        parameter in its own shape at world size 1 (it is not sharded)."""
        if world_size == 1 and not self.flattened and len(self.members) == 1:
            return self.members[0].shape
        return (self.shard_numel(world_size),)


@dataclass(frozen=True)
class FsdpInstance:
    path: str  # fsdp_path, relative to the part's root
    flat_params: Tuple[FlatParam, ...]
    shared: Tuple[Tuple[str, str], ...]  # (src, dst), relative to the instance
    no_broadcast_optim_state: bool
    extra: Tuple[Tuple[str, Any], ...] = ()  # unknown metadata keys, carried as is
    # fairscale before 0.4 wrote another metadata shape (is_flat, param_names, num_padded): True or False
    # is its is_flat, and the metadata is written back in that shape; None for 0.4's
    legacy_flat: Optional[bool] = field(default=None, repr=False)

    def local_key(self, fp: FlatParam) -> str:
        """The flat param's key in ``local_state_dict()``."""
        return state_dict_name(join(self.path, fp.key))

    def logical_name(self, name: str) -> str:
        """A member's (or tie's) name in ``state_dict()``; ``path`` stays as the metadata has it."""
        return state_dict_name(join(self.path, name))


@dataclass(frozen=True)
class Part:
    """One FSDP root's saved state: its instances and replicated buffers."""

    label: str  # "model", "trunk", "heads.0"
    prefix: str  # logical names of this part start with it: "", "trunk.", "heads.0."
    instances: Tuple[FsdpInstance, ...]
    buffers: Tuple[str, ...]  # as the metadata lists them (see buffer_keys)
    unstored_buffers: Tuple[str, ...] = ()  # listed, never stored: non-persistent
    # Both below are derived from the stored keys, which the fingerprint hashes already: kept out of
    # repr (and so of the fingerprint) so that it stays what earlier versions computed.
    # (stored key, local key of the unflattened parameter it is): a tie inside an unflattened
    # instance, which FSDP stores under both names but lists in neither params nor shared_param_info.
    aliases: Tuple[Tuple[str, str], ...] = field(default=(), repr=False)
    # Stored keys in the order the rank's state dict lists them, which is the order of
    # model.parameters() and so of optimizer entries: an unflattened instance's own parameters
    # interleave with its child instances' flat params.
    stored_order: Tuple[str, ...] = field(default=(), repr=False)

    @property
    def buffer_keys(self) -> Tuple[str, ...]:
        """Every listed buffer, named as the state dicts name it."""
        return tuple(state_dict_name(b) for b in self.buffers)

    @property
    def stored_buffers(self) -> Tuple[str, ...]:
        """The persistent buffers, named as the state dicts name them."""
        return tuple(state_dict_name(b) for b in self.buffers if b not in self.unstored_buffers)

    def flat_params(self) -> List[Tuple[FsdpInstance, FlatParam]]:
        """Every flat param in the order optimizers number them (the stored order, where known)."""
        return list(self._flat_params)

    @functools.cached_property
    def _flat_params(self) -> Tuple[Tuple[FsdpInstance, FlatParam], ...]:
        # Computed once: plans ask for it per output file, and a model has thousands of flat params.
        pairs = [(inst, fp) for inst in self.instances for fp in inst.flat_params]
        if self.stored_order:
            pos = {k: i for i, k in enumerate(self.stored_order)}
            pairs.sort(key=lambda p: pos.get(p[0].local_key(p[1]), len(pos)))
        return tuple(pairs)


@dataclass(frozen=True)
class ShardedLayout:
    world_size: int
    parts: Tuple[Part, ...]

    def flat_params(self) -> List[Tuple[Part, FsdpInstance, FlatParam]]:
        """Every flat param, in the order optimizers number them."""
        return list(self._flat_params)

    @functools.cached_property
    def _flat_params(self) -> Tuple[Tuple[Part, FsdpInstance, FlatParam], ...]:
        return tuple((part, inst, fp) for part in self.parts for inst, fp in part.flat_params())

    def per_rank_instances(self) -> List[str]:
        """Instances each rank holds whole, with its own values (``no_broadcast_optim_state``, e.g. MoE experts)."""
        return [p.prefix + (i.path or "<root>") for p in self.parts for i in p.instances if i.no_broadcast_optim_state]

    def param_names(self) -> List[str]:
        return [part.prefix + inst.logical_name(m.name) for part, inst, fp in self.flat_params() for m in fp.members]


def _shape(s: Any) -> Tuple[int, ...]:
    return tuple(int(x) for x in s)


_KNOWN_INSTANCE_KEYS = {"fsdp_path", "params", "shared_param_info", "no_broadcast_optim_state"}
_LEGACY_KEYS = {"is_flat", "num_padded", "param_names", "param_shapes", "param_numels"}


def _legacy_params(entry: Mapping[str, Any], where: str) -> Dict[str, Any]:
    """fairscale 0.3's instance metadata as 0.4's ``params``: one ``flat_param`` holding every parameter
    (``is_flat``), or each parameter its own, unflattened, with its own padding."""
    try:
        names, shapes = list(entry["param_names"]), list(entry["param_shapes"])
        numels, padded = list(entry["param_numels"]), list(entry["num_padded"])
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: fairscale 0.3 param_metadata entry lacks param_names/shapes/numels") from None
    if entry["is_flat"]:
        if len(padded) != 1:
            raise CheckpointError(f"{where}: {entry['fsdp_path']!r}: a flat instance with {len(padded)} paddings")
        return {"flat_param": {"names": names, "shapes": shapes, "numels": numels, "padding": padded[0]}}
    if not len(names) == len(shapes) == len(numels) == len(padded):
        raise CheckpointError(f"{where}: {entry['fsdp_path']!r}: names, shapes, numels and paddings differ in length")
    return {
        n: {"names": [n], "shapes": [s], "numels": [k], "padding": p}
        for n, s, k, p in zip(names, shapes, numels, padded)
    }


def _instance_from_metadata(entry: Mapping[str, Any], dtypes: Mapping[str, Any], where: str) -> FsdpInstance:
    legacy = None
    try:
        path = entry["fsdp_path"]
        if "params" not in entry and "is_flat" in entry:
            legacy = bool(entry["is_flat"])
            params = _legacy_params(entry, where)
        else:
            params = entry["params"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{where}: param_metadata entry lacks fsdp_path/params") from None
    flat_params = []
    for key, info in params.items():
        names, shapes, numels = list(info["names"]), [_shape(s) for s in info["shapes"]], list(info["numels"])
        if not (len(names) == len(shapes) == len(numels)):
            raise CheckpointError(f"{where}: {join(path, key)}: names, shapes and numels differ in length")
        members, offset = [], 0
        for n, s, k in zip(names, shapes, numels):
            if math.prod(s) != k:
                raise CheckpointError(f"{where}: {join(path, n)}: shape {list(s)} does not hold {k} elements")
            members.append(Member(name=n, shape=s, offset=offset, numel=int(k)))
            offset += int(k)
        local_key = state_dict_name(join(path, key))
        if local_key not in dtypes:
            if join(path, key) in dtypes:  # torch 1.11's checkpoint_wrapper had no state-dict hooks yet
                raise CheckpointError(
                    f"{where}: {join(path, key)!r} is stored with a wrapper name that state dicts "
                    "hide since torch 1.12; shards saved before that are not supported"
                )
            raise CheckpointError(f"{where}: metadata names {local_key!r} but the shard has no such tensor")
        flat_params.append(FlatParam(key=key, members=tuple(members), numel=offset, dtype=dtypes[local_key]))
    known = _KNOWN_INSTANCE_KEYS | (_LEGACY_KEYS if legacy is not None else set())
    extra = tuple(sorted((k, v) for k, v in entry.items() if k not in known))
    return FsdpInstance(
        path=path,
        flat_params=tuple(flat_params),
        shared=tuple((str(s), str(d)) for s, d in entry.get("shared_param_info", [])),
        no_broadcast_optim_state=bool(entry.get("no_broadcast_optim_state", False)),
        extra=extra,
        legacy_flat=legacy,
    )


def part_from_metadata(
    label: str, prefix: str, md: Mapping[str, Any], dtypes: Mapping[str, Any], where: str = ""
) -> Part:
    """One rank's ``local_metadata_dict()`` as a layout part, unchecked against other ranks.

    ``dtypes``: the dtype of each stored tensor, by local key. Enough for
    the plan of a live model, whose metadata is the same on every rank.
    """
    where = where or label
    if not isinstance(md, Mapping) or "param_metadata" not in md:
        raise CheckpointError(f"{where}: metadata has no param_metadata")
    instances = tuple(_instance_from_metadata(e, dtypes, where) for e in md["param_metadata"])
    seen = set()
    for inst in instances:
        for fp in inst.flat_params:
            for m in fp.members:
                name = prefix + inst.logical_name(m.name)
                if name in seen:
                    raise CheckpointError(f"{where}: parameter {name!r} is listed twice in the FSDP metadata")
                seen.add(name)
    return Part(
        label=label,
        prefix=prefix,
        instances=instances,
        buffers=tuple(md.get("buffer_names", [])),
        stored_order=tuple(dtypes),
    )


def layout_from_metadata(
    label: str,
    prefix: str,
    metadata: Sequence[Mapping[str, Any]],
    shard_numels: Sequence[Mapping[str, int]],
    dtypes: Mapping[str, Any],
) -> Part:
    """Build one part's layout from every rank's metadata and check they agree.

    ``shard_numels[r][key]`` is the number of elements rank ``r`` stored
    under ``key``; ``dtypes`` the dtype of each stored tensor (rank 0), in
    the order it stored them.
    Raises :class:`CheckpointError` naming the first disagreement.
    """
    world_size = len(metadata)
    md0 = metadata[0]
    part = part_from_metadata(label, prefix, md0, dtypes, f"{label} rank 0")
    instances = part.instances
    for rank in range(world_size):
        where = f"{label} rank {rank}"
        md = metadata[rank]
        entries = md.get("param_metadata") if isinstance(md, Mapping) else None
        if entries is None or len(entries) != len(instances):
            raise CheckpointError(f"{where}: metadata lists a different set of FSDP instances than rank 0")
        for inst, entry in zip(instances, entries):
            if entry.get("fsdp_path") != inst.path:
                raise CheckpointError(f"{where}: FSDP instance {entry.get('fsdp_path')!r} != rank 0's {inst.path!r}")
            params = entry.get("params", {})
            if "params" not in entry and inst.legacy_flat is not None and "is_flat" in entry:
                if bool(entry["is_flat"]) != inst.legacy_flat:
                    raise CheckpointError(f"{where}: {inst.path!r}: is_flat differs from rank 0's")
                params = _legacy_params(entry, where)
            if list(params) != [fp.key for fp in inst.flat_params]:
                raise CheckpointError(f"{where}: {inst.path!r}: parameters differ from rank 0's")
            for fp in inst.flat_params:
                info = params[fp.key]
                if [list(_shape(s)) for s in info["shapes"]] != [list(m.shape) for m in fp.members] or list(
                    info["names"]
                ) != [m.name for m in fp.members]:
                    raise CheckpointError(f"{where}: {inst.local_key(fp)}: names or shapes differ from rank 0's")
                want_pad = 0 if inst.no_broadcast_optim_state else padding(fp.numel, world_size, rank)
                if int(info["padding"]) != want_pad:
                    raise CheckpointError(
                        f"{where}: {inst.local_key(fp)}: padding {info['padding']} but {want_pad} is what "
                        f"{fp.numel} elements on {world_size} ranks give (wrong world size or shard order?)"
                    )
                key = inst.local_key(fp)
                got = shard_numels[rank].get(key)
                want = fp.numel if inst.no_broadcast_optim_state else fp.shard_numel(world_size)
                if got is None:
                    raise CheckpointError(f"{where}: shard has no tensor {key!r}")
                if got != want:
                    raise CheckpointError(
                        f"{where}: {key} holds {got} elements, expected {want}"
                        + _world_size_hint(fp.numel, got, world_size)
                    )
        if list(md.get("buffer_names", [])) != list(md0.get("buffer_names", [])):
            raise CheckpointError(f"{where}: buffer names differ from rank 0's")
    return part


def _world_size_hint(numel: int, per_rank: int, found: int) -> str:
    """Where a shard's size fits another world size than the files found: most likely a file is missing."""
    if per_rank <= 0:
        return ""
    fits = -(-numel // per_rank)  # the fewest ranks that give shards of this size
    if -(-numel // fits) != per_rank or fits == found:
        return ""
    if fits > found:
        return f" on {found} ranks; shards of {per_rank} fit {fits} ranks: is a shard file missing?"
    replicas = (
        f", or are these {found // fits} replicas of a {fits}-rank sharding (pass one replica's files)"
        if found % fits == 0
        else ""
    )
    return f" on {found} ranks; shards of {per_rank} fit {fits} ranks: is there a shard file too many{replicas}?"


def metadata_of(part: Part, world_size: int, rank: int) -> Dict[str, Any]:
    """The ``local_metadata_dict()`` FSDP at ``world_size`` writes on ``rank``."""
    entries = []
    for inst in part.instances:
        if inst.legacy_flat is not None:
            entries.append(_legacy_metadata(inst, world_size, rank))
            continue
        entry: Dict[str, Any] = {"fsdp_path": inst.path, "params": {}}
        entry["no_broadcast_optim_state"] = inst.no_broadcast_optim_state
        entry["shared_param_info"] = [tuple(x) for x in inst.shared]
        for fp in inst.flat_params:
            entry["params"][fp.key] = {
                "names": [m.name for m in fp.members],
                "shapes": [Size(m.shape) for m in fp.members],  # torch.Size once saved
                "numels": [m.numel for m in fp.members],
                "padding": 0 if inst.no_broadcast_optim_state else padding(fp.numel, world_size, rank),
            }
        for k, v in inst.extra:
            entry[k] = v
        entries.append(entry)
    return {"param_metadata": entries, "buffer_names": list(part.buffers)}


def _legacy_metadata(inst: FsdpInstance, world_size: int, rank: int) -> Dict[str, Any]:
    """An instance's metadata in fairscale 0.3's shape, as FSDP 0.3 at ``world_size`` writes it on ``rank``."""
    members = [m for fp in inst.flat_params for m in fp.members]
    pads = [0 if inst.no_broadcast_optim_state else padding(fp.numel, world_size, rank) for fp in inst.flat_params]
    seq: Any = tuple if inst.legacy_flat else list  # as 0.3 writes them: tuples for a flat instance
    entry: Dict[str, Any] = {
        "fsdp_path": inst.path,
        "is_flat": inst.legacy_flat,
        "num_padded": pads,
        "param_names": [m.name for m in members],
        "param_shapes": seq(Size(m.shape) for m in members),
        "param_numels": seq(m.numel for m in members),
        "no_broadcast_optim_state": inst.no_broadcast_optim_state,
    }
    for k, v in inst.extra:
        entry[k] = v
    return entry

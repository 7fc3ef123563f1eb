"""The framework containers fairscale shards are saved in.

A container says where, inside one rank's file, each part's local state
dict, its metadata and the optimizer state live, and how its files are named.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..errors import CheckpointError
from .tree import Path, get_path, has_path


@dataclass(frozen=True)
class PartSpec:
    label: str  # "model", "trunk", "heads.0"
    prefix: str  # prefix of this part's logical names
    weights: Path
    metadata: Path


@dataclass(frozen=True)
class Container:
    kind: str  # fairseq, metaseq, vissl, plain
    parts: Tuple[PartSpec, ...]
    optimizer: Optional[Path]  # None: no optimizer state saved


def _is_metadata(x: Any) -> bool:
    return isinstance(x, Mapping) and "param_metadata" in x


def _find_optimizer(obj: Any, path: Path) -> Optional[Path]:
    """A torch optimizer state dict at ``path`` or one level under it."""
    if not has_path(obj, path):
        return None
    node = get_path(obj, path)
    if isinstance(node, Mapping) and "state" in node and "param_groups" in node:
        return path
    if isinstance(node, Mapping):
        for k, v in node.items():
            if isinstance(v, Mapping) and "state" in v and "param_groups" in v:
                return path + (k,)
    return None


_FAIRSEQ_LIKE = (("fairseq", "fsdp_metadata"), ("metaseq", "shard_metadata"))
_PLAIN_WEIGHTS = ("model", "state_dict", "weights", "model_state_dict")
_PLAIN_META = ("metadata", "meta", "fsdp_metadata", "shard_metadata", "model_metadata")
_PLAIN_OPTIM = ("optimizer", "optim", "optimizer_state", "last_optimizer_state", "optimizer_state_dict")


def detect(obj: Any, where: str) -> Container:
    """Which container ``obj`` (one rank's unpickled file) is.

    Raises a :class:`CheckpointError` naming the keys found where it is none.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{where}: not a checkpoint: holds a {type(obj).__name__}, not a dict")
    keys = sorted(str(k) for k in obj.keys())
    if obj.get("type") == "shard_list":
        raise CheckpointError(f"{where}: a VISSL shard_list file: open it as the source, not as a shard")
    if "classy_state_dict" in obj:
        return _vissl(obj, where)
    for kind, meta_key in _FAIRSEQ_LIKE:
        if meta_key in obj:
            if "model" not in obj:
                raise CheckpointError(f"{where}: {kind} checkpoint without 'model'; keys found: {keys}")
            if not _is_metadata(obj[meta_key]):
                raise CheckpointError(f"{where}: '{meta_key}' is not FSDP metadata (no param_metadata)")
            return Container(
                kind=kind,
                parts=(PartSpec("model", "", ("model",), (meta_key,)),),
                optimizer=_find_optimizer(obj, ("last_optimizer_state",)),
            )
    for wk in _PLAIN_WEIGHTS:
        for mk in _PLAIN_META:
            if wk in obj and mk in obj and _is_metadata(obj[mk]):
                optim = next((p for k in _PLAIN_OPTIM if (p := _find_optimizer(obj, (k,)))), None)
                return Container(kind="plain", parts=(PartSpec("model", "", (wk,), (mk,)),), optimizer=optim)
    if "model" in obj or "last_optimizer_state" in obj:
        raise CheckpointError(
            f"{where}: no FSDP shard metadata (fsdp_metadata or shard_metadata): not a sharded "
            f"checkpoint, or saved without local_metadata_dict(); keys found: {keys}"
        )
    raise CheckpointError(f"{where}: not a fairscale sharded checkpoint; keys found: {keys}")


def _vissl(obj: Mapping[str, Any], where: str) -> Container:
    base = ("classy_state_dict", "base_model")
    if not has_path(obj, base + ("model",)) or not has_path(obj, base + ("meta",)):
        found = sorted(get_path(obj, base).keys()) if has_path(obj, base) else []
        raise CheckpointError(
            f"{where}: VISSL checkpoint without classy_state_dict.base_model.model/meta; found {found}"
        )
    if obj.get("type") != "shard":
        raise CheckpointError(f"{where}: VISSL checkpoint of type {obj.get('type')!r}, not a sharded one")
    model, meta = get_path(obj, base + ("model",)), get_path(obj, base + ("meta",))
    parts: List[PartSpec] = []
    if "trunk" in model:
        if "trunk" not in meta or not _is_metadata(meta["trunk"]):
            raise CheckpointError(f"{where}: VISSL trunk has no FSDP metadata")
        parts.append(PartSpec("trunk", "trunk.", base + ("model", "trunk"), base + ("meta", "trunk")))
    heads = model.get("heads", [])
    for j in range(len(heads)):
        if len(meta.get("heads", [])) <= j or not _is_metadata(meta["heads"][j]):
            raise CheckpointError(f"{where}: VISSL head {j} has no FSDP metadata")
        parts.append(
            PartSpec(f"heads.{j}", f"heads.{j}.", base + ("model", "heads", j), base + ("meta", "heads", j))
        )
    if not parts:
        raise CheckpointError(f"{where}: VISSL checkpoint with neither trunk nor heads")
    return Container(kind="vissl", parts=tuple(parts), optimizer=_find_optimizer(obj, ("classy_state_dict", "optimizer")))


def container_summary(c: Container) -> Dict[str, Any]:
    return {
        "kind": c.kind,
        "parts": [p.label for p in c.parts],
        "optimizer_path": ".".join(map(str, c.optimizer)) if c.optimizer else None,
    }

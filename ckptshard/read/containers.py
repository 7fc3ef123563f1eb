"""The framework containers fairscale shards are saved in.

A container says where, inside one rank's file, each part's local state
dict, its metadata and the optimizer state live, and how its files are named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set, Tuple

from ..errors import CheckpointError
from ..layout.model import join, state_dict_name
from ..tensors import TensorRef
from ..tree import Path, get_path, has_path


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
_PLAIN_OPTIM = ("optimizer", "optim", "optimizer_state", "last_optimizer_state", "optimizer_state_dict")
_SEARCH_DEPTH = 4  # how deep a generic container may nest its state dicts


def detect(obj: Any, where: str) -> Container:
    """Which container ``obj`` (one rank's unpickled file, tensors as TensorRefs) is.

    fairseq, metaseq and VISSL are recognised by their keys; anything else
    is searched for FSDP metadata and the local state dict it describes
    (see :func:`_generic`). Raises a :class:`CheckpointError` naming the keys
    found where it is none.
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{where}: not a checkpoint: holds a {type(obj).__name__}, not a dict")
    keys = sorted(str(k) for k in obj)
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
    found = _generic(obj, where)
    if found is not None:
        return found
    if "model" in obj or "last_optimizer_state" in obj:
        raise CheckpointError(
            f"{where}: no FSDP shard metadata (fsdp_metadata or shard_metadata): not a sharded "
            f"checkpoint, or saved without local_metadata_dict(); keys found: {keys}"
        )
    if any(k.rsplit(".", 1)[-1].startswith("flat_param_") for k in keys):
        raise CheckpointError(
            f"{where}: a local state dict (flat_param_* tensors) without its FSDP metadata: save "
            "local_metadata_dict() in the same file, e.g. {'model': local_state_dict(), 'fsdp_metadata': ...}"
        )
    raise CheckpointError(f"{where}: not a fairscale sharded checkpoint; keys found: {keys}")


def _dotted(path: Path) -> str:
    return ".".join(map(str, path)) or "(top level)"


def _nodes(obj: Any, path: Path = ()) -> Iterator[Tuple[Path, Mapping[str, Any]]]:
    """Every dict in ``obj`` down to ``_SEARCH_DEPTH``, with its path; not inside FSDP metadata."""
    if isinstance(obj, Mapping):
        yield path, obj
        if _is_metadata(obj):
            return
        children: Any = obj.items()
    elif isinstance(obj, list):
        children = enumerate(obj)
    else:
        return
    if len(path) < _SEARCH_DEPTH:
        for k, v in children:
            yield from _nodes(v, path + (k,))


def _local_keys(meta: Mapping[str, Any]) -> Set[str]:
    """The keys FSDP's local_state_dict() holds for this metadata: flat parameters and buffers."""
    keys: Set[str] = set()
    for entry in meta.get("param_metadata") or []:
        if isinstance(entry, Mapping) and isinstance(entry.get("params"), Mapping):
            keys.update(state_dict_name(join(str(entry.get("fsdp_path") or ""), str(k))) for k in entry["params"])
    return keys


def _common(a: Path, b: Path) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _generic(obj: Mapping[str, Any], where: str) -> Optional[Container]:
    """Any other container: each FSDP metadata dict found, paired with the state dict holding its keys.

    A metadata dict has ``param_metadata``; its state dict is the dict of
    tensors that holds every flat parameter the metadata names: one holding
    only those and the metadata's buffers if any does, and among those the
    nearest to it in the tree (a sibling, for ``{"model": ..., "meta": ...}``).
    Two equally near candidates, or two optimizer states, are refused rather
    than guessed.
    """
    nodes = list(_nodes(obj))
    metas = [(p, n) for p, n in nodes if _is_metadata(n)]
    if not metas:
        return None
    tensor_dicts = [(p, n) for p, n in nodes if n and all(isinstance(v, TensorRef) for v in n.values())]
    parts: List[Tuple[Path, Path]] = []
    for mpath, meta in metas:
        buffers = {state_dict_name(str(b)) for b in meta.get("buffer_names") or []}
        want = _local_keys(meta) or buffers
        if not want:
            raise CheckpointError(f"{where}: FSDP metadata at {_dotted(mpath)} lists no parameters or buffers")
        fits = [(p, set(n.keys())) for p, n in tensor_dicts if want <= set(n.keys())]
        if not fits:
            raise CheckpointError(
                f"{where}: FSDP metadata at {_dotted(mpath)}, but no dict of tensors holds its flat parameters "
                f"({', '.join(sorted(want)[:3])}...)"
            )
        # Best: a dict holding nothing but this metadata's flat parameters and
        # buffers; then the one nearest to the metadata in the tree.
        own = want | buffers
        score = {p: (keys <= own, _common(p, mpath)) for p, keys in fits}
        best = max(score.values())
        nearest = [p for p in score if score[p] == best]
        if len(nearest) > 1:
            raise CheckpointError(
                f"{where}: FSDP metadata at {_dotted(mpath)} fits several state dicts "
                f"({', '.join(_dotted(p) for p in nearest)}): cannot tell which it describes"
            )
        parts.append((nearest[0], mpath))
    if len({w for w, _ in parts}) < len(parts):
        raise CheckpointError(f"{where}: several FSDP metadata dicts describe the same state dict")
    specs = tuple(
        PartSpec("model", "", w, m) if len(parts) == 1 else PartSpec(_dotted(w), f"{w[-1]}.", w, m) for w, m in parts
    )
    if len(parts) > 1 and len({s.prefix for s in specs}) < len(specs):
        raise CheckpointError(f"{where}: several FSDP state dicts with the same name: {[s.label for s in specs]}")
    return Container(kind="plain", parts=specs, optimizer=_generic_optimizer(nodes, where))


def _generic_optimizer(nodes: List[Tuple[Path, Mapping[str, Any]]], where: str) -> Optional[Path]:
    found = [p for p, n in nodes if p and "state" in n and "param_groups" in n]
    if len(found) <= 1:
        return found[0] if found else None
    named = [p for p in found if str(p[0]) in _PLAIN_OPTIM]
    if len(named) == 1:
        return named[0]
    raise CheckpointError(
        f"{where}: several optimizer states ({', '.join(_dotted(p) for p in found)}): "
        "cannot tell which belongs to the FSDP model"
    )


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
        parts.append(PartSpec(f"heads.{j}", f"heads.{j}.", base + ("model", "heads", j), base + ("meta", "heads", j)))
    if not parts:
        raise CheckpointError(f"{where}: VISSL checkpoint with neither trunk nor heads")
    return Container(
        kind="vissl", parts=tuple(parts), optimizer=_find_optimizer(obj, ("classy_state_dict", "optimizer"))
    )


def container_summary(c: Container) -> Dict[str, Any]:
    return {
        "kind": c.kind,
        "parts": [p.label for p in c.parts],
        "optimizer_path": ".".join(map(str, c.optimizer)) if c.optimizer else None,
    }

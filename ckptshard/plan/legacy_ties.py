"""Tied parameters of fairscale 0.3.x shards, whose metadata does not record them: which names may be missing,
and each restored from the model's own state dict (``--like``). Pure."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from ..errors import CheckpointError
from ..tensors import Fill


def maybe_missing(names: List[str]) -> List[str]:
    """Weights a tie may have taken out of ``names``: each module listed with a ``bias`` and no ``weight`` (an
    output layer tied to an embedding keeps its own bias)."""
    have = set(names)
    return [
        n[: -len("bias")] + "weight" for n in names if n.endswith("bias") and n[: -len("bias")] + "weight" not in have
    ]


def _storage(ref: Any) -> Any:
    """Equal for two names of one tensor in a torch.save file (same bytes, same view); None where the file
    cannot say (safetensors stores every name apart)."""
    offset = getattr(ref, "offset", None)
    if offset is None or not hasattr(ref, "stride"):
        return None
    return (getattr(ref, "path", None), offset, tuple(ref.shape), tuple(ref.stride), str(ref.dtype))


def restore_ties(
    weights: Mapping[str, Fill], like: Mapping[str, Any], like_path: str
) -> Tuple[Dict[str, Fill], List[str]]:
    """``weights`` with each name of ``like`` that they lack put back as the tensor it is tied to in ``like`` (the
    model's ``state_dict()`` saved by torch.save, where tied names share storage), in ``like``'s order; the
    names restored. Refused where ``like`` is another model's or does not say what a missing name is tied to."""
    extra = [n for n in weights if n not in like]
    if extra:
        raise CheckpointError(
            f"{like_path}: has no {extra[0]!r}, which the shards hold: the state dict of another model"
        )
    by_storage: Dict[Any, List[str]] = {}
    for name, ref in like.items():
        key = _storage(ref)
        if key is not None:
            by_storage.setdefault(key, []).append(name)
    out: Dict[str, Fill] = {}
    restored = []
    for name, ref in like.items():
        if name in weights:
            if tuple(weights[name].shape) != tuple(ref.shape):
                raise CheckpointError(
                    f"{like_path}: {name} is {tuple(ref.shape)}, the shards' {tuple(weights[name].shape)}: "
                    "the state dict of another model"
                )
            out[name] = weights[name]
            continue
        twins = [n for n in by_storage.get(_storage(ref), []) if n in weights]
        if _storage(ref) is None or not twins:
            raise CheckpointError(
                f"{like_path}: {name} is not in the shards, and the file does not tie it to a tensor that is: give "
                "torch.save(model.state_dict()) of the model, whose tied parameters share storage"
            )
        out[name] = weights[twins[0]]
        restored.append(f"{name} (tied to {twins[0]})")
    return out, restored

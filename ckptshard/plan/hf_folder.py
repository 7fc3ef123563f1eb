"""What a Hugging Face model folder holds beside its weights, and which weights ``save_pretrained`` leaves
out. Pure: the config comes in as read (``read.hf_config``), the weights as planned Fills."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..dtypes import FLOATING, dtype_name
from ..tensors import Fill

DEFAULT_SHARD_SIZE = 5 * 10**9  # save_pretrained's "5GB" (transformers 4): files the Hub and its tools take
SINGLE_FILE = "model.safetensors"  # save_pretrained's name when the weights fit one file (no index)
DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers 5 reads "dtype", 4.x "torch_dtype" (4.56+ either)


def _tensor_key(fill: Fill) -> Any:
    """Equal for two names of one tensor: the same Fill, or Fills of the same bytes (families that plan each
    name apart)."""
    if not fill.sources:
        return id(fill)
    try:
        key = (fill.shape, str(fill.dtype), fill.sources)
        hash(key)
    except TypeError:
        return id(fill)
    return key


def tied_groups(weights: Mapping[str, Fill]) -> List[List[str]]:
    """Names that are one tensor (a tied parameter under each of its names), first name first; groups of two
    or more only, in the state dict's order."""
    groups: Dict[Any, List[str]] = {}
    for name, fill in weights.items():
        groups.setdefault(_tensor_key(fill), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def untied(weights: Mapping[str, Fill], config: Mapping[str, Any]) -> Tuple[Dict[str, Fill], List[str]]:
    """``weights`` as ``save_pretrained`` stores them, and a note per name left out.

    A model whose config ties its word embeddings (``tie_word_embeddings``, true where the key is absent, as
    transformers' base config has it) is saved without the tied copies (``lm_head.weight``): transformers ties
    them again when it loads. The first name of each group is kept; the module that owns a tied parameter comes
    first in ``state_dict()`` order (the embedding before the head). Other configs keep every name."""
    if not config.get("tie_word_embeddings", True):
        return dict(weights), []
    dropped: Dict[str, str] = {}
    for group in tied_groups(weights):
        dropped.update(dict.fromkeys(group[1:], group[0]))
    notes = [
        f"{name}: the same tensor as {kept}; left out, as save_pretrained leaves it out (tie_word_embeddings)"
        for name, kept in dropped.items()
    ]
    return {k: v for k, v in weights.items() if k not in dropped}, notes


def written_dtype(weights: Mapping[str, Fill]) -> Optional[str]:
    """The one floating-point dtype the weights are written in (torch's name), or None where there are several
    or none."""
    found = {dtype_name(f.dtype) for f in weights.values()} & FLOATING
    return found.pop() if len(found) == 1 else None


def config_for(config: Mapping[str, Any], weights: Mapping[str, Fill]) -> Tuple[Dict[str, Any], List[str]]:
    """``config.json`` for the weights written: its dtype field says their dtype (transformers loads with
    ``dtype="auto"``, 5.x's default, in the dtype it names), under each key the config has (``dtype``, and
    ``torch_dtype``: both where it has neither). A note where the weights mix floating-point dtypes."""
    dtype = written_dtype(weights)
    if dtype is None:
        mixed = sorted({dtype_name(f.dtype) for f in weights.values()} & FLOATING)
        if len(mixed) < 2:
            return dict(config), []
        return dict(config), [f"config.json: its dtype is kept: the weights mix {', '.join(mixed)}"]
    keys = [k for k in DTYPE_KEYS if k in config] or list(DTYPE_KEYS)
    return {**config, **dict.fromkeys(keys, dtype)}, []

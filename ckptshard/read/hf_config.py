"""A Hugging Face model's files other than its weights: ``config.json``, ``generation_config.json``, the
tokenizer's; verl saves them in ``huggingface/`` beside the rank files, and ``--hf-config DIR`` names any such
folder (a ``save_pretrained`` folder too: its weights are left where they are)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Tuple

from ..errors import CheckpointError
from ..osio.inputs import input_file

CONFIG = "config.json"
JSON_LIMIT = 16 << 20  # bytes of config.json read at most: a real one is a few KiB
# Weights and their indexes in a model folder: the consolidated weights take their place.
WEIGHT_FILE = re.compile(
    r"(\.(safetensors|bin|pt|pth|ckpt|msgpack|h5|gguf|onnx)|\.index\.json|\.manifest\.json|^MANIFEST\.json)$"
)


@dataclass(frozen=True)
class HfConfigDir:
    """``config``: ``config.json`` as read; ``carried``: (name, path) of every other file to copy, in name order."""

    path: str
    config: Dict[str, Any]
    carried: Tuple[Tuple[str, str], ...]


def read_hf_dir(path: str) -> HfConfigDir:
    """The folder ``path``, as one line of error where it has no ``config.json`` transformers could read.

    Each carried file must be a regular file (or a link to one) and is recorded as an input: it is copied
    into the output, so it may not change while the output is written. Sub-folders are not carried."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder: --hf-config names a folder holding config.json")
    config_path = os.path.join(path, CONFIG)
    if not os.path.lexists(config_path):
        raise CheckpointError(f"{path}: no config.json: not a Hugging Face model folder")
    if input_file(config_path).st_size > JSON_LIMIT:
        raise CheckpointError(f"{config_path}: larger than {JSON_LIMIT:,} bytes; not a model's config.json")
    with open(config_path, "rb") as f:
        text = f.read(JSON_LIMIT + 1)
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else "not JSON"
        raise CheckpointError(f"{config_path}: {why}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: a JSON {type(config).__name__}, not a model's config")
    carried = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == CONFIG or WEIGHT_FILE.search(name) or (os.path.isdir(full) and not os.path.islink(full)):
            continue
        input_file(full)
        carried.append((name, full))
    return HfConfigDir(path, config, tuple(carried))

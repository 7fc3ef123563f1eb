"""``verify``: re-check an output against its manifest and its own structure."""
from __future__ import annotations

import os
from typing import List

from ..errors import CheckpointError
from ..io.dcp import is_dcp, open_dcp
from ..io.full_state import full_state_refs
from ..io.manifest import verify_manifest
from ..io.source import open_checkpoint


def verify(path: str) -> List[str]:
    """Problems found (empty: the checkpoint matches its manifest and reads back whole)."""
    problems = verify_manifest(path)
    if problems:
        return problems
    try:
        if is_dcp(path):
            open_dcp(path)  # every chunk's frame reads back with the shape and dtype .metadata names
        elif os.path.isdir(path) and not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
            open_checkpoint(path)  # every rank's metadata, sizes and padding agree
        else:
            full_state_refs(path)
    except CheckpointError as e:
        problems.append(str(e))
    return problems

"""``verify``: re-check an output against its manifest and its own structure."""

from __future__ import annotations

import os
from typing import List

from ..errors import CheckpointError
from ..osio.manifest import verify_manifest
from ..read.dcp import is_dcp, open_dcp
from ..read.full_state import full_state_refs
from ..read.source import open_checkpoint
from ..read.torch_ranks import open_torch_ranks


def verify(path: str) -> List[str]:
    """Re-check an output of ckptshard against its manifest and its own structure.

    Args:
        path: a folder ckptshard wrote (shards, index-sharded safetensors, DCP) or a single output file.

    Returns:
        The problems found, one line each: a file missing, of another size or checksum, or not listed in
        the manifest; metadata that no longer reads back. Empty when all is well.

    Raises:
        CheckpointError: no manifest, or one that is not ckptshard's.
    """
    problems = verify_manifest(path)
    if problems:
        return problems
    try:
        if is_dcp(path):
            open_dcp(path)  # every chunk's frame reads back with the shape and dtype .metadata names
        elif (ranks := open_torch_ranks(path)) is not None:
            if ranks.flat is None:  # LOCAL_STATE_DICT: what the flat parameters hold needs the model (--like)
                ranks.full_model()  # every rank's pieces agree and add up to the whole
                if ranks.optims is not None:
                    ranks.full_optimizer()
        elif os.path.isdir(path) and not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
            open_checkpoint(path)  # every rank's metadata, sizes and padding agree
        else:
            full_state_refs(path)
    except CheckpointError as e:
        problems.append(str(e))
    return problems

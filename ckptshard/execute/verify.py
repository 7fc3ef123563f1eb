"""``verify``: re-check an output against its manifest and its own structure."""

from __future__ import annotations

from typing import List

from ..errors import CheckpointError
from ..osio.manifest import verify_manifest
from ..sources.probe import open_source
from .command import command


@command
def verify(path: str) -> List[str]:
    """Re-check an output of ckptshard against its manifest and its own structure.

    Args:
        path: anything ckptshard writes: a folder (shards of any family, model parts, index-sharded
            safetensors, DCP) or a single output file.

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
        open_source(path, full=True).check()  # opening checks every family's structure; check() the rest
    except CheckpointError as e:
        problems.append(str(e))
    return problems

"""Manifests: sizes and checksums of what ckptshard wrote, and their re-check.

Each file gets its size and XXH3-128 digest (``xxh128sum`` prints the same).
Manifests of earlier ckptshard versions carry BLAKE3 or SHA-256 digests
instead; all three verify.

A folder output carries ``ckptshard-manifest.json`` inside it; a file output
``OUT.manifest.json`` beside it.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional

from .. import __version__
from ..errors import CheckpointError
from .hashing import ALGORITHM, Hashes, new_hash

MANIFEST = "ckptshard-manifest.json"


def _blake3() -> Any:
    import blake3  # only to verify older manifests

    return blake3.blake3()


# What a manifest may carry, newest first: older ones verify with the algorithm they name.
_DIGESTS: Dict[str, Callable[[], Any]] = {ALGORITHM: new_hash, "blake3": _blake3, "sha256": hashlib.sha256}


def file_digest(path: str, algorithm: str = ALGORITHM) -> str:
    """Hex digest of the file at ``path``, read whole (files not hashed while they were written)."""
    h = _DIGESTS[algorithm]()
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(16 << 20)
            if not block:
                return h.hexdigest()
            h.update(block)


def manifest_path(output: str) -> str:
    return os.path.join(output, MANIFEST) if os.path.isdir(output) else output + ".manifest.json"


def build_manifest(root: str, names: List[str], source: Mapping[str, Any], command: str,
                   hashes: Optional[Hashes] = None, digests: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Describe files ``names`` under folder ``root`` (or ``root`` itself when ``names`` is ``[""]``).

    Files hashed while they were written, here (``hashes``) or by the
    worker process or torchrun rank that wrote them (``digests``, by name),
    are not read again.
    """
    files = {}
    for n in names:
        p = os.path.join(root, n) if n else root
        digest = (digests or {}).get(n) or (hashes.digest(p) if hashes else None)
        files[n or os.path.basename(root)] = {"bytes": os.path.getsize(p), ALGORITHM: digest or file_digest(p)}
    return {"ckptshard_version": __version__, "command": command, "source": dict(source), "files": files}


def write_json(path: str, obj: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def verify_manifest(output: str) -> List[str]:
    """Problems found checking ``output`` against its manifest (empty: all good)."""
    mpath = manifest_path(output)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{output}: no manifest ({mpath})")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{mpath}: not a ckptshard manifest") from None
    base = output if os.path.isdir(output) else os.path.dirname(os.path.abspath(output))
    problems = []
    for name, info in sorted(files.items()):
        p = os.path.join(base, name)
        if not os.path.isfile(p):
            problems.append(f"{name}: missing")
        elif os.path.getsize(p) != info["bytes"]:
            problems.append(f"{name}: {os.path.getsize(p)} bytes, manifest says {info['bytes']}")
        else:
            algo = next((a for a in _DIGESTS if isinstance(info.get(a), str)), None)
            if algo is None:
                problems.append(f"{name}: the manifest gives no checksum ckptshard knows ({', '.join(_DIGESTS)})")
            elif file_digest(p, algo) != info[algo]:
                problems.append(f"{name}: checksum differs from the manifest (modified or corrupted)")
    return problems

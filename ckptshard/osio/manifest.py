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

from ..errors import CheckpointError
from ..version import __version__
from .hashing import ALGORITHM, Hashes, new_hash

MANIFEST = "ckptshard-manifest.json"


def _blake3() -> Any:
    try:
        import blake3  # only manifests of an unreleased format carry BLAKE3: an optional package
    except ImportError:
        raise CheckpointError("this manifest's checksums are BLAKE3: pip install blake3 to verify it") from None
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


def manifest_path_of_file(output: str) -> str:
    """Where a single-file output's manifest lies: beside it."""
    return output + ".manifest.json"


def manifest_path(output: str) -> str:
    return os.path.join(output, MANIFEST) if os.path.isdir(output) else manifest_path_of_file(output)


def read_manifest_files(path: str) -> Optional[Dict[str, Any]]:
    """The ``files`` entry of the ckptshard manifest at ``path``; None if there is none or it is not one."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(manifest, dict) or "ckptshard_version" not in manifest:
        return None
    files = manifest.get("files")
    return files if isinstance(files, dict) else None


def _owned_folder_problem(final: str) -> Optional[str]:
    files = read_manifest_files(os.path.join(final, MANIFEST))
    if files is None:
        return f"has no ckptshard manifest ({MANIFEST})"
    cwd = os.path.realpath(os.getcwd())
    real = os.path.realpath(final)
    if cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        return "holds the current folder"
    others = _unlisted(final, files, True)
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return f"holds files its manifest does not list ({shown})"
    return None


def _unlisted(output: str, files: Mapping[str, Any], is_dir: bool) -> List[str]:
    """What the output holds that its manifest does not vouch for: a file, a link or an empty folder of a
    folder output (ckptshard writes none of the latter two), or the file itself."""
    if not is_dir:
        return [] if os.path.basename(output) in files else [os.path.basename(output)]
    out = []
    for root, dirs, names in os.walk(output):
        if root != output and not dirs and not names:
            out.append(os.path.relpath(root, output) + os.sep)
        out += [
            os.path.relpath(os.path.join(root, d), output) + os.sep
            for d in dirs
            if os.path.islink(os.path.join(root, d))
        ]
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), output)
            if rel != MANIFEST and rel not in files:
                out.append(rel)
    return sorted(out)


def check_replaceable(final: str, is_dir: bool) -> None:
    """Refuse to replace anything but a ckptshard output: a folder holding its manifest and only the files
    it lists, or a file that its ``OUT.manifest.json`` lists. User files are never deleted by --overwrite."""
    if os.path.islink(final):
        problem: Optional[str] = "is a symbolic link"
    elif os.path.isdir(final):
        problem = _owned_folder_problem(final) if is_dir else "is a folder, and the output is a file"
    elif not os.path.isfile(final):
        problem = "is not a regular file"
    elif is_dir:
        problem = "is a file, and the output is a folder"
    else:
        files = read_manifest_files(manifest_path_of_file(final))
        problem = (
            None
            if files is not None and os.path.basename(final) in files
            else f"has no ckptshard manifest ({os.path.basename(manifest_path_of_file(final))}) listing it"
        )
    if problem:
        raise CheckpointError(
            f"{final}: exists and {problem}: --overwrite replaces only what ckptshard wrote; move or remove it yourself"
        )


def build_manifest(
    root: str,
    names: List[str],
    source: Mapping[str, Any],
    command: str,
    hashes: Optional[Hashes] = None,
    digests: Optional[Mapping[str, str]] = None,
) -> Dict[str, Any]:
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
    files = read_manifest_files(mpath)
    if files is None or not all(isinstance(i, dict) and isinstance(i.get("bytes"), int) for i in files.values()):
        raise CheckpointError(f"{mpath}: not a ckptshard manifest")
    is_dir = os.path.isdir(output)
    base = output if is_dir else os.path.dirname(os.path.abspath(output))
    problems = [f"{name}: not listed in the manifest" for name in _unlisted(output, files, is_dir)]
    for name, info in sorted(files.items()):
        p = os.path.join(base, name)
        if (os.path.basename(name) != name and not is_dir) or os.path.isabs(name) or ".." in name.split("/"):
            problems.append(f"{name}: the manifest names a file outside the output")
        elif not os.path.isfile(p):
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

"""torch's DTensor pickles for a mesh (``dtensor_mesh.mesh_template``), kept on disk between runs.

Making one costs torch's import and a fake process group: seconds, on
every reshard to an HSDP mesh, for a few KiB that depend only on the
installed torch, the mesh and the placements. Each is kept under
``$CKPTSHARD_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ckptshard``, else
``~/.cache/ckptshard``), named by a digest of those; ``CKPTSHARD_NO_CACHE=1``
turns the cache off.

The installed torch is told apart without importing it: its ``version.py``
(version and git commit) and the size and time of the files that shape a
mesh's pickle. An entry is torch's own ``torch.save`` file, read back by
ckptshard's reader (no pickled code runs), beside a JSON file of the mesh's
tensors' bytes and the file's digest: an entry that does not read back is
made again, never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from typing import Dict, Optional, Tuple

from ..dtypes import StoredDType
from ..formats.torch_names import Literal

_SHAPING = ("version.py", "distributed/device_mesh.py", "distributed/tensor/_dtensor_spec.py")


def cache_dir() -> Optional[str]:
    """Where entries live; None when ``CKPTSHARD_NO_CACHE`` is set."""
    if os.environ.get("CKPTSHARD_NO_CACHE", "") not in ("", "0"):
        return None
    root = os.environ.get("CKPTSHARD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ckptshard"
    )
    return os.path.join(root, "mesh-templates")


def torch_identity() -> Optional[str]:
    """A digest of the installed torch, found without importing it; None where no torch is found."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    root = os.path.dirname(spec.origin)
    h = hashlib.sha256(root.encode())
    try:
        with open(os.path.join(root, "version.py"), "rb") as f:
            h.update(f.read())
        for name in _SHAPING:
            st = os.stat(os.path.join(root, name))
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError:
        return None
    return h.hexdigest()


def entry_key(*parts: object) -> Optional[str]:
    """The name of the entry for ``parts`` (mesh and placements) under this torch; None: no cache."""
    torch_id = torch_identity() if cache_dir() is not None else None
    if torch_id is None:
        return None
    return hashlib.sha256(repr((torch_id, *parts)).encode()).hexdigest()[:40]


def load(key: str) -> Optional[Tuple[str, Dict[str, Literal]]]:
    """The entry's torch file and the mesh tensors' bytes, or None where it is missing or does not read back."""
    folder = cache_dir()
    if folder is None:
        return None
    pt = os.path.join(folder, key + ".pt")
    try:
        with open(os.path.join(folder, key + ".json"), encoding="utf-8") as f:
            meta = json.load(f)
        with open(pt, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != meta["sha256"]:
                return None
        tensors = {
            name: Literal(tuple(shape), StoredDType(dtype), bytes.fromhex(data))
            for name, (shape, dtype, data) in meta["tensors"].items()
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return pt, tensors


def store(key: str, pt: str, tensors: Dict[str, Literal]) -> None:
    """Keep ``pt`` (a torch file) and ``tensors`` as entry ``key``; a cache that cannot be written is skipped."""
    folder = cache_dir()
    if folder is None:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        with open(pt, "rb") as f:
            data = f.read()
        meta = {
            "sha256": hashlib.sha256(data).hexdigest(),
            "tensors": {k: [list(v.shape), v.dtype.name, v.data.hex()] for k, v in tensors.items()},
        }
        # The JSON names the file's digest: written first, a pair left half-replaced reads as a miss.
        _replace_with(os.path.join(folder, key + ".json"), json.dumps(meta).encode())
        _replace_with(os.path.join(folder, key + ".pt"), data)
    except OSError:
        return


def _replace_with(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

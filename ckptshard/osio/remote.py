"""Checkpoints in object storage (``s3://``, ``gs://``, ``az://``... any fsspec URL): listed, fetched and
published through fsspec, every failure one line.

Stores have no rename, so an output is published in an order a reader can
rely on: a marker object beside the output first (``OUT.ckptshard-writing``,
listing every key the run will write), then the data objects, then the
manifests, then the marker is removed. A reader that starts from a manifest
never sees a partial output; a run killed at any point leaves the marker, and
the next run on the same output removes what it lists (and aborts the
multipart uploads under it) before writing. ``--overwrite`` removes the old
manifest first, so no reader trusts a mixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..errors import CheckpointError, InputChanged, OutputExists

URL = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://")
MARKER = ".ckptshard-writing"  # beside the output: OUT.ckptshard-writing
MANIFEST_NAMES = ("ckptshard-manifest.json", ".manifest.json")  # a folder's, a single file's (OUT.manifest.json)
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
# botocore's own retries (throttling, 5xx, timeouts), on top of s3fs's: unless the user's options say otherwise.
S3_DEFAULTS: Dict[str, Any] = {"config_kwargs": {"retries": {"max_attempts": 8, "mode": "standard"}}}
# The memory a transfer holds, whatever the checkpoint's size. Uploads: 2 files at once, each in parts of
# 16 MiB with 4 in flight (a part is held whole; s3fs's default, 10 x 50 MiB per file, grew the peak RSS with
# the shards' size). Downloads: one streamed GET per object, 8 objects at once (s3fs's parallel ranges are
# each held whole too).
S3_UPLOAD = {"batch_size": 2, "chunksize": 16 << 20, "max_concurrency": 4}
S3_DOWNLOAD = {"batch_size": 8, "max_concurrency": 1}
FILES_AT_ONCE = 2  # any other async filesystem


def _transfer_options(fs: Any, upload: bool) -> Dict[str, Any]:
    if "s3" in _protocols(fs):
        return dict(S3_UPLOAD if upload else S3_DOWNLOAD)
    return {"batch_size": FILES_AT_ONCE} if getattr(fs, "async_impl", False) else {}


def _protocols(fs: Any) -> Tuple[str, ...]:
    p = fs.protocol
    return tuple(p) if isinstance(p, (tuple, list)) else (p,)


def is_url(path: Any) -> bool:
    """A URL of a remote store; ``file://`` URLs and plain paths are local."""
    m = URL.match(path) if isinstance(path, str) else None
    return m is not None and m["scheme"].lower() != "file"


def local_path(path: str) -> str:
    """``file:///x`` as ``/x``; anything else as it is."""
    return path[len("file://") :] if path.lower().startswith("file://") else path


def parse_storage_options(items: Sequence[str]) -> Dict[str, Any]:
    """``KEY=VALUE`` pairs (``--storage-option``) as fsspec keyword arguments, each value read as JSON where
    it is JSON (``anon=true``, ``client_kwargs={"region_name": "eu-west-1"}``), else as a string."""
    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CheckpointError(f"--storage-option {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


@contextlib.contextmanager
def remote_errors(url: str) -> Iterator[None]:
    """Any failure of the store (credentials, permissions, a missing bucket, retries used up) as one line."""
    try:
        yield
    except CheckpointError:
        raise
    except ImportError as e:
        scheme = URL.match(url)["scheme"].lower() if URL.match(url) else ""
        extra = EXTRAS.get(scheme)
        hint = f": pip install 'ckptshard[{extra}]'" if extra else ""
        raise CheckpointError(f"{url}: no filesystem for {scheme}:// ({e}){hint}") from None
    except Exception as e:  # botocore, aiohttp and fsspec raise many kinds; each is the store's answer
        text = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"{url}: {text}") from None


@dataclass(frozen=True)
class Remote:
    """One URL, its filesystem and the path fsspec names it by."""

    url: str
    fs: Any
    path: str

    def child(self, name: str) -> str:
        return posixpath.join(self.path, name)

    def url_of(self, path: str) -> str:
        """The URL of ``path`` (one of this filesystem's), in the scheme the user gave."""
        scheme = URL.match(self.url)["scheme"]  # type: ignore[index]
        return f"{scheme}://{path}"


def open_remote(url: str, options: Optional[Mapping[str, Any]] = None) -> Remote:
    from fsspec.core import url_to_fs

    scheme = URL.match(url)["scheme"].lower()  # type: ignore[index]
    opts = dict(S3_DEFAULTS) if scheme in ("s3", "s3a") else {}
    opts.update(options or {})
    with remote_errors(url):
        fs, path = url_to_fs(url.rstrip("/"), **opts)
    return Remote(url.rstrip("/"), fs, path)


ObjectState = Tuple[Any, ...]  # size and the store's version of an object (ETag, generation, mtime)


def _state(info: Mapping[str, Any]) -> ObjectState:
    version = next((info[k] for k in ("ETag", "etag", "generation", "version_id", "LastModified", "mtime")
                    if info.get(k) is not None), None)  # fmt: skip
    return (info.get("size"), str(version))


def list_objects(r: Remote) -> Dict[str, ObjectState]:
    """Every object ``r`` names: itself where it is one, else each object under it (recursively); by path."""
    with remote_errors(r.url):
        if r.fs.isfile(r.path):
            return {r.path: _state(r.fs.info(r.path))}
        found = r.fs.find(r.path, detail=True)
    if not found:
        raise CheckpointError(f"{r.url}: no such object or folder")
    return {p: _state(info) for p, info in found.items() if info.get("type", "file") != "directory"}


def siblings(r: Remote) -> Dict[str, ObjectState]:
    """The objects beside the object ``r`` (its "folder", not recursing): a shard's siblings are found there."""
    parent = posixpath.dirname(r.path)
    with remote_errors(r.url):
        found = r.fs.ls(parent, detail=True)
    return {i["name"]: _state(i) for i in found if i.get("type") == "file"}


def fetch(r: Remote, objects: Mapping[str, ObjectState], root: str, into: str, callback: Any = None) -> None:
    """Download ``objects`` (paths under ``root``) into folder ``into``, keeping their relative names;
    ranged, parallel reads as the filesystem does them."""
    pairs = [(p, os.path.join(into, *posixpath.relpath(p, root).split("/"))) for p in sorted(objects)]
    for _, local in pairs:
        os.makedirs(os.path.dirname(local), exist_ok=True)
    with remote_errors(r.url):
        kw = {"callback": callback} if callback is not None else {}
        r.fs.get([p for p, _ in pairs], [lp for _, lp in pairs], **kw, **_transfer_options(r.fs, upload=False))


def check_unchanged(r: Remote, seen: Mapping[str, ObjectState]) -> None:
    """Every object read is still the one read (size and ETag/generation), else :class:`InputChanged`."""
    with remote_errors(r.url):
        r.fs.invalidate_cache()  # listings are cached: ask the store again
        for path, state in seen.items():
            if _state(r.fs.info(path)) != state:
                raise InputChanged(f"{r.url_of(path)}: changed while it was read; nothing was written")


def _exists(r: Remote, path: str) -> bool:
    with remote_errors(r.url):
        return bool(r.fs.exists(path))


def _marker(r: Remote) -> str:
    return r.path + MARKER


def _is_manifest(key: str) -> bool:
    return any(key.endswith(m) for m in MANIFEST_NAMES)


def clean_leftovers(r: Remote) -> bool:
    """Remove what a killed run on output ``r`` left (the keys its marker lists, multipart uploads under
    them), and the marker; whether there was one."""
    marker = _marker(r)
    if not _exists(r, marker):
        return False
    with remote_errors(r.url):
        with r.fs.open(marker, "rb") as f:
            keys = json.loads(f.read().decode() or "[]")
        _abort_uploads(r, keys)
        for key in keys:
            if r.fs.exists(key):
                r.fs.rm(key, recursive=True)
        r.fs.rm(marker)
    return True


def _abort_uploads(r: Remote, keys: Sequence[str]) -> None:
    """Abort the unfinished multipart uploads of ``keys`` (S3; other stores keep no partial objects)."""
    call = getattr(r.fs, "call_s3", None)
    if call is None:
        return
    bucket, _, prefix = r.path.partition("/")
    listed = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    for upload in listed.get("Uploads", []):
        key = f"{bucket}/{upload['Key']}"
        if any(key == k or key.startswith(k.rstrip("/") + "/") for k in keys):
            call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def check_remote_output(r: Remote, overwrite: bool) -> None:
    """Before any work: clean a killed run's leftovers, then refuse an output that exists unless
    ``overwrite`` and ckptshard wrote it (a manifest of ours at it or beside it)."""
    clean_leftovers(r)
    with remote_errors(r.url):
        exists = r.fs.exists(r.path)
        ours = r.fs.exists(r.child(MANIFEST_NAMES[0])) or r.fs.exists(r.path + MANIFEST_NAMES[1])
    if exists and not overwrite:
        raise OutputExists(f"{r.url}: exists (--overwrite replaces an output ckptshard wrote)")
    if exists and not ours:
        raise CheckpointError(f"{r.url}: exists and was not written by ckptshard (no manifest); not replacing it")


def publish(r: Remote, staged: str, names: Sequence[str], callback: Any = None) -> List[str]:
    """Upload the entries ``names`` of the local folder ``staged`` beside each other at ``r``'s parent (the
    output and what it writes beside it: ``OUT.optim.pt``, ``OUT.manifest.json``): the marker first, data
    objects, manifests last, the marker removed. An old output at the same keys (``--overwrite``) is removed
    first, its manifests before its data. The URLs written."""
    parent = posixpath.dirname(r.path)
    uploads: List[Tuple[str, str]] = []
    for name in names:
        local = os.path.join(staged, name)
        if os.path.isdir(local):
            for d, _, files in os.walk(local):
                for f in sorted(files):
                    rel = os.path.relpath(os.path.join(d, f), staged).replace(os.sep, "/")
                    uploads.append((os.path.join(d, f), posixpath.join(parent, rel)))
        else:
            uploads.append((local, posixpath.join(parent, name)))
    keys = [posixpath.join(parent, n) for n in names]
    marker = _marker(r)
    with remote_errors(r.url):
        with r.fs.open(marker, "wb") as f:
            f.write(json.dumps(keys).encode())
        old = [k for k in keys if r.fs.exists(k)]
        for key in sorted(old, key=lambda k: not _is_manifest(k)):  # a reader trusts no part of the old one
            r.fs.rm(key, recursive=True)
        data = [(lp, k) for lp, k in uploads if not _is_manifest(k)]
        last = [(lp, k) for lp, k in uploads if _is_manifest(k)]
        kw = {"callback": callback} if callback is not None else {}
        kw.update(_transfer_options(r.fs, upload=True))
        for batch in (data, last):
            if batch:
                r.fs.put([lp for lp, _ in batch], [k for _, k in batch], **kw)
        r.fs.rm(marker)
    return [r.url_of(k) for k in keys]

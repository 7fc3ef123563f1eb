"""Commands on checkpoints in object storage: URL arguments staged through a local folder.

A remote input is fetched (the object and its siblings, or everything under a
prefix) into a staging folder under ``$CKPTSHARD_STAGING`` (default: the
temp folder), and each object's ETag/generation is checked again once the
command is done. A remote output is written into the staging folder by the
command as a local one is, then published by ``osio.remote.publish`` (data
first, manifests last, a killed run's leftovers cleaned by the next). Memory
stays flat (objects stream to and from disk); the staging folder needs the
inputs' and outputs' size on local disk. Local paths are untouched.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import os
import posixpath
import shutil
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..errors import CheckpointError
from ..osio.manifest import MANIFEST, write_json
from ..osio.remote import (
    Remote,
    check_remote_output,
    check_unchanged,
    fetch,
    is_url,
    list_objects,
    local_path,
    open_remote,
    publish,
    siblings,
)
from .parallel import torchrun_world
from .progress import progress_bar

# The filesystems' options (--storage-option) where a call gives none: the command line sets them once.
STORAGE_OPTIONS: contextvars.ContextVar[Optional[Dict[str, Any]]] = contextvars.ContextVar("storage", default=None)
INPUTS = ("src", "full", "like", "path", "hf_config", "optimizer")  # parameters that name what a command reads
OUTPUTS = ("out", "dst")  # and what it writes


def _bytes_callback(tick: Callable[[int], None]) -> Any:
    """An fsspec callback that counts the bytes of every file a transfer moves into ``tick``."""
    from fsspec.callbacks import Callback

    class File(Callback):
        def relative_update(self, inc: int = 1) -> None:
            tick(inc)

        def absolute_update(self, value: int) -> None:  # sizes only: the bytes come as relative updates
            pass

    class Transfer(Callback):
        def branched(self, path_1: str, path_2: str, **kwargs: Any) -> Any:
            return File()

    return Transfer()


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class Staging:
    """The remote inputs and outputs of one command call, and the local folder they pass through."""

    def __init__(self, options: Optional[Mapping[str, Any]], progress: bool) -> None:
        import tempfile

        base = os.environ.get("CKPTSHARD_STAGING") or tempfile.gettempdir()
        self.root = tempfile.mkdtemp(prefix="ckptshard-staging-", dir=base)
        self.options, self.progress = options, progress
        self.read: List[Tuple[Remote, Dict[str, Any]]] = []
        self.outputs: List[Tuple[Remote, str]] = []  # remote output, local staged path
        self.names: Dict[str, str] = {}  # local staged path -> the URL it stands for (in messages and results)

    def fetch(self, url: str, beside: str) -> str:
        """A local copy of what ``url`` names: a prefix whole; an object alone, or with what ``beside`` says:
        ``"siblings"`` (a shard: the rest of its checkpoint), ``"manifest"`` (an output ``verify`` reads)."""
        r = open_remote(url, self.options)
        objects = list_objects(r)
        whole = not (len(objects) == 1 and r.path in objects)
        if not whole and beside == "siblings":
            objects = siblings(r)
        elif not whole and beside == "manifest":
            objects = {p: v for p, v in siblings(r).items() if p in (r.path, r.path + ".manifest.json")}
        root = r.path if whole else posixpath.dirname(r.path)
        into = os.path.join(self.root, f"in{len(self.read)}", posixpath.basename(root) or "root")
        need = sum(size or 0 for size, _ in objects.values())
        free = shutil.disk_usage(self.root).free
        if need > free:
            raise CheckpointError(
                f"{url}: {need:,} bytes to stage and {free:,} free in {self.root} (set CKPTSHARD_STAGING)"
            )
        with progress_bar(need, f"fetch {posixpath.basename(r.path)}", self.progress) as tick:
            fetch(r, objects, root, into, _bytes_callback(tick))
        self.read.append((r, objects))
        self.names[into] = r.url_of(root)
        return into if whole else os.path.join(into, posixpath.basename(r.path))

    def output(self, url: str, overwrite: bool) -> str:
        r = open_remote(url, self.options)
        for source, _ in self.read:
            inside = r.path == source.path or r.path.startswith(source.path.rstrip("/") + "/")
            if inside and source.fs.protocol == r.fs.protocol:
                raise CheckpointError(f"{url}: inside the input {source.url}; write it elsewhere")
        check_remote_output(r, overwrite)
        staged = os.path.join(self.root, f"out{len(self.outputs)}")
        os.makedirs(staged)
        self.outputs.append((r, staged))
        self.names[staged] = r.url_of(posixpath.dirname(r.path))
        return os.path.join(staged, posixpath.basename(r.path))

    def finish(self) -> Dict[str, str]:
        """Check the inputs did not change, publish the outputs; local staged path -> URL of each."""
        for r, seen in self.read:
            check_unchanged(r, seen)
        urls: Dict[str, str] = {}
        for r, staged in self.outputs:
            names = sorted(os.listdir(staged))
            self._name_sources(staged)
            total = sum(_size(os.path.join(staged, n)) for n in names)
            with progress_bar(total, f"upload {posixpath.basename(r.path)}", self.progress) as tick:
                written = publish(r, staged, names, _bytes_callback(tick))
            for name, url in zip(names, written):
                urls[os.path.join(staged, name)] = url
        return urls

    def _name_sources(self, staged: str) -> None:
        """The manifests of ``staged`` name the inputs by their URLs, not by the staged copies read."""
        for d, _, files in os.walk(staged):
            for name in files:
                if name == MANIFEST or name.endswith(".manifest.json"):
                    path = os.path.join(d, name)
                    with open(path) as f:
                        manifest = json.load(f)
                    manifest["source"] = self._said_tree(manifest.get("source", {}))
                    write_json(path, manifest)

    def _said_tree(self, x: Any) -> Any:
        if isinstance(x, str):
            return self.said(x)
        if isinstance(x, list):
            return [self._said_tree(v) for v in x]
        if isinstance(x, dict):
            return {k: self._said_tree(v) for k, v in x.items()}
        return x

    def said(self, text: str) -> str:
        """``text`` naming URLs where it names staged paths."""
        for local, url in sorted(self.names.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(local, url)
        return text

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _as_urls(result: Any, urls: Mapping[str, str], said: Callable[[str], str]) -> Any:
    """A command's result with each staged output path replaced by its URL, and staged paths in its texts
    (notes, ``verify``'s problems) by theirs."""

    def swap(x: Any) -> Any:
        if isinstance(x, str):
            return urls[x] if x in urls else said(x)
        if isinstance(x, list):
            return [swap(v) for v in x]
        return x

    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.replace(
            result, **{f.name: swap(getattr(result, f.name)) for f in dataclasses.fields(result)}
        )
    return swap(result)


def staged(fn: Callable[..., Any], args: tuple, kwargs: Dict[str, Any]) -> Any:
    """Call ``fn`` with its URL arguments (``INPUTS``, ``OUTPUTS``) staged; ``storage_options`` in ``kwargs``
    is the filesystems' configuration (``--storage-option``)."""
    options = kwargs.pop("storage_options", None) or STORAGE_OPTIONS.get()
    if not any(isinstance(v, str) and "://" in v for v in (*args, *kwargs.values())):
        return fn(*args, **kwargs)  # no URL, file:// included: nothing to bind (inspect costs each run's start)
    import inspect

    bound = inspect.signature(fn).bind(*args, **kwargs)
    remote = {k: v for k, v in bound.arguments.items() if (k in INPUTS or k in OUTPUTS) and is_url(v)}
    for k, v in list(bound.arguments.items()):
        if (k in INPUTS or k in OUTPUTS) and isinstance(v, str) and not is_url(v):
            bound.arguments[k] = local_path(v)
    if not remote:
        return fn(*bound.args, **bound.kwargs)
    if any(k in OUTPUTS for k in remote) and torchrun_world() is not None:
        raise CheckpointError("a remote output is written by one process: start it without torchrun (--jobs works)")
    stage = Staging(options, bool(bound.arguments.get("progress", True)))
    try:
        for k in [k for k in remote if k in INPUTS]:
            template = k == "like" and fn.__name__ in ("shard", "convert")  # a sharded checkpoint to follow
            beside = "siblings" if k == "src" or template else "manifest" if k == "path" else ""
            bound.arguments[k] = stage.fetch(remote[k], beside)
        for k in [k for k in remote if k in OUTPUTS]:
            bound.arguments[k] = stage.output(remote[k], bool(bound.arguments.get("overwrite", False)))
        result = fn(*bound.args, **bound.kwargs)
        return _as_urls(result, stage.finish(), stage.said)
    except CheckpointError as e:
        raise type(e)(stage.said(str(e))) from None
    finally:
        stage.close()

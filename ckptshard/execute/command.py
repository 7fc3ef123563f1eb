"""What every library command does around its work, in one place."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

from ..osio.durability import fsyncing
from ..osio.inputs import watching_inputs
from ..read.torch_file import reading_once
from .staging import staged

T = TypeVar("T")


def path_of(x: Any) -> Any:
    """A path given as ``os.PathLike`` as the ``str`` the commands use; anything else as it is."""
    return os.fspath(x) if isinstance(x, os.PathLike) else x


def command(fn: Callable[..., T]) -> Callable[..., T]:
    """A library command: paths may be ``os.PathLike``, or URLs of object storage (staged through a local
    folder, ``execute.staging``; ``storage_options=`` configures their filesystems); the inputs it reads are
    watched for the call (``osio.inputs``) and each one's pickle read once (``read.torch_file``), and its
    outputs fsynced as its ``fsync`` keyword says (default True)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        args = tuple(path_of(a) for a in args)
        kwargs = {k: path_of(v) for k, v in kwargs.items()}
        with watching_inputs(), reading_once(), fsyncing(kwargs.get("fsync", True)):
            return staged(fn, args, kwargs)

    return run

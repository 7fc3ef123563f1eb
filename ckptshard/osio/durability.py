"""Whether outputs are made durable (fsynced) before they are renamed into place.

By default every output is fsynced, then renamed, then its folder fsynced:
once a command returns, a crash or power loss cannot leave a renamed output
with missing data. ``--no-fsync`` (the environment variable below, which
``--jobs`` workers and torchrun ranks inherit) skips the fsyncs and the
early writeback, as ``cp`` does: outputs are still written to a temporary
and renamed only when complete, so an interrupted run leaves nothing; the
data reaches the disk when the kernel writes it back.
"""

from __future__ import annotations

import os

ENV = "CKPTSHARD_NO_FSYNC"


def durable() -> bool:
    return os.environ.get(ENV, "") in ("", "0")

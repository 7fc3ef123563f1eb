"""Whether a path is a DCP folder, without importing DCP's readers."""

from __future__ import annotations

import os

from ..formats.dcp_names import METADATA


def is_dcp(path: str) -> bool:
    """A folder holding DCP's ``.metadata``."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))

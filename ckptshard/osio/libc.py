"""Linux system calls Python's os module lacks, bound from libc on first use.

ctypes takes time to import, so nothing binds until a call needs it.
Elsewhere than Linux, or where libc lacks the call, :func:`bind` gives None
and callers take their portable path.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Optional, Tuple


@functools.cache
def bind(name: str, argtypes: Tuple[str, ...]) -> Optional[Any]:
    """libc's ``name``, returning an int, its arguments of these ctypes type names (``"c_int64"``)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [getattr(ctypes, t) for t in argtypes]
    fn.restype = ctypes.c_int
    return fn

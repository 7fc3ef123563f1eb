"""A byte-counting progress bar that can be switched off."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda n: None
        return
    from tqdm import (
        tqdm,  # here, not at start-up: quiet runs never draw a bar
    )

    with tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=False,
    ) as bar:
        yield bar.update

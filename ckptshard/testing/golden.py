"""The golden outputs: what ckptshard writes from one committed real checkpoint, read by every torch tested.

``tests/data/golden/in`` is a real fairscale run (fp32, world size 2, fairseq
files), ``ref`` its live ``state_dict()``, and ``out`` what :func:`write_outputs`
made of it when the files were last made (``scripts/make_golden.py``). The
tests check that each torch reads ``out`` and that today's writer still gives
those bytes.
"""

from __future__ import annotations

import os
import pathlib

from ..execute.consolidate import consolidate
from ..execute.convert import convert
from ..execute.reshard import reshard


def write_outputs(src: pathlib.Path, out: pathlib.Path) -> None:
    """A consolidated ``.pt``, a reshard to 3 and a DCP folder of the checkpoint in ``src``, under ``out``."""
    os.makedirs(out, exist_ok=True)
    consolidate(str(src), str(out / "consolidated.pt"), progress=False)
    reshard(str(src), str(out / "resharded-3"), 3, progress=False)
    convert(str(src), str(out / "dcp"), "dcp", progress=False)

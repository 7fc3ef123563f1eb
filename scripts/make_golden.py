"""Remake tests/data/golden from a real fp32 fairscale run at world size 2.

Run it only when a change to what ckptshard writes is deliberate: the
committed outputs are what every torch in the tested range has read.

    python scripts/make_golden.py [FIXTURE_FOLDER]

FIXTURE_FOLDER: a ``build_fixture(..., 2, "fp32")`` folder; without it the
inputs already committed are kept and only the outputs are remade.
"""

import pathlib
import shutil
import sys

from ckptshard.testing.golden import write_outputs

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "golden"

if __name__ == "__main__":
    if len(sys.argv) > 1:
        fixture = pathlib.Path(sys.argv[1])
        shutil.rmtree(GOLDEN, ignore_errors=True)
        shutil.copytree(fixture / "fairseq", GOLDEN / "in")
        (GOLDEN / "ref").mkdir(parents=True)
        shutil.copy(fixture / "ref" / "full_state_dict.pt", GOLDEN / "ref")
    shutil.rmtree(GOLDEN / "out", ignore_errors=True)
    write_outputs(GOLDEN / "in", GOLDEN / "out")
    print(f"wrote {GOLDEN / 'out'}")

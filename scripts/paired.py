"""Compare two checkouts of ckptshard on one checkpoint: wall and CPU time, interleaved rounds.

On a VM whose speed varies by the hour, the CPU time a command uses moves
less than its wall time. Each round runs every command once per checkout,
alternating which goes first, after ``sync`` and a read-through of the input.

    .venv/bin/python scripts/paired.py SRC OTHER_CHECKOUT [--rounds 7]

SRC is a sharded checkpoint (e.g. bench.py's ``src-2.0g-8``); OTHER_CHECKOUT
a worktree of another commit (``git worktree add /tmp/base COMMIT``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_through(folder: str) -> None:
    for n in sorted(os.listdir(folder)):
        with open(os.path.join(folder, n), "rb") as f:
            while f.read(64 << 20):
                pass


def timed(args: list, tree: str) -> tuple:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run(
        [sys.executable, "-m", "ckptshard.cli", *args, "-q", "--no-fsync"],
        check=True,
        env=env,
        cwd=tree,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("other")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    trees = {"other": os.path.abspath(a.other), "this": HERE}
    out = tempfile.mkdtemp(prefix="paired-")
    cmds = {
        "consolidate -> .safetensors": ["consolidate", a.src, "-o", f"{out}/f.safetensors"],
        "consolidate -> .pt": ["consolidate", a.src, "-o", f"{out}/f.pt"],
        "reshard 8->3": ["reshard", a.src, "-n", "3", "-o", f"{out}/r3"],
    }
    res: dict = {(c, t): [] for c in cmds for t in trees}
    for rnd in range(a.rounds):
        order = list(trees.items()) if rnd % 2 == 0 else list(reversed(trees.items()))
        for c, args in cmds.items():
            for t, tree in order:
                shutil.rmtree(out, ignore_errors=True)
                os.makedirs(out)
                subprocess.run(["sync"], check=True)
                read_through(a.src)
                res[(c, t)].append(timed(args, tree))
    shutil.rmtree(out, ignore_errors=True)
    print(f"{a.rounds} interleaved rounds, --no-fsync; medians")
    print("| command | other wall s | this wall s | other CPU s | this CPU s |")
    print("|---|---:|---:|---:|---:|")
    for c in cmds:
        o, t = res[(c, "other")], res[(c, "this")]
        med = [statistics.median(x[i] for x in runs) for runs in (o, t) for i in (0, 1)]
        print(f"| {c} | {med[0]:.3f} | {med[2]:.3f} | {med[1]:.3f} | {med[3]:.3f} |")


if __name__ == "__main__":
    main()

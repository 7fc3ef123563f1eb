"""Where one ckptshard command's time goes, process start to exit: wall time per phase of one run.

    .venv/bin/python scripts/profile_run.py -- consolidate SRC -o OUT.safetensors -q --no-fsync

Phases are timed by wrapping the functions that begin them (the first call of each), in this one
process: Python's start and ckptshard's imports, the family probe with every pickle read, the checks
before writing, writing (copy, hash, manifest) and what is left to exit. Run it beside the command
itself: the wrappers add microseconds.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time

T0 = time.perf_counter()
MARKS = []


def mark(name: str) -> None:
    if all(n != name for n, _ in MARKS):  # the first call: writer threads each enter a Copier
        MARKS.append((name, time.perf_counter()))


def timed(module: object, attr: str, name: str) -> None:
    fn = getattr(module, attr)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        mark(name)
        return fn(*a, **k)

    setattr(module, attr, wrapper)


def report() -> None:
    end = time.perf_counter()
    with open(f"/proc/{os.getpid()}/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    since_exec = uptime - start_ticks / os.sysconf("SC_CLK_TCK")  # process age now, from the kernel
    interp = since_exec - (end - T0)
    rows = [("python start (interpreter, site)", interp)]
    prev_name, prev = "imports: click, ckptshard", T0
    for name, t in MARKS:
        rows.append((prev_name, t - prev))
        prev_name, prev = name, t
    rows.append((prev_name, end - prev))
    total = sum(d for _, d in rows)
    print("| phase | ms | share |\n|---|---:|---:|", file=sys.stderr)
    for name, d in rows:
        print(f"| {name} | {d * 1000:.0f} | {d / total:.0%} |", file=sys.stderr)
    print(f"| total | {total * 1000:.0f} | |", file=sys.stderr)


def main() -> None:
    args = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else sys.argv[1:]
    from ckptshard import cli
    from ckptshard.execute import consolidate, reshard
    from ckptshard.write import copier

    mark("click parses the command line")
    for mod in (consolidate, reshard):
        timed(mod, "open_source", "probe and read every pickle")
    for mod in (consolidate, reshard):
        timed(mod, "check_space", "plan, checks (output, space)")
    timed(copier.Copier, "__enter__", "write: lay out, copy, hash, manifest, close")
    atexit.register(report)
    cli.main(args, standalone_mode=True)


if __name__ == "__main__":
    main()

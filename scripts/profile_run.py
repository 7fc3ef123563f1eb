"""Where one ckptshard command's time goes, process start to exit: wall time per phase of one run.

    .venv/bin/python scripts/profile_run.py --prefault-gib 4 -- consolidate SRC -o OUT.safetensors -q --no-fsync

As bench.py runs a command (its memory prefaulted, SRC read through the page cache, dirty pages
written back), then in a fresh process: phases are timed by wrapping the functions that begin them
(the first call of each): Python's start, click's and ckptshard's imports, the family probe with every
pickle read and the plan, the checks before writing, and writing (lay out, copy, hash, manifest,
close). The wrappers add microseconds.
"""

from __future__ import annotations

import atexit
import functools
import os
import subprocess
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
    if "--" not in sys.argv:
        raise SystemExit(__doc__)
    at = sys.argv.index("--")
    opts, args = sys.argv[1:at], sys.argv[at + 1 :]
    if "--run" not in opts:  # the harness's part, then this script again in a fresh process
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench

        gib = float(opts[opts.index("--prefault-gib") + 1]) if "--prefault-gib" in opts else 0.0
        os.sync()
        bench.prefault(bench.prefault_bytes(gib))
        bench.warm(args[1] if os.path.isdir(args[1]) else None)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", "--", *args])
        raise SystemExit(done.returncode)
    from ckptshard import cli
    from ckptshard.execute import consolidate, reshard
    from ckptshard.write import copier

    mark("click parses the command line")
    for mod in (consolidate, reshard):
        timed(mod, "open_source", "probe, read every pickle, plan")
    for mod in (consolidate, reshard):
        timed(mod, "check_space", "checks (output, space)")
    timed(copier.Copier, "__enter__", "write: lay out, copy, hash, manifest, close")
    atexit.register(report)
    cli.main(args, standalone_mode=True)


if __name__ == "__main__":
    main()

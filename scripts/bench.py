"""Benchmarks: ckptshard vs fairscale's consolidate_shard_weights + torch.save, vs cp -r.

Makes a synthetic fairscale checkpoint (fairseq container, fp32, default
2 GiB in 8 shards, 24 FSDP instances), then runs each command in its own
process, side by side in one run, and reports wall time, the ratio to
``cp -r`` of the shard folder, and the process's peak RSS (from wait4).
Warm page cache for every command alike: right before each timed command
its input folder is read through (not timed). This VM pages out file pages
left unread for about a minute (a DAMON ``pageout`` scheme, kdamond): a
2 GiB folder read 50 s earlier was 40% evicted, so an input that only some
commands read (the 3-shard folder of the 3->8 rows) was read partly from
disk while ``cp -r``'s was not. Before every timed command the page cache's
dirty pages are also written back (``sync``, not timed), and commands run
round-robin ``--repeat`` times: the median is reported (the fastest run of
each is reported too).
Right before each timed command the harness also touches, then frees,
``--prefault-gib`` of memory (not timed): this VM hands the pages that a
deleted output freed back to its host (virtio-balloon free page reporting)
within a second or two, and a command that then allocates page cache has
each page faulted back in from the host. That made any single run, ``cp -r``
included, 2-5x slower at random (``cp -r`` of 2 GiB: 2.5-2.9 s after
``rm``, ``sync`` and a 2 s pause, 0.51-0.63 s with the prefault).
ckptshard fsyncs its outputs and checksums them into a manifest; ``cp -r``
does neither, so ``cp -r && sync`` is reported as the like-for-like baseline,
and ``--no-fsync`` rows compare with the plain ``cp -r``.

    .venv/bin/python scripts/bench.py                    # 2 GiB, 8 shards
    .venv/bin/python scripts/bench.py --sizes 1,2,4      # scaling table (+ plot with --plot)
    .venv/bin/python scripts/bench.py --optimizer        # with Adam state (3x the bytes)
    .venv/bin/python scripts/bench.py --many-instances   # 64 shards x 400 tiny FSDP instances: per-run costs
    .venv/bin/python scripts/bench.py --no-fairscale --only no-fsync --repeat 9   # the 1.2x-cp-r rows, 9 rounds
    .venv/bin/python scripts/bench.py --fsdp2 --repeat 5   # torch FSDP2 per-rank files (verl's layout)
    .venv/bin/python scripts/bench.py --model-parts --repeat 5   # metaseq model-parallel parts (OPT-shaped plan)
    .venv/bin/python scripts/bench.py --against f53e0b2 --sizes 1,2 --repeat 15   # HEAD vs a commit, in pairs
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = sys.executable
LAYERS = 23  # + the root instance = 24 FSDP instances

FAIRSCALE_CONSOLIDATE = """
import sys, torch
from fairscale.nn import FullyShardedDataParallel as FSDP
src, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
shards = [torch.load(f"{src}/checkpoint_last-shard{r}.pt", weights_only=True) for r in range(n)]
full = FSDP.consolidate_shard_weights([s["model"] for s in shards], [s["fsdp_metadata"] for s in shards])
torch.save(full, out)
"""

# The obvious way to DCP without ckptshard: consolidate in memory, then dcp.save in one process.
FAIRSCALE_TO_DCP = """
import sys, torch
import torch.distributed.checkpoint as dcp
from fairscale.nn import FullyShardedDataParallel as FSDP
src, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
shards = [torch.load(f"{src}/checkpoint_last-shard{r}.pt", weights_only=True) for r in range(n)]
full = FSDP.consolidate_shard_weights([s["model"] for s in shards], [s["fsdp_metadata"] for s in shards])
dcp.save({"model": full}, checkpoint_id=out, no_dist=True)
"""

# metaseq-style resharding: consolidate everything in memory, then re-split each flat param.
METASEQ_RESHARD = """
import os, sys, torch
import torch.nn.functional as F
from fairscale.nn import FullyShardedDataParallel as FSDP
src, m, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
shards = [torch.load(f"{src}/checkpoint_last-shard{r}.pt", weights_only=True) for r in range(m)]
metas = [s["fsdp_metadata"] for s in shards]
full = FSDP.consolidate_shard_weights([s["model"] for s in shards], metas)
os.makedirs(out)
for rank in range(n):
    local = {}
    for inst in metas[0]["param_metadata"]:
        for key, info in inst["params"].items():
            flat = torch.cat(
                [full[".".join(x for x in (inst["fsdp_path"], name) if x)].reshape(-1) for name in info["names"]]
            )
            chunks = list(flat.chunk(n)) + [flat.new_empty(0)] * n
            c = chunks[0].numel()
            padded = F.pad(chunks[rank], [0, c - chunks[rank].numel()]).clone()
            local[".".join(x for x in (inst["fsdp_path"], key) if x)] = padded
    torch.save({"model": local}, f"{out}/checkpoint_last-shard{rank}.pt")
"""


def prefault(nbytes: int) -> None:
    """Touch and free ``nbytes`` of anonymous memory: the guest owns those pages again (see the module doc).

    In a child process: a process's peak RSS (what wait4 reports) is
    inherited by the children it forks later.
    """
    if nbytes > 0:
        subprocess.run([PY, "-c", PREFAULT_CODE, str(nbytes)], check=True)


PREFAULT_CODE = """
import mmap, sys
n = int(sys.argv[1])
with mmap.mmap(-1, n) as m:
    for _ in range(n >> 20):
        m.write(bytes(1 << 20))
"""
PREFAULT = 0  # bytes; set from --prefault-gib


def prefault_bytes(want_gib: float) -> int:
    """``want_gib`` GiB, at most half the free memory, in whole MiB."""
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(min(want_gib * 2**30, free // 2)) >> 20 << 20


ONLY = re.compile("")  # rows to run (cp -r always runs); set from --only


def warm(folder: Optional[str]) -> None:
    """Read every file of ``folder`` through the page cache (see the module doc: it may have been paged out).

    By ``cat``, in a child: a buffer in this process would raise the peak RSS its later children report.
    """
    if folder:
        files = [os.path.join(folder, n) for n in sorted(os.listdir(folder))]
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)


def run(cmd: List[str], reads: Optional[str] = None, tree: str = ROOT) -> Tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one command, which reads the folder ``reads``."""
    return run_usage(cmd, reads, tree)[:2]


def run_usage(cmd: List[str], reads: Optional[str] = None, tree: str = ROOT) -> Tuple[float, int, float]:
    """Wall seconds, peak RSS (bytes) and CPU seconds (user + system) of one command run in checkout ``tree``."""
    os.sync()
    prefault(PREFAULT)
    warm(reads)
    env = dict(os.environ, PYTHONPATH=tree) if tree != ROOT else None  # -m imports ckptshard from the cwd first
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, cwd=tree, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def gen(folder: str, size_gib: float, shards: int, optimizer: bool) -> None:
    code = (
        "import sys, torch; from ckptshard.testing.synthetic import write_synthetic, width_for;"
        f"write_synthetic(sys.argv[1], {shards}, {LAYERS}, width_for(int({size_gib} * 2**30), {LAYERS}), "
        f"optimizer={optimizer})"
    )
    subprocess.run([PY, "-c", code, folder], check=True)


def _clean(out: str) -> None:
    for p in (
        out,
        out + ".pt",
        out + ".safetensors",
        out + ".pt.manifest.json",
        out + ".safetensors.manifest.json",
        out + ".optim.pt",
        out + ".optim.pt.manifest.json",
    ):
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)


def bench_size(
    work: str, size_gib: float, shards: int, optimizer: bool, fairscale: bool, repeat: int
) -> Dict[str, Tuple[float, int]]:
    src = os.path.join(work, f"src-{size_gib}g-{shards}{'-adam' if optimizer else ''}")
    if not os.path.isdir(src):
        gen(src, size_gib, shards, optimizer)
    out = os.path.join(work, "out")
    ck = [PY, "-m", "ckptshard.cli"]
    cases: List[Tuple[str, List[str]]] = [
        ("cp -r", ["cp", "-r", src, out]),
        # The floor under every ckptshard row: starting Python and importing torch.
        ("python -c 'import torch' (floor)", [PY, "-c", "import torch"]),
        # The floor where torch is not imported (consolidate -> safetensors).
        ("python -c 'import ckptshard.cli' (floor without torch)", [PY, "-c", "import ckptshard.cli"]),
        # ckptshard fsyncs what it writes; cp -r leaves that to the (untimed) next sync.
        ("cp -r && sync (durable, like ckptshard)", ["sh", "-c", f"cp -r '{src}' '{out}' && sync"]),
        ("ckptshard consolidate -> .safetensors", ck + ["consolidate", src, "-o", out + ".safetensors", "-q"]),
        ("ckptshard consolidate -> .pt", ck + ["consolidate", src, "-o", out + ".pt", "-q"]),
        (f"ckptshard reshard {shards}->3", ck + ["reshard", src, "-n", "3", "-o", out, "-q"]),
        # Like cp -r: not fsynced (still renamed into place only when complete).
        (
            "ckptshard consolidate -> .safetensors --no-fsync",
            ck + ["consolidate", src, "-o", out + ".safetensors", "-q", "--no-fsync"],
        ),
        ("ckptshard consolidate -> .pt --no-fsync", ck + ["consolidate", src, "-o", out + ".pt", "-q", "--no-fsync"]),
        # With Adam state: every byte cp -r copies is written (weights beside, optimizer in .optim.pt).
        *(
            [
                (
                    "ckptshard consolidate --optimizer -> .safetensors + .optim.pt --no-fsync",
                    ck + ["consolidate", src, "-o", out + ".safetensors", "--optimizer", "-q", "--no-fsync"],
                ),
                (
                    "ckptshard consolidate --optimizer -> .pt + .optim.pt --no-fsync",
                    ck + ["consolidate", src, "-o", out + ".pt", "--optimizer", "-q", "--no-fsync"],
                ),
            ]
            if optimizer
            else []
        ),
        (f"ckptshard reshard {shards}->3 --no-fsync", ck + ["reshard", src, "-n", "3", "-o", out, "-q", "--no-fsync"]),
        # The same in 2 processes: no mapping lock or GIL shared by every file's threads (many small pieces).
        (
            f"ckptshard reshard {shards}->3 --no-fsync --jobs 2",
            ck + ["reshard", src, "-n", "3", "-o", out, "-q", "--no-fsync", "--jobs", "2"],
        ),
        ("ckptshard convert --to dcp", ck + ["convert", src, "--to", "dcp", "-o", out, "-q"]),
        # Scale-out: a folder of 256 MiB safetensors files, by one process and by two.
        (
            "ckptshard consolidate -> 256MiB-file folder",
            ck + ["consolidate", src, "-o", out, "--max-shard-size", "256MiB", "-q"],
        ),
        (
            "ckptshard consolidate -> 256MiB-file folder --jobs 2",
            ck + ["consolidate", src, "-o", out, "--max-shard-size", "256MiB", "--jobs", "2", "-q"],
        ),
    ]
    if fairscale:
        cases.insert(
            1,
            (
                "fairscale consolidate_shard_weights + torch.save",
                [PY, "-c", FAIRSCALE_CONSOLIDATE, src, str(shards), out + ".pt"],
            ),
        )
        cases.append(
            ("fairscale consolidate + dcp.save (one process)", [PY, "-c", FAIRSCALE_TO_DCP, src, str(shards), out])
        )
        cases.append(
            (
                f"metaseq-style reshard {shards}->3 (consolidate, re-split)",
                [PY, "-c", METASEQ_RESHARD, src, str(shards), "3", out],
            )
        )
    # 3 -> 8: from a 3-shard copy made by ckptshard itself.
    three = os.path.join(work, "three")
    shutil.rmtree(three, ignore_errors=True)
    run(ck + ["reshard", src, "-n", "3", "-o", three, "-q"])
    cases.append((f"ckptshard reshard 3->{shards}", ck + ["reshard", three, "-n", str(shards), "-o", out, "-q"]))
    cases.append(
        (
            f"ckptshard reshard 3->{shards} --no-fsync",
            ck + ["reshard", three, "-n", str(shards), "-o", out, "-q", "--no-fsync"],
        )
    )
    cases.append(
        (
            f"ckptshard reshard 3->{shards} --no-fsync --jobs 2",
            ck + ["reshard", three, "-n", str(shards), "-o", out, "-q", "--no-fsync", "--jobs", "2"],
        )
    )
    results = interleave(cases, repeat, src, out, lambda name, cmd: three if three in cmd else src)
    shutil.rmtree(three)
    return results


def interleave(
    cases: List[Tuple[str, List[str]]], repeat: int, src: str, out: str, reads: Callable[[str, List[str]], str]
) -> Dict[str, Tuple[float, int, float]]:
    """Every case that ``--only`` keeps (``cp -r`` always), ``repeat`` times, round-robin; per case the median
    wall, peak RSS and fastest wall."""
    cases = [(n, c) for n, c in cases if n == "cp -r" or ONLY.search(n)]
    run(["cp", "-r", src, out])  # warm the page cache
    _clean(out)
    samples: Dict[str, List[Tuple[float, int]]] = {name: [] for name, _ in cases}
    for _ in range(repeat):
        for name, cmd in cases:
            samples[name].append(run(cmd, None if "floor" in name else reads(name, cmd)))
            _clean(out)
    return {
        name: (statistics.median(w for w, _ in v), max(r for _, r in v), min(w for w, _ in v))
        for name, v in samples.items()
    }


# Without ckptshard: every rank's file in memory, each DTensor's pieces concatenated, one safetensors file.
MERGE_IN_MEMORY = """
import sys, torch, torch.distributed.tensor
from safetensors.torch import save_file
src, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ranks = [torch.load(f"{src}/model_world_size_{n}_rank_{r}.pt", weights_only=True) for r in range(n)]
save_file({k: torch.cat([sd[k].to_local() for sd in ranks]) for k in ranks[0]}, out)
"""


def bench_fsdp2(work: str, size_gib: float, ranks: int, repeat: int) -> Dict[str, Tuple[float, int, float]]:
    """torch FSDP per-rank files (verl's names), FSDP2 and FSDP1: consolidate and reshard against cp -r and an
    in-memory merge."""
    src, src1 = _fsdp2_src(work, size_gib, ranks), _fsdp2_src(work, size_gib, ranks, fsdp1=True)
    out = os.path.join(work, "out")
    cli = [PY, "-m", "ckptshard.cli"]
    merged = out + ".safetensors"
    cases = [
        ("cp -r", ["cp", "-r", src, out]),
        (
            "ckptshard consolidate -> .safetensors --no-fsync",
            [*cli, "consolidate", src, "-o", merged, "-q", "--no-fsync"],
        ),
        ("ckptshard reshard 8->3 --no-fsync", [*cli, "reshard", src, "-n", "3", "-o", out, "-q", "--no-fsync"]),
        (  # every parameter written twice, by torch's pickling (a 2-D mesh)
            "ckptshard reshard 8->2x3 (HSDP: 2x the bytes) --no-fsync",
            [*cli, "reshard", src, "-n", "6", "--shard-group", "3", "-o", out, "-q", "--no-fsync"],
        ),
        ("all ranks in memory, torch.cat, save_file", [PY, "-c", MERGE_IN_MEMORY, src, str(ranks), merged]),
        (
            "FSDP1: ckptshard consolidate -> .safetensors --no-fsync",
            [*cli, "consolidate", src1, "-o", merged, "-q", "--no-fsync"],
        ),
        ("FSDP1: ckptshard reshard 8->3 --no-fsync", [*cli, "reshard", src1, "-n", "3", "-o", out, "-q", "--no-fsync"]),
    ]
    return interleave(cases, repeat, src, out, lambda name, cmd: src1 if name.startswith("FSDP1") else src)


MANY = (64, 400, 0.25)  # shards, FSDP instances, GiB of weights (+ Adam state: 0.75 GiB in all)


def bench_many(work: str, repeat: int) -> Dict[str, Tuple[float, int, float]]:
    """Many shards of many small FSDP instances: 115k copy runs of about 7 KiB in a reshard to 48 ranks."""
    shards, layers, gib = MANY
    src = os.path.join(work, f"src-many-{shards}x{layers}-adam")
    if not os.path.isdir(src):
        code = (
            "import sys; from ckptshard.testing.synthetic import write_synthetic, width_for;"
            f"write_synthetic(sys.argv[1], {shards}, {layers}, width_for(int({gib} * 2**30), {layers}), optimizer=True)"
        )
        subprocess.run([PY, "-c", code, src], check=True)
    out = os.path.join(work, "out")
    ck = [PY, "-m", "ckptshard.cli"]
    cases = [
        ("cp -r", ["cp", "-r", src, out]),
        (
            "ckptshard reshard 64->48 --no-fsync (default --jobs)",
            ck + ["reshard", src, "-n", "48", "-o", out, "-q", "--no-fsync"],
        ),
        (
            "ckptshard reshard 64->48 --no-fsync --jobs 1 (threads)",
            ck + ["reshard", src, "-n", "48", "-o", out, "-q", "--no-fsync", "--jobs", "1"],
        ),
        (
            "ckptshard consolidate --optimizer -> .pt --no-fsync",
            ck + ["consolidate", src, "-o", out + ".pt", "--optimizer", "-q", "--no-fsync"],
        ),
    ]
    return interleave(cases, repeat, src, out, lambda name, cmd: src)


PARTS_PLAN = (8, 124)  # OPT-175B as released: 8 model-parallel parts x 124 FSDP shards
PART_RULES = ["--mp-rule", r"layers\.\d+\.(weight|bias)$=0"]


def _gen_parts(src: str, parts: int, shards: int, width: int) -> None:
    if not os.path.isdir(src):
        code = (
            "import sys; from ckptshard.testing.synthetic import write_synthetic_parts;"
            f"write_synthetic_parts(sys.argv[1], {parts}, {shards}, {LAYERS}, {width})"
        )
        subprocess.run([PY, "-c", code, src], check=True)


def bench_model_parts(work: str, size_gib: float, repeat: int) -> Dict[str, Tuple[float, int, float]]:
    """Model-parallel parts: the OPT-175B-shaped plan (8 x 124 files of small tensors: planning, not copying),
    each command once; then 8 parts x 8 shards of ``size_gib`` against cp -r."""
    parts, shards = PARTS_PLAN
    src = os.path.join(work, f"parts-{parts}x{shards}")
    _gen_parts(src, parts, shards, 16)
    out = os.path.join(work, "out")
    ck = [PY, "-m", "ckptshard.cli"]
    print(f"{parts} parts x {shards} shards ({parts * shards} files), small tensors: one run each")
    print("| command | wall s | peak RSS MiB |\n|---|---:|---:|")
    for name, cmd in (
        ("inspect", ck + ["inspect", src]),
        ("consolidate --mp-rule -> .safetensors", ck + ["consolidate", src, "-o", out + ".safetensors", *PART_RULES]),
        (f"reshard {parts} parts x {shards}->62", ck + ["reshard", src, "-n", "62", "-o", out]),
    ):
        wall, rss = run([*cmd, "-q", "--no-fsync"] if name != "inspect" else cmd, src)
        print(f"| {name} | {wall:.2f} | {rss / 2**20:.0f} |", flush=True)
        _clean(out)
    big = os.path.join(work, f"parts-8x8-{size_gib:g}g")
    _gen_parts(big, 8, 8, max(4, int((size_gib * 2**30 / 8 / 4 / LAYERS) ** 0.5)))  # fp32 Linear layers
    cases = [
        ("cp -r", ["cp", "-r", big, out]),
        (
            "ckptshard consolidate 8 parts, --mp-rule -> .safetensors --no-fsync",
            ck + ["consolidate", big, "-o", out + ".safetensors", *PART_RULES, "-q", "--no-fsync"],
        ),
        (
            "ckptshard reshard 8 parts x 8->3 --no-fsync",
            ck + ["reshard", big, "-n", "3", "-o", out, "-q", "--no-fsync"],
        ),
    ]
    return interleave(cases, repeat, big, out, lambda name, cmd: big)


def checkout(commit: str) -> str:
    """A git worktree of ``commit`` in a temp folder, its bytecode compiled as pip install would."""
    tree = os.path.join(tempfile.mkdtemp(prefix="bench-base-"), commit)
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", tree, commit], check=True)
    compiled = [PY, "-m", "compileall", "-q", os.path.join(tree, "ckptshard")]
    subprocess.run(compiled, check=True, stdout=subprocess.DEVNULL)
    return tree


def _fsdp2_src(work: str, size_gib: float, ranks: int, fsdp1: bool = False) -> str:
    """A synthetic folder of torch FSDP2 (or FSDP1) per-rank files in verl's names, made once."""
    src = os.path.join(work, f"fsdp{1 if fsdp1 else 2}-{size_gib:g}g-{ranks}")
    if not os.path.isdir(src):
        code = (
            "import sys; from ckptshard.testing.synthetic import write_synthetic_fsdp2, width_for;"
            f"write_synthetic_fsdp2(sys.argv[1], {ranks}, {LAYERS}, width_for(int({size_gib} * 2**30), {LAYERS}), "
            f"fsdp1={fsdp1})"
        )
        subprocess.run([PY, "-c", code, src], check=True)
    return src


def bench_against(work: str, size_gib: float, shards: int, commit: str, repeat: int) -> str:
    """HEAD against ``commit`` (a worktree) and ``cp -r`` of the same input, in rounds of one run each: the
    fairscale consolidate and reshard, and the HSDP reshard of FSDP2 files; a markdown table."""
    src = os.path.join(work, f"src-{size_gib}g-{shards}")
    if not os.path.isdir(src):
        gen(src, size_gib, shards, False)
    fsdp2 = _fsdp2_src(work, size_gib, shards)
    out = os.path.join(work, "out")
    ck = [PY, "-m", "ckptshard.cli"]
    flags = ["-q", "--no-fsync"]
    commands = {
        "consolidate -> .safetensors": (src, ck + ["consolidate", src, "-o", out + ".safetensors", *flags]),
        f"reshard {shards}->3": (src, ck + ["reshard", src, "-n", "3", "-o", out, *flags]),
        f"HSDP reshard {shards}->2x3 (2x the bytes)": (
            fsdp2,
            ck + ["reshard", fsdp2, "-n", "6", "--shard-group", "3", "-o", out, *flags],
        ),
        # The first run to a mesh: torch imported to make its DTensor pickles (kept in the cache after).
        f"HSDP reshard {shards}->2x3, no kept templates": (
            fsdp2,
            ["env", "CKPTSHARD_NO_CACHE=1", *ck, "reshard", fsdp2, "-n", "6", "--shard-group", "3", "-o", out, *flags],
        ),
    }
    os.environ["CKPTSHARD_CACHE_DIR"] = os.path.join(work, "cache")  # not the user's: made by the first run
    commands = {name: c for name, c in commands.items() if ONLY.search(name)}
    base = checkout(commit)
    helps = subprocess.run([*ck, "reshard", "--help"], cwd=base, env=dict(os.environ, PYTHONPATH=base),
                           capture_output=True, text=True).stdout  # fmt: skip
    older = set() if "--shard-group" in helps else {name for name in commands if name.startswith("HSDP")}
    samples: Dict[Tuple[str, str], List[Tuple[float, int, float]]] = {}
    try:
        for folder in {src, fsdp2}:
            run(["cp", "-r", folder, out], folder)  # the page cache warm, each checkout's first run paid
            _clean(out)
        for rnd in range(repeat):
            for name, (reads, cmd) in commands.items():
                trio = [("cp -r", ["cp", "-r", reads, out], ROOT), ("HEAD", cmd, ROOT), (commit, cmd, base)]
                trio = trio[:2] if name in older else trio  # a command COMMIT does not have
                for who, c, tree in trio if rnd % 2 == 0 else trio[::-1]:
                    samples.setdefault((name, who), []).append(run_usage(c, reads, tree))
                    _clean(out)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)

    def med(name: str, who: str, i: int) -> float:
        return statistics.median(x[i] for x in samples[(name, who)])

    def ratio(name: str, a: str, b: str) -> str:  # median and range of the per-round ratios
        r = [x[0] / y[0] for x, y in zip(samples[(name, a)], samples[(name, b)])]
        return f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"

    lines = [
        f"{repeat} rounds at {size_gib:g} GiB, {shards} shards, --no-fsync; each round runs cp -r, HEAD and "
        f"{commit} once, in alternating order; ratios are per round (median, range)",
        f"| command | HEAD s | {commit} s | cp -r s | HEAD / {commit} | HEAD x cp -r | {commit} x cp -r "
        f"| HEAD CPU s | {commit} CPU s | HEAD peak RSS MiB | {commit} peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in commands:
        if name in older:
            rss = max(x[1] for x in samples[(name, "HEAD")]) / 2**20
            lines.append(
                f"| {name} | {med(name, 'HEAD', 0):.3f} | - | {med(name, 'cp -r', 0):.3f} | - "
                f"| {ratio(name, 'HEAD', 'cp -r')} | - | {med(name, 'HEAD', 2):.3f} | - | {rss:.0f} | - |"
            )
            continue
        rss = [max(x[1] for x in samples[(name, w)]) / 2**20 for w in ("HEAD", commit)]
        lines.append(
            f"| {name} | {med(name, 'HEAD', 0):.3f} | {med(name, commit, 0):.3f} | {med(name, 'cp -r', 0):.3f} "
            f"| {ratio(name, 'HEAD', commit)} | {ratio(name, 'HEAD', 'cp -r')} | {ratio(name, commit, 'cp -r')} "
            f"| {med(name, 'HEAD', 2):.3f} | {med(name, commit, 2):.3f} | {rss[0]:.0f} | {rss[1]:.0f} |"
        )
    return "\n".join(lines)


def table(size_gib: float, results: Dict[str, Tuple[float, int]]) -> str:
    cp, _, cp_min = results["cp -r"]
    model = size_gib * 2**30
    lines = [
        f"| command ({size_gib:g} GiB) | median wall s | x cp -r | fastest s | fastest x cp -r | peak RSS MiB "
        "| RSS / model |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (wall, rss, fastest) in results.items():
        lines.append(
            f"| {name} | {wall:.2f} | {wall / cp:.2f} | {fastest:.2f} | {fastest / cp_min:.2f} "
            f"| {rss / 2**20:.0f} | {rss / model:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2", help="model sizes in GiB, comma separated")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--optimizer", action="store_true", help="include Adam state (3x the bytes)")
    ap.add_argument("--no-fairscale", action="store_true", help="skip the fairscale/metaseq baselines")
    ap.add_argument("--repeat", type=int, default=5, help="runs per command; the median wall time is reported")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench-out"))
    ap.add_argument("--plot", default=None, help="write a size vs time/RSS PNG here")
    ap.add_argument(
        "--many-instances",
        action="store_true",
        help=f"instead: {MANY[0]} shards of {MANY[1]} small FSDP instances with Adam state "
        f"({3 * MANY[2]:g} GiB), resharded to 48 and consolidated: the per-run costs",
    )
    ap.add_argument(
        "--fsdp2",
        action="store_true",
        help="instead: torch FSDP2 per-rank files (verl's layout), consolidated and resharded 8->3",
    )
    ap.add_argument(
        "--model-parts",
        action="store_true",
        help="instead: model-parallel parts (metaseq's model_part-K-shardR): the OPT-175B-shaped plan (8 x 124 "
        "files), then 8 x 8 shards of --sizes GiB consolidated across parts and resharded",
    )
    ap.add_argument(
        "--against",
        metavar="COMMIT",
        help="instead: HEAD against COMMIT (checked out in a git worktree) and cp -r, --repeat rounds at each of "
        "--sizes: consolidate and reshard of fairscale shards, HSDP reshard of FSDP2 files",
    )
    ap.add_argument(
        "--only",
        default="",
        metavar="REGEX",
        help="run only the rows whose name matches (cp -r always runs): fewer rows afford more --repeat, "
        "e.g. --only 'no-fsync' --repeat 9",
    )
    ap.add_argument(
        "--prefault-gib",
        type=float,
        default=None,
        help="memory touched and freed before each timed command (default: 8 GiB or twice the bytes "
        "of the size being run, Adam state included, whichever is more; at most half the free "
        "memory); 0 turns it off",
    )
    args = ap.parse_args()
    global PREFAULT, ONLY
    ONLY = re.compile(args.only)
    sizes = [float(s) for s in args.sizes.split(",")]
    os.makedirs(args.work, exist_ok=True)
    # An installed package has its bytecode compiled; an editable one under PYTHONDONTWRITEBYTECODE (as in this
    # project's shell) would compile every module on every run (~0.025 s). Compile once, as pip install does.
    subprocess.run(
        [PY, "-m", "compileall", "-q", os.path.join(ROOT, "ckptshard")], check=True, stdout=subprocess.DEVNULL
    )
    print(
        f"machine: {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM; "
        f"python {sys.version.split()[0]}; warm page cache\n"
    )
    if args.fsdp2:
        PREFAULT = prefault_bytes(8 if args.prefault_gib is None else args.prefault_gib)
        size = float(args.sizes.split(",")[0])
        print(table(size, bench_fsdp2(args.work, size, args.shards, args.repeat)), flush=True)
        return
    if args.model_parts:
        PREFAULT = prefault_bytes(8 if args.prefault_gib is None else args.prefault_gib)
        size = float(args.sizes.split(",")[0])
        print(table(size, bench_model_parts(args.work, size, args.repeat)), flush=True)
        return
    if args.many_instances:
        PREFAULT = prefault_bytes(8 if args.prefault_gib is None else args.prefault_gib)
        print(table(3 * MANY[2], bench_many(args.work, args.repeat)), flush=True)
        return
    if args.against:
        for size in sizes:
            PREFAULT = prefault_bytes(max(8, 4 * size) if args.prefault_gib is None else args.prefault_gib)
            print(bench_against(args.work, size, args.shards, args.against, args.repeat) + "\n", flush=True)
        return
    all_results = {}
    for size in sizes:
        # Twice the bytes alone was too little: 2 GiB before each 1 GiB run left cp -r at 1.85 s (0.29-0.34 s after 8).
        want = max(8, 2 * size * (3 if args.optimizer else 1)) if args.prefault_gib is None else args.prefault_gib
        PREFAULT = prefault_bytes(want)
        print(f"{size:g} GiB: {PREFAULT / 2**30:.1f} GiB prefaulted before each run", flush=True)
        all_results[size] = bench_size(args.work, size, args.shards, args.optimizer, not args.no_fairscale, args.repeat)
        print(table(size, all_results[size]) + "\n", flush=True)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        sizes = sorted(all_results)
        for name in all_results[sizes[0]]:
            a1.plot(sizes, [all_results[s][name][0] for s in sizes], marker="o", label=name)
            a2.plot(sizes, [all_results[s][name][1] / 2**20 for s in sizes], marker="o", label=name)
        a1.set(xlabel="model GiB", ylabel="wall s", title="time")
        a2.set(xlabel="model GiB", ylabel="peak RSS MiB", title="memory")
        a1.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()

"""ckptshard on S3 against a plain parallel download + upload of the same bytes, on a local S3 server.

Starts moto's S3 server on 127.0.0.1, uploads a fairscale checkpoint made by bench.py's generator (``--gib``
GiB in 8 shards), then in rounds, each command in its own process:

- ``ckptshard consolidate s3://.../src -o s3://.../full.safetensors`` and ``reshard ... -n 3``;
- the baseline: ``fs.get`` of the source prefix to local disk and ``fs.put`` of it back (s3fs, parallel), the
  bytes any tool that stages must move.

Prints wall time (median, range) and peak RSS of each (``ru_maxrss`` of the process; the server's is its own).

    .venv/bin/python scripts/bench_s3.py [--gib 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = (
    "import resource,subprocess,sys,time; t=time.perf_counter(); "
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
    "print(time.perf_counter()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
COPY = r"""
import os, sys, tempfile, shutil, s3fs
fs = s3fs.S3FileSystem()
src, dst = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp()
fs.get(src, tmp + "/x", recursive=True)
fs.put(tmp + "/x", dst, recursive=True)
shutil.rmtree(tmp)
"""


def timed(cmd: list) -> tuple:
    out = subprocess.run([sys.executable, "-c", PEAK, *cmd], capture_output=True, text=True, check=True, cwd=HERE)
    wall, rss = out.stdout.split()
    return float(wall), int(rss) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    import s3fs

    sys.path.insert(0, os.path.join(HERE, "scripts"))
    from bench import gen  # the same generator as the local benchmarks

    work = tempfile.mkdtemp(prefix="bench-s3-")
    src = os.path.join(work, "src")
    gen(src, a.gib, 8, False)
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    fs = s3fs.S3FileSystem()
    fs.mkdir("bench")
    fs.put(src, "bench/src", recursive=True)
    cmds = {
        "ckptshard consolidate": ["-m", "ckptshard.cli", "consolidate", "s3://bench/src", "-o",
                                  "s3://bench/out/full.safetensors", "-q", "--no-fsync", "--overwrite"],
        "ckptshard reshard 8->3": ["-m", "ckptshard.cli", "reshard", "s3://bench/src", "-n", "3", "-o",
                                   "s3://bench/out/r3", "-q", "--no-fsync", "--overwrite"],
        "get + put (s3fs)": ["-c", COPY, "bench/src", "bench/out/copy"],
    }  # fmt: skip
    got = {k: [] for k in cmds}
    for i in range(a.rounds):
        for name in list(cmds) if i % 2 == 0 else list(cmds)[::-1]:
            got[name].append(timed([sys.executable, *cmds[name]]))
            fs.invalidate_cache()
            if fs.exists("bench/out/copy"):
                fs.rm("bench/out/copy", recursive=True)
    for out in ("s3://bench/out/full.safetensors", "s3://bench/out/r3"):  # what the last round published is whole
        subprocess.run(
            [sys.executable, "-m", "ckptshard.cli", "verify", out], check=True, stdout=subprocess.DEVNULL, cwd=HERE
        )
    base = statistics.median(w for w, _ in got["get + put (s3fs)"])
    print(f"source: {size / 2**30:.2f} GiB in 8 shards on moto's S3 server (127.0.0.1), {a.rounds} rounds")
    print(f"{'':26} {'median s':>9} {'range s':>13} {'x get+put':>10} {'peak RSS':>10}")
    for name, runs in got.items():
        walls = [w for w, _ in runs]
        med = statistics.median(walls)
        print(f"{name:26} {med:9.2f} {min(walls):6.2f}-{max(walls):<6.2f} {med / base:10.2f} "
              f"{max(r for _, r in runs):7.0f} MiB")  # fmt: skip
    server.stop()
    shutil.rmtree(work)


if __name__ == "__main__":
    main()

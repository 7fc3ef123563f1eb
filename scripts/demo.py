"""The demo: train a tiny VISSL-like model with real fairscale FSDP on 4 CPU
ranks, then inspect, consolidate, reshard and convert it to DCP with the CLI, and
load the DCP folder into torch FSDP2 on 2 ranks.

Run from the repository root: ``make demo`` (or ``.venv/bin/python scripts/demo.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import safetensors.torch
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo")
CLI = [sys.executable, "-m", "ckptshard.cli"]


def run(*args: str) -> None:
    print("\n$ ckptshard " + " ".join(os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in args), flush=True)
    subprocess.run(CLI + list(args) + ["--quiet"] * (args[0] != "inspect"), check=True, cwd=ROOT)


def main() -> None:
    from ckptshard.testing.fixtures import build_fixture

    shutil.rmtree(DEMO, ignore_errors=True)
    print("training 3 steps with fairscale FSDP on 4 CPU ranks (gloo)...", flush=True)
    build_fixture(DEMO, 4)
    src = os.path.join(DEMO, "fairseq")
    run("inspect", src)
    run("consolidate", src, "-o", os.path.join(DEMO, "full.safetensors"))
    run("consolidate", src, "-o", os.path.join(DEMO, "full.pt"), "--optimizer")
    run("reshard", src, "--world-size", "3", "-o", os.path.join(DEMO, "resharded-3"))
    run(
        "reshard",
        os.path.join(DEMO, "vissl", "model_phase2.torch"),
        "--world-size",
        "8",
        "-o",
        os.path.join(DEMO, "vissl-8"),
    )
    run("convert", src, "--to", "dcp", "-o", os.path.join(DEMO, "ckpt.dcp"))

    live = torch.load(os.path.join(DEMO, "ref", "full_state_dict.pt"), weights_only=True)
    ours = safetensors.torch.load_file(os.path.join(DEMO, "full.safetensors"))
    same = set(live) == set(ours) and all(torch.equal(live[k], ours[k]) for k in live)
    print(f"\nconsolidated == live FSDP state_dict(): {same} ({len(ours)} tensors)")

    from ckptshard.testing.fsdp2 import load_in_fsdp2

    loaded = os.path.join(DEMO, "fsdp2-loaded.pt")
    load_in_fsdp2(2, [{"dcp": os.path.join(DEMO, "ckpt.dcp"), "out": loaded}])
    fsdp2 = torch.load(loaded, weights_only=False)["model"]
    same_dcp = set(live) == set(fsdp2) and all(torch.equal(live[k], fsdp2[k]) for k in live)
    print(f"DCP loaded into torch FSDP2 on 2 ranks == live fairscale state_dict(): {same_dcp}")
    sys.exit(0 if same and same_dcp else 1)


if __name__ == "__main__":
    main()

"""Make tests/data/gpu-saved: real fairscale FSDP runs on a GPU, saved in every container.

    python scripts/make_gpu_fixtures.py OUTDIR      # on a machine with one GPU or more

Trains the test fixture model (ckptshard.testing) for 3 steps and saves
what tests/conftest.py's CPU fixtures save (fairseq, metaseq and VISSL
shards; the live state_dict() and gather_full_optim_state_dict() in ref/),
but with the model, optimizer state and collectives on the GPU, so every
storage in the files is tagged cuda:0. Worlds: NCCL at 1 rank, and gloo
with CUDA tensors at 2 and 3 ranks sharing GPU 0 (NCCL wants a GPU per
rank). Each world is then consolidated by ckptshard's CLI on the spot and
compared with its live state_dict(); tests/test_gpu_saved.py checks the
files again on any machine, and reshards them against real FSDP at other
world sizes. ``CPU=1`` runs the same on a machine without CUDA (a smoke
test of this script; the files are then CPU-tagged).
"""

import os
import socket
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, ws, p, backend, out, variant):
    cpu = os.environ.get("CPU") == "1"  # smoke run of this script on a machine without CUDA
    if not cpu:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{p}", rank=rank, world_size=ws)
    import ckptshard.fsdp.cpu_compat as cc
    import ckptshard.fsdp.wrapping as wr

    kw = {"bucket_cap_mb": 0} if backend == "gloo" else {}  # gloo's reduce-scatter takes no 2-D bucket
    if cpu:
        cc.install_cpu_compat(force=True)
        kw = cc.cpu_fsdp_kwargs()
    cc.cpu_fsdp_kwargs = lambda: dict(kw)
    wr.cpu_fsdp_kwargs = lambda: dict(kw)
    from ckptshard.testing.fixtures import (
        inner,
        make_optimizer,
        save_containers,
        wrap_fixture_model,
    )
    from ckptshard.testing.model import VisslLikeModel, local_batch, loss_fn

    torch.manual_seed(0)
    root = wrap_fixture_model(VisslLikeModel().to("cpu" if cpu else "cuda"), variant)
    optim = make_optimizer(root.parameters(), variant)
    losses = []
    for step in range(3):
        x, *ys = (t.to("cpu" if cpu else "cuda") for t in local_batch(step, rank, ws, 0))
        loss = loss_fn(root(x), tuple(ys))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    full = root.state_dict()
    try:
        full_optim = root.gather_full_optim_state_dict(optim) if ws > 1 else None
    except Exception as e:
        print(f"rank {rank}: gather_full_optim_state_dict failed: {e!r}", flush=True)
        full_optim = None
    m = inner(root)
    save_containers(
        out,
        rank,
        ws,
        root.local_state_dict(),
        root.local_metadata_dict(),
        optim.state_dict(),
        m.trunk.local_state_dict(),
        m.trunk.local_metadata_dict(),
        [m.heads[0].local_state_dict()],
        [m.heads[0].local_metadata_dict()],
        3,
    )
    if rank == 0:
        os.makedirs(os.path.join(out, "ref"), exist_ok=True)
        torch.save(full, os.path.join(out, "ref", "full_state_dict.pt"))
        if full_optim is not None:
            torch.save(full_optim, os.path.join(out, "ref", "full_optim.pt"))
        torch.save(
            {"losses": losses, "variant": variant, "world_size": ws, "backend": backend},
            os.path.join(out, "ref", "losses.pt"),
        )
    dist.barrier()
    dist.destroy_process_group()


def check(folder):
    """ckptshard's CLI consolidates every container; compare with the live state_dict (and optimizer)."""
    full = torch.load(os.path.join(folder, "ref", "full_state_dict.pt"), map_location="cpu", weights_only=True)
    lines = []
    for c in ("fairseq", "metaseq", "vissl/model_phase2.torch"):
        for ext in (".pt", ".safetensors"):
            out = os.path.join(folder, "ck", c.split("/")[0] + ext)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            args = [sys.executable, "-m", "ckptshard.cli", "consolidate", os.path.join(folder, c), "-o", out, "-q"]
            if ext == ".pt" and os.path.exists(os.path.join(folder, "ref", "full_optim.pt")) and c != "fairseq":
                args.append("--optimizer")
            r = subprocess.run(args, capture_output=True, text=True)
            if r.returncode:
                lines.append(f"{c}{ext}: rc {r.returncode}: {r.stderr.strip()[-300:]}")
                continue
            if ext == ".pt":
                sd = torch.load(out, weights_only=True)
            else:
                from safetensors.torch import load_file

                sd = load_file(out)
            same = sd.keys() == full.keys() and all(torch.equal(sd[k], full[k]) for k in full)
            lines.append(f"{c}{ext}: == live state_dict(): {same} ({len(full)} tensors)")
    optim_ref = os.path.join(folder, "ref", "full_optim.pt")
    if os.path.exists(optim_ref):
        theirs = torch.load(optim_ref, map_location="cpu", weights_only=True)
        ours = torch.load(os.path.join(folder, "ck", "metaseq.optim.pt"), weights_only=True)
        same = ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
        for gid, s in theirs["state"].items():
            for k, v in s.items():
                o = ours["state"][gid].get(k)
                same = same and (torch.equal(o, v) if torch.is_tensor(v) else o == v)
        lines.append(f"metaseq --optimizer == gather_full_optim_state_dict(): {same}")
    return lines


if __name__ == "__main__":
    base = sys.argv[1]
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(), flush=True)
    worlds = (("nccl", 1, "mixed"), ("gloo", 2, "mixed"), ("gloo", 3, "fp32"), ("gloo", 2, "half"))
    if os.environ.get("CPU") == "1":
        worlds = tuple(("gloo",) + w[1:] for w in worlds)
    for backend, ws, variant in worlds:
        out = os.path.join(base, f"{backend}-ws{ws}-{variant}")
        t = time.time()
        try:
            ctx = mp.start_processes(
                worker, args=(ws, port(), backend, out, variant), nprocs=ws, join=False, start_method="spawn"
            )
            while not ctx.join(timeout=1):
                if time.time() - t > 45:
                    for proc in ctx.processes:
                        proc.kill()
                    raise TimeoutError("world hung for 45 s")
            print(f"{out}: trained and saved in {time.time() - t:.1f} s", flush=True)
            for line in check(out):
                print("   ", line, flush=True)
        except Exception:
            print(f"{out}: FAILED after {time.time() - t:.1f} s\n{traceback.format_exc()[-1500:]}", flush=True)

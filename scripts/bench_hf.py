"""From verl's FSDP2 files to a Hugging Face model folder: ckptshard against what verl's model_merger does.

Builds (once) a Llama of a few hundred MB under FSDP2 on 2 gloo ranks with verl's shard_placement_fn, saved in
verl's layout (rank files, fsdp_config.json, huggingface/). Then, each in its own process, in rounds:

- ``ckptshard consolidate SRC -o DIR --no-fsync -q``: a finished model folder, streamed;
- the merger's way: ``torch.load`` every rank's file, ``DTensor`` pieces joined with ``torch.cat`` on each
  placement's dimension, the model made from ``huggingface/config.json`` and ``save_pretrained`` of that state
  dict, the tokenizer and generation config copied (verl's ``model_merger`` merges so, in bf16 by default; here
  the dtype is kept so that both write the same bytes of weights).

Prints wall time (median and range) and peak RSS of each, and checks both folders load the same weights.

    .venv/bin/python scripts/bench_hf.py [--rounds 5] [--work /tmp/bench-hf]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {  # a Llama of 92 M parameters: 350 MiB in fp32
    "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
    "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}  # fmt: skip


def _save_worker(rank: int, world: int, out: str) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from ckptshard.testing.hf_runs import tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES)
    model = LlamaForCausalLM(config)

    def place(p):  # verl's get_shard_placement_fn(fsdp_size=world)
        return Shard(next((i for i, n in enumerate(p.shape) if n % world == 0), 0))

    for layer in model.model.layers:
        fully_shard(layer, shard_placement_fn=place)
    fully_shard(model, shard_placement_fn=place)
    torch.save(model.state_dict(), os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"))
    if rank == 0:
        import json

        with open(os.path.join(out, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world}, f)
        hf = os.path.join(out, "huggingface")
        config.save_pretrained(hf)
        GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(hf)
        tokenizer().save_pretrained(hf)


def build(src: str) -> None:
    from ckptshard.fsdp.launch import run_world

    if os.path.exists(os.path.join(src, ".done")):
        return
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    run_world(_save_worker, 2, src)
    open(os.path.join(src, ".done"), "w").close()


MERGER = r"""
import os, sys, shutil, torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM
src, out = sys.argv[1], sys.argv[2]
world = 2
names = [os.path.join(src, f"model_world_size_{world}_rank_{r}.pt") for r in range(world)]
shards = [torch.load(name, weights_only=False) for name in names]
state = {}
for key in list(shards[0]):
    pieces = [sd[key] for sd in shards]
    if isinstance(pieces[0], DTensor):
        dim = pieces[0].placements[0].dim
        state[key] = torch.cat([p._local_tensor for p in pieces], dim=dim)
    else:
        state[key] = pieces[0]
    for sd in shards:
        del sd[key]
hf = os.path.join(src, "huggingface")
config = AutoConfig.from_pretrained(hf)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
model.to_empty(device="cpu")
model.save_pretrained(out, state_dict=state)
for name in os.listdir(hf):
    if name != "config.json":
        shutil.copy(os.path.join(hf, name), out)
"""


def run(args: list) -> float:
    """Wall seconds of one command."""
    t0 = time.perf_counter()
    subprocess.run(args, check=True, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _check_same_weights(cmds: dict, work: str) -> None:
    """Both ways write the same tensors (every name, torch.equal), or the timings compare nothing."""
    import torch
    from safetensors.torch import load_file

    found = []
    for name, cmd in cmds.items():
        out = os.path.join(work, f"check-{name.split()[0]}")
        shutil.rmtree(out, ignore_errors=True)
        run([c.replace("{out}", out) for c in cmd])
        tensors = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(out, f)))
        found.append(tensors)
        shutil.rmtree(out)
    a, b = found
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), "the two folders hold different weights"
    print(f"both folders hold the same {len(a)} tensors (torch.equal)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", default="/tmp/bench-hf")
    a = ap.parse_args()
    src = os.path.join(a.work, "actor")
    build(src)
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.startswith("model_"))
    print(f"source: {size / 2**20:.0f} MiB in 2 FSDP2 rank files ({src})")
    cmds = {
        "ckptshard consolidate": [sys.executable, "-m", "ckptshard.cli", "consolidate", src, "-o", "{out}", "-q",
                                  "--no-fsync"],
        "load ranks + save_pretrained": [sys.executable, "-c", MERGER, src, "{out}"],
    }  # fmt: skip
    times = {k: [] for k in cmds}
    peaks = {}
    for name, cmd in cmds.items():  # peak RSS: one kind at a time, in a fresh parent
        out = os.path.join(a.work, "peak")
        shutil.rmtree(out, ignore_errors=True)
        probe = "import resource,subprocess,sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"  # noqa: E501
        res = subprocess.run([sys.executable, "-c", probe, *[c.replace("{out}", out) for c in cmd]],
                             capture_output=True, text=True, check=True, cwd=HERE)  # fmt: skip
        peaks[name] = int(res.stdout.strip()) / 1024
    for i in range(a.rounds):
        order = list(cmds) if i % 2 == 0 else list(cmds)[::-1]
        for name in order:
            out = os.path.join(a.work, f"out-{i}-{name.split()[0]}")
            shutil.rmtree(out, ignore_errors=True)
            times[name].append(run([c.replace("{out}", out) for c in cmds[name]]))
            shutil.rmtree(out, ignore_errors=True)
    _check_same_weights(cmds, a.work)
    base = statistics.median(times["load ranks + save_pretrained"])
    print(f"{'':32} {'median s':>9} {'range s':>13} {'x merger':>9} {'peak RSS':>9}")
    for name, ts in times.items():
        rng = f"{min(ts):.2f}-{max(ts):.2f}"
        med = statistics.median(ts)
        print(f"{name:32} {med:9.2f} {rng:>13} {med / base:9.2f} {peaks[name]:7.0f} MiB")


if __name__ == "__main__":
    main()

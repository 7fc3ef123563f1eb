"""Synthetic fairscale checkpoints of any size, without running FSDP.

The model is ``SyntheticModel``: a LayerNorm at the root plus ``layers``
Linear layers, each its own flattened FSDP instance. Every weight value is a
function of its position, so any slice can be made without the whole tensor
and a rank's shard costs only its own bytes. ``tests/test_synthetic.py``
checks the shards equal what real FSDP saves for the same weights.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch
import torch.nn as nn

from ..layout.chunking import chunk_size, shard_range
from ..layout.model import FlatParam, FsdpInstance, Member, Part, metadata_of


class SyntheticModel(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _part(layers: int, width: int, dtype: torch.dtype) -> Part:
    def flat(names_shapes: List[tuple]) -> FlatParam:
        members, off = [], 0
        for n, s in names_shapes:
            k = int(torch.Size(s).numel())
            members.append(Member(n, tuple(s), off, k))
            off += k
        return FlatParam("flat_param_0", tuple(members), off, dtype)

    root = FsdpInstance("", (flat([("norm.weight", (width,)), ("norm.bias", (width,))]),), (), False)
    insts = [
        FsdpInstance(f"layers.{i}", (flat([("weight", (width, width)), ("bias", (width,))]),), (), False)
        for i in range(layers)
    ]
    return Part("model", "", (root, *insts), ())


def values(instance_index: int, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, stop)`` of instance ``instance_index``'s flat parameter."""
    idx = torch.arange(start, stop, dtype=torch.float64)
    return (torch.sin(idx * 0.001 + instance_index) * 0.1).to(dtype)


def full_state_dict(layers: int, width: int, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """The unsharded weights the synthetic shards hold (small sizes only)."""
    out: Dict[str, torch.Tensor] = {}
    for i, inst in enumerate(_part(layers, width, dtype).instances):
        fp = inst.flat_params[0]
        flat = values(i, 0, fp.numel, dtype)
        for m in fp.members:
            out[inst.logical_name(m.name)] = flat[m.offset : m.offset + m.numel].view(m.shape).clone()
    return out


def width_for(total_bytes: int, layers: int, itemsize: int = 4) -> int:
    """The width that makes ``layers`` Linear layers hold about ``total_bytes``."""
    return max(4, int((total_bytes / itemsize / layers) ** 0.5))


def write_synthetic(
    out: str,
    world_size: int,
    layers: int,
    width: int,
    dtype: torch.dtype = torch.float32,
    optimizer: bool = False,
) -> List[str]:
    """Write fairseq-style ``checkpoint_last-shard{r}.pt`` files into ``out``.

    With ``optimizer``, Adam-like state (``exp_avg``, ``exp_avg_sq``, ``step``)
    is added, so the files are three times the weights' size.
    """
    os.makedirs(out, exist_ok=True)
    part = _part(layers, width, dtype)
    paths = []
    for rank in range(world_size):
        model: Dict[str, torch.Tensor] = {}
        state: Dict[int, Dict[str, object]] = {}
        for i, inst in enumerate(part.instances):
            fp = inst.flat_params[0]
            c = chunk_size(fp.numel, world_size)
            start, stop = shard_range(fp.numel, world_size, rank)
            shard = torch.zeros(c, dtype=dtype)
            shard[: stop - start] = values(i, start, stop, dtype)
            model[inst.local_key(fp)] = shard
            if optimizer:
                state[i] = {"step": torch.tensor(10.0), "exp_avg": shard * 0.5, "exp_avg_sq": shard * shard}
        obj = {"model": model, "fsdp_metadata": metadata_of(part, world_size, rank), "cfg": {}, "extra_state": {}}
        if optimizer:
            obj["last_optimizer_state"] = {
                "state": state,
                "param_groups": [
                    {
                        "lr": 1e-3,
                        "betas": (0.9, 0.999),
                        "eps": 1e-8,
                        "weight_decay": 0.0,
                        "amsgrad": False,
                        "params": list(range(len(part.instances))),
                    }
                ],
            }
        path = os.path.join(out, f"checkpoint_last-shard{rank}.pt")
        torch.save(obj, path)
        paths.append(path)
        del model, state, obj
    return paths


def write_synthetic_fsdp2(out: str, world_size: int, layers: int, width: int, fsdp1: bool = False) -> None:
    """verl-style FSDP2 per-rank files (``model_world_size_{W}_rank_{r}.pt``) of ``layers`` Linear layers,
    each weight a DTensor of ``width`` + 1 rows (uneven over most world sizes), made over a fake process group.
    ``fsdp1``: FSDP1's SHARDED_STATE_DICT files instead (ShardedTensors of the same rows)."""
    from ..layout.dim_shards import chunk_sizes
    from ..write.dtensor_mesh import dtensor_of, fake_mesh, sharded_tensor_of

    make = sharded_tensor_of if fsdp1 else dtensor_of

    os.makedirs(out, exist_ok=True)
    rows = width + 1
    for r in range(world_size):
        sizes = chunk_sizes(rows, world_size)
        g = torch.Generator().manual_seed(r)
        with fake_mesh(world_size, r) as mesh:
            sd = {}
            for i in range(layers):
                local = torch.randn(sizes[r], width, generator=g)
                sd[f"layers.{i}.weight"] = make(local, mesh, (rows, width), (("shard", 0),))
                sd[f"layers.{i}.bias"] = make(torch.randn(sizes[r], generator=g), mesh, (rows,), (("shard", 0),))
            torch.save(sd, os.path.join(out, f"model_world_size_{world_size}_rank_{r}.pt"))


def write_synthetic_parts(
    out: str, parts: int, world_size: int, layers: int, width: int, drift: float = 0.0, optimizer: bool = False
) -> None:
    """``parts`` model-parallel parts of the synthetic model, metaseq's naming
    (``checkpoint_last-model_part-{k}-shard{r}.pt``). Every part holds the same values (all replicated), but
    part ``k``'s root LayerNorm is scaled by ``1 + k * drift``: the drift real GPU runs show between parts."""
    os.makedirs(out, exist_ok=True)
    for k in range(parts):
        tmp = os.path.join(out, f".part{k}")
        for rank, path in enumerate(write_synthetic(tmp, world_size, layers, width, optimizer=optimizer)):
            obj = torch.load(path, weights_only=False)
            obj["shard_metadata"] = obj.pop("fsdp_metadata")
            obj["optimizer_history"] = [{"num_updates": 10}]
            if drift and k:
                root = next(key for key in obj["model"] if "layers" not in key)
                obj["model"][root] = obj["model"][root] * (1 + k * drift)
            torch.save(obj, os.path.join(out, f"checkpoint_last-model_part-{k}-shard{rank}.pt"))
            os.remove(path)
        os.rmdir(tmp)

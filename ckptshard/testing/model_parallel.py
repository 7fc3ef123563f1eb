"""Model-parallel parts x FSDP shards, saved as metaseq saves them, from a real gloo run.

An OPT-shaped decoder built from fairscale's model-parallel layers
(``VocabParallelEmbedding``; per layer a fused ``qkv_proj`` and ``fc1`` as
``ColumnParallelLinear``, ``out_proj`` and ``fc2`` as ``RowParallelLinear``,
LayerNorms replicated; the output projection tied to the embedding), with
``initialize_model_parallel(K)`` over ``K * M`` ranks, each layer and the
root in fairscale FSDP over the data-parallel group. Each part's fused
``qkv_proj`` holds ``[k_i; v_i; q_i]`` for its own heads, as metaseq's does.

``build_mp_run(out, K, M)`` writes::

    checkpoint_last-model_part-{k}-shard{r}.pt   model, shard_metadata, last_optimizer_state, optimizer_history
    ref/gathered.pt     the model at model-parallel size 1, gathered by layer type from every part's live
                        state_dict(): column-parallel and vocab-parallel on dim 0 (qkv regrouped as
                        [k_0..k_K; v_0..v_K; q_0..q_K]), row-parallel weights on dim 1, the rest from part 0
    ref/parts.pt        every part's live state_dict() (full over its data-parallel group)
    ref/gathered_moments.pt  each Adam moment gathered the same way, by parameter name (each part's moment
                        shards loaded as the weights of a fresh model, whose state_dict() is the full moment)
    ref/logits.pt       the live model's logits on a fixed batch

``fsdp_at(out, K, N, dst)`` loads each part's full state into FSDP at N
data-parallel ranks and saves ``local_state_dict()`` per part and rank: what
FSDP at N saves, the oracle for reshard. ``logits_at_mp1(state)`` runs the
model at model-parallel size 1 with a full state dict.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..fsdp.launch import run_world

VOCAB, DIM, HEADS, FFN, LAYERS, LENGTH, GLOBAL_BATCH = 16, 8, 4, 12, 2, 5, 8  # splits 1, 2 or 4 ways
STEPS = 2


def _layers() -> Any:
    from fairscale.nn.model_parallel import layers

    return layers


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from fairscale.nn.model_parallel.initialize import get_model_parallel_world_size

        mp = _layers()
        self.qkv_proj = mp.ColumnParallelLinear(DIM, 3 * DIM, gather_output=False)
        self.out_proj = mp.RowParallelLinear(DIM, DIM, input_is_parallel=True)
        self.local_heads = HEADS // get_model_parallel_world_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        k, v, q = self.qkv_proj(x).chunk(3, dim=-1)  # this part's heads, metaseq's [k; v; q] order
        hd = DIM // HEADS

        def heads(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, self.local_heads, hd).transpose(1, 2)

        scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(b, t, self.local_heads * hd)
        return self.out_proj(out)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        mp = _layers()
        self.self_attn = Attention()
        self.self_attn_layer_norm = nn.LayerNorm(DIM)
        self.fc1 = mp.ColumnParallelLinear(DIM, FFN, gather_output=False)
        self.fc2 = mp.RowParallelLinear(FFN, DIM, input_is_parallel=True)
        self.final_layer_norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        mp = _layers()
        self.embed_tokens = mp.VocabParallelEmbedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.layer_norm = nn.LayerNorm(DIM)
        self.output_projection = nn.Linear(DIM, self.embed_tokens.weight.shape[0], bias=False)
        self.output_projection.weight = self.embed_tokens.weight  # tied, split like the embedding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from fairscale.nn.model_parallel.mappings import (
            copy_to_model_parallel_region,
            gather_from_model_parallel_region,
        )

        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        x = copy_to_model_parallel_region(self.layer_norm(x))
        return gather_from_model_parallel_region(self.output_projection(x))


class OptLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = Decoder()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens)


def _groups(model_parallel: int) -> Any:
    from fairscale.nn.model_parallel import initialize as mpu

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(model_parallel)
    return mpu


def wrapped(seed: int, model_parallel: int) -> Any:
    """The model at this model-parallel size, each layer and the root in FSDP over the data-parallel group."""
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ..fsdp.cpu_compat import cpu_fsdp_kwargs

    mpu = _groups(model_parallel)
    torch.manual_seed(seed)
    model = OptLike()
    dp = mpu.get_data_parallel_group()
    kw = {"process_group": dp, "process_group_reduce_scatter": dp, **cpu_fsdp_kwargs()}
    for i, layer in enumerate(model.decoder.layers):
        model.decoder.layers[i] = FSDP(layer, **kw)
    return FSDP(model, **kw), mpu


def _batch(step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(step))
    per = GLOBAL_BATCH // dp_size
    return tokens[dp_rank * per : (dp_rank + 1) * per]


def _loss(root: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = root(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


EVAL = torch.arange(2 * LENGTH).reshape(2, LENGTH) % VOCAB


def _splits(model: nn.Module) -> Dict[str, Any]:
    """State-dict name -> (dimension, groups) of every tensor tensor parallelism splits, by module class."""
    mp = _layers()
    split: Dict[str, Any] = {}
    for name, m in model.named_modules():
        name = re.sub(r"(_fsdp_wrapped_module|_fpw_module)\.", "", name)
        prefix = name + "." if name else ""
        if isinstance(m, mp.VocabParallelEmbedding):
            split[prefix + "weight"] = (0, 1)
        elif isinstance(m, mp.ColumnParallelLinear):
            groups = 3 if name.endswith("qkv_proj") else 1
            split[prefix + "weight"] = split[prefix + "bias"] = (0, groups)
        elif isinstance(m, mp.RowParallelLinear):
            split[prefix + "weight"] = (1, 1)
    split["decoder.output_projection.weight"] = split["decoder.embed_tokens.weight"]
    return split


def gathered_by_layer_type(model: nn.Module, parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The state dict at model-parallel size 1, from every part's full state, by each module's class."""
    split = _splits(model)
    out = {}
    for key in parts[0]:
        if key not in split:
            out[key] = parts[0][key].clone()
            continue
        dim, groups = split[key]
        pieces = [p[key].chunk(groups, dim) for p in parts]  # each part: its groups in order
        out[key] = torch.cat([piece[g] for g in range(groups) for piece in pieces], dim)
    return out


def split_by_layer_type(model: nn.Module, full: Dict[str, torch.Tensor], parts: int) -> List[Dict[str, torch.Tensor]]:
    """The inverse: part j of ``parts`` holds, of each group of a split tensor, its j-th slice."""
    split = _splits(model)
    out: List[Dict[str, torch.Tensor]] = [{} for _ in range(parts)]
    for key, t in full.items():
        for j in range(parts):
            if key in split:
                dim, groups = split[key]
                out[j][key] = torch.cat([g.chunk(parts, dim)[j] for g in t.chunk(groups, dim)], dim).clone()
            else:
                out[j][key] = t.clone()
    return out


MOMENTS = ("exp_avg", "exp_avg_sq")


def _full_moments(root: Any, optim: torch.optim.Optimizer, model_parallel: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """Each Adam moment of this part as a full state dict: its shards loaded as the weights of a fresh model
    (collective over the data-parallel group)."""
    from ..fsdp.state import init_param_attributes

    drop = ("_fsdp_wrapped_module", "_fpw_module")  # state-dict hooks drop them
    keys = [".".join(p for p in n.split(".") if p not in drop) for n, _ in root.named_parameters()]
    state, local = optim.state_dict()["state"], root.local_state_dict()
    out = {}
    for k in MOMENTS:
        carrier, _ = wrapped(5, model_parallel)
        init_param_attributes(carrier)
        carrier.load_local_state_dict({**local, **{key: state[i][k] for i, key in enumerate(keys)}}, strict=True)
        out[k] = {n: t.clone() for n, t in carrier.state_dict().items()}
    return out


def _run_worker(rank: int, world: int, out: str, model_parallel: int) -> None:
    import torch.distributed as dist

    root, mpu = wrapped(0, model_parallel)
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    part = mpu.get_model_parallel_rank()
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    for step in range(STEPS):
        _loss(root, _batch(step, dp_rank, dp_size)).backward()
        optim.step()
        optim.zero_grad()
    torch.save(
        {
            "model": root.local_state_dict(),
            "shard_metadata": root.local_metadata_dict(),
            "last_optimizer_state": optim.state_dict(),
            "optimizer_history": [{"num_updates": STEPS}],
            "extra_state": {"epoch": 1},
            "cfg": {"model": {"arch": "opt_like", "model_parallel_size": model_parallel}},
        },
        os.path.join(out, f"checkpoint_last-model_part-{part}-shard{dp_rank}.pt"),
    )
    full = root.state_dict()
    with torch.no_grad():
        logits = root(EVAL)
    parts: List[Any] = [None] * model_parallel
    dist.all_gather_object(parts, {k: v.clone() for k, v in full.items()}, group=mpu.get_model_parallel_group())
    moments: List[Any] = [None] * model_parallel
    dist.all_gather_object(moments, _full_moments(root, optim, model_parallel), group=mpu.get_model_parallel_group())
    if rank == 0:
        os.makedirs(os.path.join(out, "ref"), exist_ok=True)
        inner = root.module.module
        gathered = {k: gathered_by_layer_type(inner, [m[k] for m in moments]) for k in MOMENTS}
        torch.save(gathered, os.path.join(out, "ref", "gathered_moments.pt"))
        torch.save(parts, os.path.join(out, "ref", "parts.pt"))
        torch.save(gathered_by_layer_type(root.module.module, parts), os.path.join(out, "ref", "gathered.pt"))
        torch.save(logits, os.path.join(out, "ref", "logits.pt"))


def build_mp_run(out: str, model_parallel: int, data_parallel: int) -> str:
    os.makedirs(out, exist_ok=True)
    run_world(_run_worker, model_parallel * data_parallel, out, model_parallel)
    return out


def _fsdp_at_worker(rank: int, world: int, src: str, model_parallel: int, dst: str) -> None:
    root, mpu = wrapped(7, model_parallel)  # other initial values: loading must overwrite them
    part = mpu.get_model_parallel_rank()
    parts = torch.load(os.path.join(src, "ref", "parts.pt"), weights_only=True)
    if len(parts) != model_parallel:  # another number of parts: the gathered model cut by layer type
        gathered = torch.load(os.path.join(src, "ref", "gathered.pt"), weights_only=True)
        parts = split_by_layer_type(root.module.module, gathered, model_parallel)
    root.load_state_dict(parts[part])
    os.makedirs(dst, exist_ok=True)
    torch.save(root.local_state_dict(), os.path.join(dst, f"part-{part}-shard{mpu.get_data_parallel_rank()}.pt"))


def fsdp_at(src: str, model_parallel: int, data_parallel: int, dst: str) -> None:
    """FSDP's own local_state_dict() at ``model_parallel`` parts x ``data_parallel`` shards of ``src``'s model."""
    run_world(_fsdp_at_worker, model_parallel * data_parallel, src, model_parallel, dst)


def _mp1_worker(rank: int, world: int, state_path: str, out: str) -> None:
    root, _ = wrapped(3, 1)
    root.load_state_dict(torch.load(state_path, weights_only=True))
    with torch.no_grad():
        torch.save(root(EVAL), out)


def logits_at_mp1(state_path: str, out: str) -> None:
    """The model at model-parallel size 1 (one rank) with the full state dict ``state_path``: its logits."""
    run_world(_mp1_worker, 1, state_path, out)

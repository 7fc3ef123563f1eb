"""A second fixture model, unlike the VISSL-like one, trained with real fairscale FSDP.

A small transformer language model whose wrapping has what the first
fixture lacks: a 0-dim parameter first in the root's flat parameter, input
and output embeddings tied in the root, an FSDP instance nested inside a
wrapped ``TransformerEncoderLayer``, an FSDP instance with no parameters at
all, a non-persistent buffer in the root and AdamW with ``amsgrad`` (three
moments). Variant ``unflat`` also wraps one layer with
``flatten_parameters=False`` (many parameters in one unflattened instance);
fairscale cannot gather optimizer state for that one, so it has no
``full_optim``.

``build_transformer_fixture(out, variants, world_size)`` writes per variant::

    {variant}/src/checkpoint_last-shard{r}.pt   model, fsdp_metadata, last_optimizer_state, extra_state
    {variant}/ref.pt                            {"full": state_dict(), "full_optim": gather_full_optim_state_dict()}

``check_at_world_size(jobs, n)`` then records, for ckptshard's outputs made
from those, what real FSDP at world size ``n`` makes of them (see
:func:`_check_worker`).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List

import torch
import torch.nn as nn

from ..fsdp.launch import run_world

VOCAB, DIM, HEADS, FFN = 37, 10, 2, 14
STEPS = 3


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.5))  # 0-dim, first in the root's flat param
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(DIM, HEADS, FFN, dropout=0.0, batch_first=True) for _ in range(3)])
        self.act = nn.ReLU()
        self.norm = nn.BatchNorm1d(DIM)
        self.out = nn.Linear(DIM, VOCAB)
        self.out.weight = self.embed.weight  # tied inside the root instance
        self.register_buffer("positions", torch.arange(5.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.positions[: x.shape[1], None]
        for layer in self.layers:
            h = layer(h)
        h = self.norm(self.act(h).transpose(1, 2)).transpose(1, 2)
        return self.out(h) * self.temperature


def wrap(variant: str, seed: int) -> Any:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ..fsdp.cpu_compat import cpu_fsdp_kwargs

    torch.manual_seed(seed)
    m, base = TinyLM(), cpu_fsdp_kwargs()
    m.layers[0] = FSDP(m.layers[0], **base)
    m.layers[1] = FSDP(m.layers[1], flatten_parameters=variant != "unflat", **base)
    m.layers[2].linear1 = FSDP(m.layers[2].linear1, **base)  # nested inside the next instance
    m.layers[2] = FSDP(m.layers[2], **base)
    m.act = FSDP(m.act, **base)  # no parameters
    return FSDP(m, **base)


def make_optimizer(root: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(root.parameters(), lr=1e-2, amsgrad=True)


def _train_worker(rank: int, world_size: int, out: str, variants: List[str]) -> None:
    for variant in variants:
        root = wrap(variant, 0)
        optim = make_optimizer(root)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            loss = root(torch.randint(0, VOCAB, (2, 5), generator=g)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
        full = root.state_dict()
        full_optim = root.gather_full_optim_state_dict(optim) if variant != "unflat" else None
        folder = os.path.join(out, variant)
        os.makedirs(os.path.join(folder, "src"), exist_ok=True)
        torch.save({"model": root.local_state_dict(), "fsdp_metadata": root.local_metadata_dict(),
                    "last_optimizer_state": optim.state_dict(), "extra_state": {"epoch": 1}},
                   os.path.join(folder, "src", f"checkpoint_last-shard{rank}.pt"))
        if rank == 0:
            torch.save({"full": full, "full_optim": full_optim}, os.path.join(folder, "ref.pt"))


def build_transformer_fixture(out: str, variants: List[str], world_size: int) -> None:
    run_world(_train_worker, world_size, out, variants)


def _check_worker(rank: int, world_size: int, jobs: List[Dict[str, Any]]) -> None:
    """Per job (variant, ref, resharded, full, full_optim, out), what FSDP at ``world_size`` makes of it.

    ``oracle``: ``local_state_dict``/``local_metadata_dict`` after loading the
    full state, and ``get_shard_from_optim_state_dict`` of the full optimizer
    state. ``regathered``: ckptshard's resharded shard loaded with
    ``load_local_state_dict`` and ``optimizer.load_state_dict``, then
    ``state_dict()`` and ``gather_full_optim_state_dict()``. ``loaded``: the
    optimizer state ``ckptshard.fsdp.loading.load_checkpoint`` gives from the
    consolidated files (its full-state path).
    """
    from ..fsdp.loading import load_checkpoint
    from ..fsdp.state import init_param_attributes

    for job in jobs:
        ref = torch.load(job["ref"], weights_only=True)
        root = wrap(job["variant"], 1)
        root.load_state_dict(ref["full"])
        oracle_optim = None
        if ref["full_optim"] is not None:
            oracle_optim = root.get_shard_from_optim_state_dict(copy.deepcopy(ref["full_optim"]))
        record: Dict[str, Any] = {"local": root.local_state_dict(), "meta": root.local_metadata_dict(),
                                  "optim": oracle_optim}

        root = wrap(job["variant"], 2)
        optim = make_optimizer(root)
        init_param_attributes(root)
        ours = torch.load(os.path.join(job["resharded"], f"checkpoint_last-shard{rank}.pt"), weights_only=True)
        root.load_local_state_dict(ours["model"], strict=True)
        optim.load_state_dict(ours["last_optimizer_state"])
        record["regathered"] = root.state_dict()
        if ref["full_optim"] is not None:
            record["regathered_optim"] = root.gather_full_optim_state_dict(optim)

        if job.get("full_optim"):
            root = wrap(job["variant"], 3)
            optim = make_optimizer(root)
            report = load_checkpoint(root, job["full"], optim, full_optimizer=job["full_optim"])
            record["loaded_path"] = report.path
            record["loaded_optim"] = optim.state_dict()
        os.makedirs(job["out"], exist_ok=True)
        torch.save(record, os.path.join(job["out"], f"rank{rank}.pt"))


def check_at_world_size(jobs: List[Dict[str, Any]], world_size: int) -> None:
    run_world(_check_worker, world_size, jobs)

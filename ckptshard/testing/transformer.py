"""A second fixture model, unlike the VISSL-like one, trained with real fairscale FSDP.

A small transformer language model whose wrapping has what the first
fixture lacks: a 0-dim parameter first in the root's flat parameter, input
and output embeddings tied in the root, an FSDP instance nested inside a
wrapped ``TransformerEncoderLayer``, an FSDP instance with no parameters at
all, a non-persistent buffer in the root and AdamW with ``amsgrad`` (three
moments). Variant ``unflat`` also wraps one layer and the root with
``flatten_parameters=False``: many parameters in one unflattened instance,
the root's own parameters interleaved with its children's flat params in
``parameters()`` order, and the tied embeddings stored under both names.
Variant ``groups`` trains with two param groups listed out of
``parameters()`` order (the later flat parameters first, as a per-group
learning rate or weight-decay split does), so optimizer ids do not follow
the model's order. Variant ``ckptwrap`` puts torch's ``checkpoint_wrapper``
both inside an FSDP instance (layer 0), around one (layer 1) and around a
BatchNorm in the root: fairscale's metadata then names
``_checkpoint_wrapped_module`` in paths, parameters and buffers, while
``state_dict()`` and ``local_state_dict()`` leave it out. fairscale can
gather optimizer state for none of those (no ``full_optim``).

Optimizer oracle that needs no fairscale optimizer utility: each moment is
loaded *as the weights* (``load_local_state_dict`` of the moment shards at
the source world size, then ``state_dict()``: the full moment), and FSDP at
the target world size shards it like weights (``load_state_dict``, then
``local_state_dict()``). Entry ``i`` is the ``i``-th parameter the
optimizer's param groups list (:func:`entry_keys`).

``build_transformer_fixture(out, variants, world_size)`` writes per variant::

    {variant}/src/checkpoint_last-shard{r}.pt   model, fsdp_metadata, last_optimizer_state, extra_state
    {variant}/ref.pt                            {"full": state_dict(), "full_optim": gather_full_optim_state_dict(),
                                                 "moments": {name: full moment as a state dict}}

``check_at_world_size(jobs, n)`` then records, for ckptshard's outputs made
from those, what real FSDP at world size ``n`` makes of them (see
:func:`_check_worker`); ``optimizer_loaded_in_fsdp2`` what torch's FSDP2
gathers from a DCP of them.
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
            [nn.TransformerEncoderLayer(DIM, HEADS, FFN, dropout=0.0, batch_first=True) for _ in range(3)]
        )
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


def _no_recompute(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A checkpoint function that just runs: recomputing around an FSDP instance breaks fairscale's
    state machine, and the wrapper's names, not its recomputation, are what the variant is for."""
    return fn(*args, **kwargs)


def wrap(variant: str, seed: int) -> Any:
    from fairscale.nn import FullyShardedDataParallel as FSDP
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    from ..fsdp.cpu_compat import cpu_fsdp_kwargs

    torch.manual_seed(seed)
    m, base = TinyLM(), cpu_fsdp_kwargs()
    if variant == "ckptwrap":
        m.layers[0] = checkpoint_wrapper(m.layers[0])  # recomputes in backward, inside FSDP
        m.norm = checkpoint_wrapper(m.norm, checkpoint_fn=_no_recompute)  # buffers in the root
    m.layers[0] = FSDP(m.layers[0], **base)
    m.layers[1] = FSDP(m.layers[1], flatten_parameters=variant != "unflat", **base)
    if variant == "ckptwrap":
        m.layers[1] = checkpoint_wrapper(m.layers[1], checkpoint_fn=_no_recompute)
    m.layers[2].linear1 = FSDP(m.layers[2].linear1, **base)  # nested inside the next instance
    m.layers[2] = FSDP(m.layers[2], **base)
    m.act = FSDP(m.act, **base)  # no parameters
    return FSDP(m, flatten_parameters=variant != "unflat", **base)


MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def param_keys(root: Any) -> List[str]:
    """The local state-dict key of each of ``root.parameters()``, i.e. of each optimizer entry."""
    drop = ("_fsdp_wrapped_module", "_fpw_module", "_checkpoint_wrapped_module")  # state-dict hooks drop them
    return [".".join(p for p in n.split(".") if p not in drop) for n, _ in root.named_parameters()]


def entry_keys(root: Any, optim: torch.optim.Optimizer) -> List[str]:
    """The local state-dict key of each optimizer entry, in id order (group by group, as listed)."""
    keys = param_keys(root)
    index = {id(p): i for i, p in enumerate(root.parameters())}
    return [keys[index[id(p)]] for g in optim.param_groups for p in g["params"]]


def _with(local: Dict[str, torch.Tensor], keys: List[str], values: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``local`` with the tensor under each of ``keys`` (and under any alias: same memory) replaced."""

    def where(t: torch.Tensor) -> Any:
        return (t.data_ptr(), tuple(t.shape)) if t.numel() else id(t)

    new = {where(local[k]): v for k, v in zip(keys, values)}
    return {k: new.get(where(t), t) for k, t in local.items()}


def full_moments(root: Any, optim: torch.optim.Optimizer, variant: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """Each moment as a full state dict: its shards loaded as the weights of a fresh model (collective)."""
    from ..fsdp.state import init_param_attributes

    state, keys, local = optim.state_dict()["state"], entry_keys(root, optim), root.local_state_dict()
    out = {}
    for k in MOMENTS:
        carrier = wrap(variant, 5)
        init_param_attributes(carrier)
        carrier.load_local_state_dict(_with(local, keys, [state[i][k] for i in range(len(keys))]), strict=True)
        out[k] = carrier.state_dict()
    return out


def make_optimizer(root: Any, variant: str) -> torch.optim.Optimizer:
    params = list(root.parameters())
    if variant == "groups":  # ids 0-1: the last two flat params; ids 2-4: the first three
        return torch.optim.AdamW(
            [{"params": params[3:], "lr": 2e-2, "weight_decay": 0.0}, {"params": params[:3]}], lr=1e-2, amsgrad=True
        )
    return torch.optim.AdamW(params, lr=1e-2, amsgrad=True)


def _train_worker(rank: int, world_size: int, out: str, variants: List[str]) -> None:
    for variant in variants:
        root = wrap(variant, 0)
        optim = make_optimizer(root, variant)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(STEPS):
            loss = root(torch.randint(0, VOCAB, (2, 5), generator=g)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
        full = root.state_dict()
        moments = full_moments(root, optim, variant)
        full_optim = root.gather_full_optim_state_dict(optim) if variant == "flat" else None
        folder = os.path.join(out, variant)
        os.makedirs(os.path.join(folder, "src"), exist_ok=True)
        torch.save(
            {
                "model": root.local_state_dict(),
                "fsdp_metadata": root.local_metadata_dict(),
                "last_optimizer_state": optim.state_dict(),
                "extra_state": {"epoch": 1},
            },
            os.path.join(folder, "src", f"checkpoint_last-shard{rank}.pt"),
        )
        if rank == 0:
            torch.save({"full": full, "full_optim": full_optim, "moments": moments}, os.path.join(folder, "ref.pt"))


def build_transformer_fixture(out: str, variants: List[str], world_size: int) -> None:
    run_world(_train_worker, world_size, out, variants)


def _check_worker(rank: int, world_size: int, jobs: List[Dict[str, Any]]) -> None:
    """Per job (variant, ref, src, resharded, full, full_optim, out), what FSDP at ``world_size`` makes of it.

    ``oracle``: ``local_state_dict``/``local_metadata_dict`` after loading the
    full state, ``get_shard_from_optim_state_dict`` of the full optimizer
    state, and ``moments``: per optimizer entry, each moment sharded as
    weights. ``regathered``: ckptshard's resharded shard loaded with
    ``load_local_state_dict`` and ``optimizer.load_state_dict``, then
    ``state_dict()`` and ``gather_full_optim_state_dict()``. ``loaded_*``: what
    ``ckptshard.fsdp.loading.load_checkpoint`` loads from the consolidated
    files (its full-state path; weights, then the optimizer) and from the
    source shards (resharded on the fly).
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
        record: Dict[str, Any] = {
            "local": root.local_state_dict(),
            "meta": root.local_metadata_dict(),
            "optim": oracle_optim,
            "moments": {},
        }
        keys = entry_keys(root, make_optimizer(root, job["variant"]))
        for k, full_k in ref["moments"].items():
            carrier = wrap(job["variant"], 4)
            carrier.load_state_dict(full_k)
            local_k = carrier.local_state_dict()
            record["moments"][k] = {i: local_k[key] for i, key in enumerate(keys)}

        root = wrap(job["variant"], 2)
        optim = make_optimizer(root, job["variant"])
        init_param_attributes(root)
        ours = torch.load(os.path.join(job["resharded"], f"checkpoint_last-shard{rank}.pt"), weights_only=True)
        root.load_local_state_dict(ours["model"], strict=True)
        optim.load_state_dict(ours["last_optimizer_state"])
        record["regathered"] = root.state_dict()
        if ref["full_optim"] is not None:
            record["regathered_optim"] = root.gather_full_optim_state_dict(optim)

        for how, src in (("full", job["full"]), ("local", job["src"])):  # weights only, both loading paths
            root = wrap(job["variant"], 3)
            report = load_checkpoint(root, src)
            record[f"loaded_{how}"] = (report.path, root.state_dict())
        if job.get("full_optim"):
            root = wrap(job["variant"], 3)
            optim = make_optimizer(root, job["variant"])
            report = load_checkpoint(root, job["full"], optim, full_optimizer=job["full_optim"])
            record["loaded_path"] = report.path
            record["loaded_optim"] = optim.state_dict()
        os.makedirs(job["out"], exist_ok=True)
        torch.save(record, os.path.join(job["out"], f"rank{rank}.pt"))


def check_at_world_size(jobs: List[Dict[str, Any]], world_size: int) -> None:
    run_world(_check_worker, world_size, jobs)


def _fsdp2_worker(rank: int, world_size: int, dcp_dir: str, out: str) -> None:
    """TinyLM under torch's FSDP2, optimizer groups as the DCP lists them, loaded from ``dcp_dir``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    from ..read.dcp import open_dcp

    torch.manual_seed(9)  # not the run's seed: loading must overwrite every value
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)  # the root stays unsharded: fully_shard refuses the 0-dim temperature
    by_name = dict(model.named_parameters())
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [by_name[n] for n in g["params"]]}
        for g in open_dcp(dcp_dir).tree["optim"]["param_groups"]
    ]
    optim = torch.optim.AdamW(groups)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out)


def optimizer_loaded_in_fsdp2(dcp_dir: str, out: str, world_size: int) -> None:
    """Load a DCP of this model into FSDP2 on ``world_size`` ranks; rank 0 saves the gathered optimizer state."""
    run_world(_fsdp2_worker, world_size, dcp_dir, out)

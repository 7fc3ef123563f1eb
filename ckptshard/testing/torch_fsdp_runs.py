"""Real torch FSDP per-rank checkpoints, saved as verl saves them, and torch's own view at other world sizes.

``build_fsdp2_run(out, W)`` trains :class:`TiedLM` with ``fully_shard`` on W
gloo ranks and writes verl's layout::

    model_world_size_{W}_rank_{r}.pt        model.state_dict()  (DTensors)
    optim_world_size_{W}_rank_{r}.pt        optimizer.state_dict()  (DTensor moments, step)
    extra_state_world_size_{W}_rank_{r}.pt  {"lr_scheduler": ..., "rng": {"cpu", "numpy", "random"}}
    fsdp_config.json, huggingface/config.json
    ref/full_model.pt, ref/full_optim.pt    get_model/optimizer_state_dict(full_state_dict=True), rank 0

``torch_at(ref, out, N)`` loads the full reference into FSDP2 at N
(``set_model_state_dict``/``set_optimizer_state_dict``) and saves each
rank's state dicts as the run would: torch's own files at N, the oracle
for reshard. ``step_from(folder, out, N)`` loads per-rank files at N the way
verl resumes (``model.load_state_dict``, ``optimizer.load_state_dict``),
takes one more step and saves the full state after it. ``build_fsdp1_run``
trains the same model under FSDP1 and saves its SHARDED_STATE_DICT files.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..fsdp.launch import run_world
from ..fsdp.state import torch_full_state

STEPS = 2
VOCAB, DIM, HIDDEN = 13, 6, 7  # rows that no world size from 2 to 4 divides evenly


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


class TiedLM(nn.Module):
    """Embedding tied to the output layer, two blocks of their own FSDP units, a 2-element parameter (an
    empty piece from 3 ranks up), a one-row parameter (one chunk whatever the world size, like a ViT's
    ``cls_token``) and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.offset = nn.Parameter(torch.zeros(1, DIM))
        self.blocks = nn.ModuleList([Block(), Block()])
        self.gate = nn.Parameter(torch.ones(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.offset
        x = x * self.position_scale[: tokens.shape[1], None].to(x.dtype)  # buffers stay fp32 under bf16 compute
        for b in self.blocks:
            x = b(x) * self.gate[0] + x * self.gate[1]
        return self.head(x)


def wrapped(seed: int = 0, bf16: bool = False, replicas: int = 1, names: Optional[Tuple[str, ...]] = None) -> Any:
    """TiedLM under ``fully_shard``; ``bf16``: bf16 compute over fp32 shards (verl's mixed precision);
    ``replicas`` > 1: HSDP, a 2-D mesh ``("ddp", "fsdp")`` of that many replicas (verl's ``fsdp_size``);
    ``names``: a 1-D mesh with these dimension names (verl's ``("fsdp",)``), not fully_shard's unnamed one."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = TiedLM()
    kw: Dict[str, Any] = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh

        shape = (replicas, dist.get_world_size() // replicas)
        kw["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("ddp", "fsdp"))
    elif names:
        from torch.distributed.device_mesh import init_device_mesh

        kw["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=names)
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def make_optimizer(model: nn.Module) -> Any:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return optim, torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of global batch ``step``: 12 sequences, the same whatever the world size."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (12, 5), generator=g)
    return tokens[rank * 12 // world : (rank + 1) * 12 // world]


def _step(model: Any, optim: Any, sched: Any, step: int, rank: int, world: int) -> float:
    """One training step on global batch ``step``; its mean loss over the global batch."""
    import torch.distributed as dist

    tokens = _batch(step, rank, world)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="sum")
    (loss * world / 48).backward()  # FSDP averages gradients over ranks: the mean over the global batch
    optim.step()
    optim.zero_grad()
    sched.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / 48


def _save_rank_files(folder: str, model: Any, optim: Any, sched: Any, rank: int, world: int) -> None:
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(folder, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(optim.state_dict(), os.path.join(folder, f"optim_world_size_{world}_rank_{rank}.pt"))
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    torch.save(
        {"lr_scheduler": sched.state_dict(), "rng": rng},
        os.path.join(folder, f"extra_state_world_size_{world}_rank_{rank}.pt"),
    )
    if rank == 0:
        with open(os.path.join(folder, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": 2, "world_size": world}, f)
        os.makedirs(os.path.join(folder, "huggingface"), exist_ok=True)
        with open(os.path.join(folder, "huggingface", "config.json"), "w") as f:
            json.dump({"vocab_size": VOCAB, "hidden_size": DIM}, f)


def _train_worker(rank: int, world: int, out: str, bf16: bool = False, replicas: int = 1) -> None:
    import numpy as np

    np.random.seed(rank)
    random.seed(rank)
    model = wrapped(bf16=bf16, replicas=replicas)
    optim, sched = make_optimizer(model)
    for step in range(STEPS):
        _step(model, optim, sched, step, rank, world)
    _save_rank_files(out, model, optim, sched, rank, world)
    full = torch_full_state(model, optim)
    if rank == 0:
        os.makedirs(os.path.join(out, "ref"), exist_ok=True)
        torch.save(full["model"], os.path.join(out, "ref", "full_model.pt"))
        torch.save(full["optim"], os.path.join(out, "ref", "full_optim.pt"))


def build_fsdp2_run(out: str, world: int, bf16: bool = False, replicas: int = 1) -> None:
    run_world(_train_worker, world, out, bf16, replicas)


def _torch_at_worker(rank: int, world: int, ref: str, out: str, replicas: int, names: Any) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    model = wrapped(seed=7, replicas=replicas, names=names)  # other initial values: loading must overwrite them
    optim, _ = make_optimizer(model)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_model_state_dict(model, torch.load(os.path.join(ref, "full_model.pt"), weights_only=True), options=opts)
    set_optimizer_state_dict(
        model, optim, torch.load(os.path.join(ref, "full_optim.pt"), weights_only=True), options=opts
    )
    torch.save(model.state_dict(), os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(optim.state_dict(), os.path.join(out, f"optim_world_size_{world}_rank_{rank}.pt"))


def torch_at(ref: str, out: str, world: int, replicas: int = 1, names: Optional[Tuple[str, ...]] = None) -> None:
    """torch's own per-rank files at ``world`` (mesh as :func:`wrapped` makes it), from the full reference
    state in folder ``ref``."""
    os.makedirs(out, exist_ok=True)
    run_world(_torch_at_worker, world, ref, out, replicas, names)


def _step_worker(rank: int, world: int, folder: str, out: str, replicas: int, names: Any) -> None:
    import torch.distributed.tensor

    model = wrapped(seed=7, replicas=replicas, names=names)
    optim, sched = make_optimizer(model)
    _load_rank_files(model, optim, folder, rank, world)
    _step(model, optim, sched, STEPS, rank, world)
    full = torch_full_state(model, optim)
    if rank == 0:
        torch.save(full, out)


def _load_rank_files(model: Any, optim: Any, folder: str, rank: int, world: int) -> None:
    """As verl resumes: ``model.load_state_dict`` and ``optimizer.load_state_dict`` of this rank's files
    (FSDP1's ShardedTensors need full unpickling)."""
    for kind, target in (("model", model), ("optim", optim)):
        path = os.path.join(folder, f"{kind}_world_size_{world}_rank_{rank}.pt")
        target.load_state_dict(torch.load(path, weights_only=False))


def step_from(folder: str, out: str, world: int, replicas: int = 1, names: Optional[Tuple[str, ...]] = None) -> None:
    """Resume per-rank files at ``world`` (mesh as :func:`wrapped` makes it) as verl does, one more step;
    the full state after it, to ``out``."""
    run_world(_step_worker, world, folder, out, replicas, names)


def _dcp_worker(rank: int, world: int, folder: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = wrapped(seed=7)
    optim, _ = make_optimizer(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    full = torch_full_state(model, optim)
    if rank == 0:
        torch.save(full, out)


def load_dcp(folder: str, out: str, world: int) -> None:
    """A DCP folder loaded into FSDP2 at ``world`` with torch's own calls; the full state it then holds."""
    run_world(_dcp_worker, world, folder, out)


def fsdp1_wrapped(seed: int = 0, bf16: bool = False, orig_params: bool = True) -> Any:
    """TiedLM under FSDP1 (each block and the root a unit, ``use_orig_params=orig_params``); ``bf16``: bf16
    compute over fp32 shards (verl's mixed precision), which aligns each parameter in its flat parameter to 8
    elements, not 4."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    torch.manual_seed(seed)
    model = TiedLM()
    kw: Dict[str, Any] = {"device_id": torch.device("cpu"), "use_orig_params": orig_params}
    if bf16:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i in range(len(model.blocks)):
        model.blocks[i] = FSDP(model.blocks[i], **kw)
    return FSDP(model, **kw)


def _sharded_state(model: Any) -> Any:
    """FSDP1's SHARDED_STATE_DICT context, as verl sets it (offload to CPU)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    sharded = (ShardedStateDictConfig(offload_to_cpu=True), ShardedOptimStateDictConfig(offload_to_cpu=True))
    return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, *sharded)


def _fsdp1_save(model: Any, optim: Any, folder: str, rank: int, world: int) -> None:
    """As verl saves FSDP1: the model under SHARDED_STATE_DICT, the optimizer's raw ``state_dict()``."""
    os.makedirs(folder, exist_ok=True)
    with _sharded_state(model):
        torch.save(model.state_dict(), os.path.join(folder, f"model_world_size_{world}_rank_{rank}.pt"))
        torch.save(optim.state_dict(), os.path.join(folder, f"optim_world_size_{world}_rank_{rank}.pt"))
    if rank == 0:
        with open(os.path.join(folder, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": 1, "world_size": world}, f)


def _fsdp1_full(model: Any, optim: Any) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # offload_to_cpu with every rank gathering crashes torch on CPU (SIGSEGV); the tensors are on the CPU anyway
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        full = model.state_dict()
    return {
        "model": full,
        "optim": get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True)),
    }


def _fsdp1_worker(rank: int, world: int, out: str, bf16: bool = False, orig_params: bool = True) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    model = fsdp1_wrapped(bf16=bf16, orig_params=orig_params)
    optim, sched = make_optimizer(model)
    for step in range(STEPS):
        _step(model, optim, sched, step, rank, world)
    _fsdp1_save(model, optim, out, rank, world)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):  # the flat parameters themselves
        os.makedirs(os.path.join(out, "local"), exist_ok=True)
        torch.save(model.state_dict(), os.path.join(out, "local", f"model_world_size_{world}_rank_{rank}.pt"))
    full = _fsdp1_full(model, optim)
    if rank == 0:
        os.makedirs(os.path.join(out, "ref"), exist_ok=True)
        torch.save(full["model"], os.path.join(out, "ref", "full_model.pt"))
        torch.save(full["optim"], os.path.join(out, "ref", "full_optim.pt"))


def build_fsdp1_run(out: str, world: int, bf16: bool = False, orig_params: bool = True) -> None:
    """FSDP1 per-rank files of the same training, saved as verl saves them; ``ref/full_model.pt`` and
    ``ref/full_optim.pt`` its full state (``get_optimizer_state_dict(full_state_dict=True)``), ``local/`` its
    LOCAL_STATE_DICT files."""
    os.makedirs(out, exist_ok=True)
    run_world(_fsdp1_worker, world, out, bf16, orig_params)


def _fsdp1_at_worker(rank: int, world: int, ref: str, out: str, bf16: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = fsdp1_wrapped(seed=7, bf16=bf16)
    optim, _ = make_optimizer(model)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        model.load_state_dict(torch.load(os.path.join(ref, "full_model.pt"), weights_only=True))
    full_optim = torch.load(os.path.join(ref, "full_optim.pt"), weights_only=True)
    set_optimizer_state_dict(model, optim, full_optim, options=StateDictOptions(full_state_dict=True))
    _fsdp1_save(model, optim, out, rank, world)


def fsdp1_torch_at(ref: str, out: str, world: int, bf16: bool = False) -> None:
    """The full reference loaded into FSDP1 at ``world``, saved as verl saves: torch's own files at N."""
    run_world(_fsdp1_at_worker, world, ref, out, bf16)


def _fsdp1_local_at_worker(rank: int, world: int, ref: str, out: str, bf16: bool, orig_params: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = fsdp1_wrapped(seed=7, bf16=bf16, orig_params=orig_params)
    optim, _ = make_optimizer(model)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        model.load_state_dict(torch.load(os.path.join(ref, "full_model.pt"), weights_only=True))
    full_optim = torch.load(os.path.join(ref, "full_optim.pt"), weights_only=True)
    set_optimizer_state_dict(model, optim, full_optim, options=StateDictOptions(full_state_dict=True))
    os.makedirs(out, exist_ok=True)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        torch.save(model.state_dict(), os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(optim.state_dict(), os.path.join(out, f"optim_world_size_{world}_rank_{rank}.pt"))


def fsdp1_local_at(ref: str, out: str, world: int, bf16: bool = False, orig_params: bool = True) -> None:
    """The full reference (model and optimizer) loaded into FSDP1 at ``world``, its LOCAL_STATE_DICT files and
    raw ``optimizer.state_dict()`` saved: torch's own at N."""
    run_world(_fsdp1_local_at_worker, world, ref, out, bf16, orig_params)


def _fsdp1_compare_worker(rank: int, world: int, a: str, b: str) -> None:
    name = f"model_world_size_{world}_rank_{rank}.pt"
    got, want = (torch.load(os.path.join(d, name), weights_only=False) for d in (a, b))
    assert list(got) == list(want), (name, list(got), list(want))
    for k, w in want.items():
        g = got[k]
        assert type(g) is type(w), (name, k, type(g), type(w))
        if not hasattr(w, "local_shards"):  # a buffer (a ShardedTensor is a torch.Tensor too)
            assert torch.equal(g, w), (name, k)
            continue
        assert g.metadata() == w.metadata(), (name, k, g.metadata(), w.metadata())
        assert g.sharding_spec() == w.sharding_spec(), (name, k, g.sharding_spec(), w.sharding_spec())
        gs, ws = g.local_shards(), w.local_shards()
        assert [s.metadata for s in gs] == [s.metadata for s in ws], (name, k)
        assert all(torch.equal(x.tensor, y.tensor) for x, y in zip(gs, ws)), (name, k)
        assert [x.tensor.requires_grad for x in gs] == [y.tensor.requires_grad for y in ws], (name, k)


def fsdp1_same_models(a: str, b: str, world: int) -> None:
    """Each rank's SHARDED_STATE_DICT file of folders ``a`` and ``b`` loaded under a process group of
    ``world`` (ShardedTensors load nowhere else): same names, metadata, sharding spec and local shards, or
    an error."""
    run_world(_fsdp1_compare_worker, world, a, b)


def _fsdp1_step_worker(rank: int, world: int, folder: str, out: str, bf16: bool) -> None:
    model = fsdp1_wrapped(seed=7, bf16=bf16)
    optim, sched = make_optimizer(model)
    with _sharded_state(model):
        _load_rank_files(model, optim, folder, rank, world)
    _step(model, optim, sched, STEPS, rank, world)
    full = _fsdp1_full(model, optim)
    if rank == 0:
        torch.save(full, out)


def fsdp1_step_from(folder: str, out: str, world: int, bf16: bool = False) -> None:
    """Resume FSDP1 per-rank files at ``world`` as verl does, one more step; the full state after it."""
    run_world(_fsdp1_step_worker, world, folder, out, bf16)


def dtensor_api() -> Any:
    """The module holding DTensor, Shard and distribute_tensor: ``torch.distributed.tensor`` from torch
    2.5, ``torch.distributed._tensor`` before (where 2.0-2.4 keep it). ImportError where neither has it."""
    import importlib

    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "DTensor"):
            return module
    raise ImportError(f"torch {torch.__version__} has no DTensor")


def assert_same_state(got: Any, want: Any, where: str = "") -> None:
    """``got`` equals ``want`` as FSDP saves them: tensors ``torch.equal``; a DTensor's local tensor, shape,
    stride, placements and spec too, and every field of its pickled DeviceMesh (its rank, coordinate, rank
    map, layout...), not only the mesh's ``==``; ``_hash`` and ``_thread_id`` aside (process-local: a hash
    computed again on use, and the creating thread's id, which torch 2.4 records and every process differs in)."""
    DTensor = dtensor_api().DTensor

    if isinstance(want, DTensor):
        assert isinstance(got, DTensor), where
        assert torch.equal(got.to_local(), want.to_local()), where
        assert got.to_local().dtype == want.to_local().dtype and got.requires_grad == want.requires_grad, where
        assert (got.shape, got.stride(), got.placements) == (want.shape, want.stride(), want.placements), where
        assert got._spec.tensor_meta == want._spec.tensor_meta, where
        g, w = vars(got.device_mesh), vars(want.device_mesh)
        assert set(g) == set(w), (where, set(g) ^ set(w))
        for k in w:
            if k not in ("_hash", "_thread_id"):
                same = (
                    torch.equal(g[k], w[k]) and g[k].dtype == w[k].dtype
                    if isinstance(w[k], torch.Tensor)
                    else g[k] == w[k]
                )
                assert same, (where, k, g[k], w[k])
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same_state(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_state(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def _dtensors_worker(rank: int, world: int, out: str, replicas: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    api = dtensor_api()
    Replicate, Shard, distribute_tensor = api.Replicate, api.Shard, api.distribute_tensor
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("ddp", "fsdp"))
        placements = [Replicate(), Shard(0)]
    else:
        mesh, placements = init_device_mesh("cpu", (world,)), [Shard(0)]
    torch.manual_seed(0)
    full = {"w": torch.randn(5, 3), "b": torch.randn(2), "one": torch.randn(1, 4)}
    hash(mesh)  # as a training process has: the pickle then holds a hash
    torch.save(
        {k: distribute_tensor(v, mesh, placements) for k, v in full.items()},
        os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"),
    )


def save_dtensors(out: str, world: int, replicas: int = 1) -> None:
    """Each rank's state dict of DTensors over the 1-D mesh FSDP2 makes (``init_device_mesh``), or HSDP's
    ``(replicas, world // replicas)`` mesh named ``("ddp", "fsdp")``, saved by this torch on ``world`` gloo
    ranks: the same values at any ``world``. For torch releases whose FSDP2 does not run on the CPU (before
    2.7), their DeviceMesh pickles all the same."""
    os.makedirs(out, exist_ok=True)
    run_world(_dtensors_worker, world, out, replicas)

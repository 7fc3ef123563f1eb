"""fairscale FSDP on CPU over gloo equals plain single-process training."""

import sys

import pytest
import torch
import torch.nn as nn

from ckptshard.fsdp.cpu_compat import cpu_fsdp_kwargs, is_installed
from ckptshard.fsdp.launch import run_world

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

STEPS = 5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))


def data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)


def train_fsdp(rank, world_size, out):
    from fairscale.nn import FullyShardedDataParallel as FSDP

    # Every gloo rank computes on the CPU, also on a machine with GPUs.
    assert is_installed() and cpu_fsdp_kwargs()["compute_device"] == torch.device("cpu")
    m = make_model()
    m[2] = FSDP(m[2], **cpu_fsdp_kwargs())
    m = FSDP(m, **cpu_fsdp_kwargs())
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    losses = []
    per = 12 // world_size
    for s in range(STEPS):
        x, y = data(s)
        loss = ((m(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    sd = m.state_dict()
    global_losses = torch.stack(losses)
    torch.distributed.all_reduce(global_losses)
    if rank == 0:
        torch.save({"sd": sd, "losses": global_losses / world_size}, out)


def test_fsdp_world_size_2_equals_single_process(tmp_path):
    out = str(tmp_path / "fsdp.pt")
    run_world(train_fsdp, 2, out)
    got = torch.load(out, weights_only=True)
    m = make_model()
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    losses = []
    for s in range(STEPS):
        x, y = data(s)
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    assert torch.allclose(got["losses"], torch.stack(losses), rtol=1e-6, atol=1e-7)
    for k, v in m.state_dict().items():
        assert torch.allclose(got["sd"][k], v, rtol=1e-5, atol=1e-7), k
    # It trained: the weights moved away from the initial ones.
    assert not torch.allclose(make_model().state_dict()["0.weight"], got["sd"]["0.weight"])


def test_layer_leaves_torch_cuda_alone():
    import torch.cuda

    from ckptshard.fsdp.cpu_compat import install_cpu_compat

    had_cuda = torch.cuda.is_available()
    install_cpu_compat(force=True)  # as a gloo rank does, with or without GPUs
    assert torch.cuda is sys.modules["torch.cuda"] and torch.cuda.is_available() is had_cuda
    import fairscale.nn.data_parallel.fully_sharded_data_parallel as fsdp_mod

    assert fsdp_mod.torch.cuda.is_available() is True
    assert fsdp_mod.torch.float32 is torch.float32

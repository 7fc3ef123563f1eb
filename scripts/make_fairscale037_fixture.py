"""Write tests/data/fairscale037: a real fairscale 0.3.7 run's shards (VISSL's pip wheel bundles 0.3.7).

fairscale 0.3.7 needs torch before 2.0 (it imports torch._six), so this runs
in a throwaway venv, not in the project's:

    python3 -m venv /tmp/fs037 && /tmp/fs037/bin/pip install torch==1.13.1 'numpy<2'
    /tmp/fs037/bin/pip install --no-deps --no-build-isolation fairscale==0.3.7
    PYTHONPATH=. /tmp/fs037/bin/python scripts/make_fairscale037_fixture.py

Two ranks on gloo, CPU (ckptshard's CPU layer), fp32, Adam, 2 steps: a root
FSDP instance (flat), a nested flat one and a nested one with
flatten_parameters=False, a buffer. Each rank saves fairseq's container
(model, fsdp_metadata, last_optimizer_state); rank 0 also the live state_dict().
Then FSDP 0.3.7 at 3 ranks loads that state dict and saves its own shards
(ws3/): the oracle for reshard 2->3.

With the argument ``tied`` it writes tied/ instead: a model whose output layer
is tied to its embedding inside a nested flat instance (VISSL's
``trunk.tied.2.weight``), which 0.3.x metadata does not record; its shards,
the live state_dict() and like.pt, torch.save of the unwrapped model's
state_dict() (the tied names share storage there): what ``--like`` reads.
"""

import os
import sys

import torch
from torch import nn

from ckptshard.fsdp.launch import run_world

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "fairscale037")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 7)
        self.block = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.Linear(5, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tied = nn.Sequential(nn.Embedding(7, 4), nn.Tanh(), nn.Linear(4, 7))
        self.tied[2].weight = self.tied[0].weight
        self.scale = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.tied(x))


def tied_worker(rank: int, world: int, out: str) -> None:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ckptshard.fsdp.cpu_compat import cpu_fsdp_kwargs

    torch.manual_seed(0)
    net = TiedNet()
    if rank == 0:
        torch.save(net.state_dict(), os.path.join(out, "like.pt"))
    kw = cpu_fsdp_kwargs()
    net.tied = FSDP(net.tied, **kw)
    root = FSDP(net, **kw)
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 7, (8,), generator=g)[rank * 4 : (rank + 1) * 4]
        root(x).square().mean().backward()
        optim.step()
        optim.zero_grad()
    full = root.state_dict()
    shard = {"model": root.local_state_dict(), "fsdp_metadata": root.local_metadata_dict()}
    shard["last_optimizer_state"] = optim.state_dict()
    torch.save(shard, os.path.join(out, f"checkpoint_last-shard{rank}.pt"))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(out, "full_state_dict.pt"))


def worker(rank: int, world: int, out: str) -> None:
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ckptshard.fsdp.cpu_compat import cpu_fsdp_kwargs

    torch.manual_seed(0)
    net = Net()
    kw = cpu_fsdp_kwargs()
    net.block = FSDP(net.block, **kw)
    net.head = FSDP(net.head, flatten_parameters=False, **kw)
    root = FSDP(net, **kw)
    optim = torch.optim.Adam(root.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(8, 4, generator=g)[rank * 4 : (rank + 1) * 4]
        y = root(x)
        y.square().mean().backward()
        optim.step()
        optim.zero_grad()
    full = root.state_dict()
    shard = {"model": root.local_state_dict(), "fsdp_metadata": root.local_metadata_dict()}
    shard["last_optimizer_state"] = optim.state_dict()
    torch.save(shard, os.path.join(out, f"checkpoint_last-shard{rank}.pt"))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(out, "full_state_dict.pt"))


def at_three(rank: int, world: int, out: str) -> None:
    """The oracle for reshard 2->3: fairscale 0.3.7 at 3 ranks, loaded with the full state, saves its shards."""
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ckptshard.fsdp.cpu_compat import cpu_fsdp_kwargs

    net = Net()
    kw = cpu_fsdp_kwargs()
    net.block = FSDP(net.block, **kw)
    net.head = FSDP(net.head, flatten_parameters=False, **kw)
    root = FSDP(net, **kw)
    root.load_state_dict(torch.load(os.path.join(out, "full_state_dict.pt")))
    os.makedirs(os.path.join(out, "ws3"), exist_ok=True)
    shard = {"model": root.local_state_dict(), "fsdp_metadata": root.local_metadata_dict()}
    torch.save(shard, os.path.join(out, "ws3", f"checkpoint_last-shard{rank}.pt"))


if __name__ == "__main__":
    import fairscale

    assert fairscale.__version__ == "0.3.7", fairscale.__version__
    if sys.argv[1:] == ["tied"]:
        os.makedirs(os.path.join(OUT, "tied"), exist_ok=True)
        run_world(tied_worker, 2, os.path.join(OUT, "tied"))
        print(f"wrote {os.path.abspath(OUT)}/tied with torch {torch.__version__}", file=sys.stderr)
        sys.exit(0)
    os.makedirs(OUT, exist_ok=True)
    run_world(worker, 2, OUT)
    run_world(at_three, 3, OUT)
    print(f"wrote {os.path.abspath(OUT)} with torch {torch.__version__}", file=sys.stderr)

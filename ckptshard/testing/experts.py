"""A third real fairscale run: an FSDP instance each rank holds whole, with its own weights (an MoE expert).

Each rank wraps ``expert`` in a process group of its own (world size 1);
fairscale then marks it ``no_broadcast_optim_state`` and its shards are
the whole parameter, different on every rank. The root is sharded as usual.
``build_experts_fixture(out, world_size)`` writes::

    src/checkpoint_last-shard{r}.pt   model, fsdp_metadata, last_optimizer_state
    live{r}.pt                        rank r's live state_dict() (its own expert)
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from ..fsdp.launch import run_world


class SharedAndExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(5, 7)
        self.expert = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(self.shared(x))


def _worker(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ..fsdp.cpu_compat import cpu_fsdp_kwargs

    own = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group
    torch.manual_seed(0)
    model = SharedAndExpert()
    torch.manual_seed(100 + rank)  # each rank's expert its own
    model.expert = FSDP(nn.Linear(7, 3), process_group=own, **cpu_fsdp_kwargs())
    root = FSDP(model, **cpu_fsdp_kwargs())
    optim = torch.optim.Adam(root.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        root(torch.randn(4, 5, generator=g)).sum().backward()
        optim.step()
        optim.zero_grad()
    live = root.state_dict()
    os.makedirs(os.path.join(out, "src"), exist_ok=True)
    torch.save(
        {
            "model": root.local_state_dict(),
            "fsdp_metadata": root.local_metadata_dict(),
            "last_optimizer_state": optim.state_dict(),
        },
        os.path.join(out, "src", f"checkpoint_last-shard{rank}.pt"),
    )
    torch.save(live, os.path.join(out, f"live{rank}.pt"))


def build_experts_fixture(out: str, world_size: int) -> None:
    run_world(_worker, world_size, out)

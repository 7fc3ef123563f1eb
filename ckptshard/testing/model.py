"""A tiny VISSL-like model: nested-FSDP trunk plus a SwAV-style head.

It has every feature the formats must survive: nested FSDP instances, BatchNorm
buffers (int64 ``num_batches_tracked``), a tied parameter inside a nested
instance, a 3-element parameter sharded alone (empty chunks past 3 ranks), and
SwAV prototypes wrapped unflattened in full precision.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM = 12
PROTOTYPES = (10, 6)
GLOBAL_BATCH = 12


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.repeat(DIM // 3)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.fc(x)))


class Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_in = nn.Linear(DIM, DIM, bias=False)
        self.stem_bn = nn.BatchNorm1d(DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.gate = Gate()
        self.embed_out = nn.Linear(DIM, DIM)
        self.embed_out.weight = self.embed_in.weight  # tied, like input/output embeddings
        # Listed by local_metadata_dict(), never stored by state_dict().
        self.register_buffer("position_cache", torch.arange(float(DIM)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem_bn(self.embed_in(x)))
        for b in self.blocks:
            h = b(h)
        return self.embed_out(self.gate(h))


class SwAVHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.projection = nn.Sequential(nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
        for j, n in enumerate(PROTOTYPES):
            setattr(self, f"prototypes{j}", nn.Linear(8, n, bias=False))

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        z = F.normalize(self.projection(x), dim=1)
        return [z] + [getattr(self, f"prototypes{j}")(z) for j in range(len(PROTOTYPES))]


class VisslLikeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = Trunk()
        self.heads = nn.ModuleList([SwAVHead()])
        self.input_dtype: Optional[torch.dtype] = None  # float16 for a pure-fp16 trunk

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        if self.input_dtype is not None:
            x = x.to(self.input_dtype)
        return self.heads[0](self.trunk(x))


def batch(step: int, seed: int = 0) -> Tuple[torch.Tensor, ...]:
    """The global batch of ``step``: the same whatever the world size."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    ys = tuple(torch.randint(0, n, (GLOBAL_BATCH,), generator=g) for n in PROTOTYPES)
    return (x,) + ys


def local_batch(step: int, rank: int, world_size: int, seed: int = 0) -> Tuple[torch.Tensor, ...]:
    per = GLOBAL_BATCH // world_size
    return tuple(t[rank * per : (rank + 1) * per] for t in batch(step, seed))


def loss_fn(outputs: List[torch.Tensor], targets: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    return sum(F.cross_entropy(o.float(), y) for o, y in zip(outputs[1:], targets))  # type: ignore[return-value]


def fixture_wrap_kwargs(variant: str) -> Dict[str, Dict[str, Any]]:
    """FSDP settings of trunk, head and prototypes for a fixture variant.

    ``mixed``: fp16 compute over fp32 shards in trunk and head; ``half``: a
    pure-fp16 trunk (fp16 shards); ``fp32``: full precision everywhere;
    ``frozen``: fp32 with the trunk frozen (not in the optimizer); ``groups``:
    fp32 with the optimizer in two param groups, the head's listed first.
    Prototypes are always fp32 and unflattened, as in VISSL's SwAV.
    """
    proto = {
        "flatten_parameters": False,
        "mixed_precision": False,
        "fp32_reduce_scatter": False,
        "force_input_to_fp32": True,
    }
    if variant == "mixed":
        # fp32_reduce_scatter as VISSL's configs set it; without it fairscale at world
        # size 1 leaves fp16 grads on fp32 params, which torch's Adam rejects.
        mp = {"mixed_precision": True, "fp32_reduce_scatter": True}
        return {"trunk": mp, "head": mp, "prototypes": proto, "root": mp}
    if variant == "half":
        return {
            "trunk": {"mixed_precision": False, "compute_dtype": torch.float16},
            "head": {"mixed_precision": False, "force_input_to_fp32": True},
            "prototypes": proto,
            "root": {},
        }
    if variant in ("fp32", "frozen", "groups"):  # frozen: fp32, the trunk's parameters requires_grad=False
        return {"trunk": {}, "head": {}, "prototypes": proto, "root": {}}
    raise ValueError(f"unknown fixture variant {variant!r}")

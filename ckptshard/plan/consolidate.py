"""Plan a full (unsharded) state dict from shards: one Fill per logical tensor."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..layout.model import FlatParam, FsdpInstance, Member
from ..read.source import ShardedCheckpoint
from ..tensors import Fill, Source, TensorRef, whole
from .intervals import pieces


def member_sources(refs: Sequence[TensorRef], inst: FsdpInstance, fp: FlatParam, m: Member) -> Tuple[Source, ...]:
    """Where member ``m``'s elements lie in every rank's flat tensor ``refs`` (weights or optimizer moments)."""
    if inst.no_broadcast_optim_state:
        # Not sharded (own world of 1): rank 0 holds it whole, as fairscale assumes.
        return (Source(refs[0], m.offset, 0, m.numel),)
    return tuple(
        Source(refs[p.src_rank], p.src_start, p.dst_start, p.length)
        for p in pieces(fp.numel, len(refs), m.offset, m.offset + m.numel)
    )


def consolidated_weights(ckpt: ShardedCheckpoint) -> Dict[str, Fill]:
    """Every parameter, tied parameter and buffer, named as the live ``state_dict()`` names it.

    Tied parameters map to the same Fill, per FSDP instance (fairscale's
    offline helper uses only the last instance's ties: fairscale #815).
    Buffers and unrecognised stored tensors come from rank 0, as in
    fairscale's ``consolidate_shard_weights``.
    """
    out: Dict[str, Fill] = {}
    for pi, part in enumerate(ckpt.layout.parts):
        sds = [ckpt.local_state(r, pi) for r in range(ckpt.world_size)]
        for inst in part.instances:
            for fp in inst.flat_params:
                key = inst.local_key(fp)
                refs = [sd[key] for sd in sds]
                for m in fp.members:
                    out[part.prefix + inst.logical_name(m.name)] = Fill(
                        m.shape, fp.dtype, member_sources(refs, inst, fp, m)
                    )
            for src, dst in inst.shared:
                out[part.prefix + inst.logical_name(dst)] = out[part.prefix + inst.logical_name(src)]
        for alias, target in part.aliases:  # unflattened: the target's local key is its logical name
            out[part.prefix + alias] = out[part.prefix + target]
        for name in part.stored_buffers:
            out[part.prefix + name] = whole(sds[0][name])
        for key in ckpt.extra_keys(pi):
            out[part.prefix + key] = whole(sds[0][key])
    return out


def split_by_part(ckpt: ShardedCheckpoint, tensors: Dict[str, Fill]) -> List[Dict[str, Fill]]:
    """The same tensors, one dict per part, names relative to the part (containers with several FSDP roots)."""
    out: List[Dict[str, Fill]] = []
    for part in ckpt.layout.parts:
        out.append({k[len(part.prefix) :]: v for k, v in tensors.items() if k.startswith(part.prefix)})
    return out

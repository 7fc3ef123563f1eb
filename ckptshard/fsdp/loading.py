"""Load a checkpoint into a model whose head, trunk or whole is FSDP-wrapped, or not.

One call, the same final weights in every case, strict by default. A
sharded source whose FSDP structure matches the model's is resharded on the
fly to the running world size and loaded with ``load_local_state_dict``;
anything else goes through the full state dict, loaded module by module
(FSDP submodules with their own ``load_state_dict``, plain tensors copied).
Afterwards no FSDP module has ``_is_root`` set or lazy state initialised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import CheckpointError
from ..layout.model import ShardedLayout, join, part_from_metadata, state_dict_name
from ..plan.consolidate import consolidated_weights
from ..plan.optimizer import consolidated_optimizer, resharded_optimizer
from ..plan.reshard import resharded_state
from ..plan.shard import sharded_optimizer_from_full
from ..read.safe_load import load_lazy
from ..read.source import ShardedCheckpoint
from ..read.tensor_data import materialize, read_tensor
from ..sources.fairscale import FairscaleSource
from ..sources.full_state import FullStateSource
from ..sources.probe import open_source
from .state import init_param_attributes
from .wrapping import reset_lazy_init_recursive


@dataclass
class LoadReport:
    path: str  # "local" (resharded shards, load_local_state_dict) or "full"
    loaded: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)  # outside ``only``
    optimizer_loaded: bool = False
    source_world_size: Optional[int] = None


def _is_fsdp(m: nn.Module) -> bool:
    try:
        from fairscale.nn import FullyShardedDataParallel as FSDP
    except ImportError:  # an optional extra: without it no module is fairscale's
        return False
    return isinstance(m, FSDP)


def top_level_fsdp(model: nn.Module) -> List[Tuple[str, Any]]:
    """FSDP modules not inside another FSDP module, with their module names (``""``: the model itself).

    A module name may hold a wrapper that state dicts leave out (``state_dict_name`` gives the key prefix).
    """
    out: List[Tuple[str, Any]] = []
    for name, m in model.named_modules():
        if _is_fsdp(m) and not any(p == "" or name.startswith(p + ".") for p, _ in out):
            out.append((name, m))
    return out


def _non_persistent(m: nn.Module) -> set:
    return {
        state_dict_name(join(name, b))
        for name, mod in m.named_modules()
        for b in getattr(mod, "_non_persistent_buffers_set", ())
    }


def _fsdp_logical_keys(m: Any) -> List[str]:
    """The names ``m.state_dict()`` would have, from its metadata (no collectives)."""
    md = m.local_metadata_dict()
    keys, flat = [], set()
    for inst in md["param_metadata"]:
        for key, info in inst["params"].items():
            keys += [state_dict_name(join(inst["fsdp_path"], n)) for n in info["names"]]
            flat.add(state_dict_name(join(inst["fsdp_path"], key)))
        keys += [state_dict_name(join(inst["fsdp_path"], dst)) for _, dst in inst["shared_param_info"]]
    # A tie inside an unflattened instance: one Parameter under two names, in no metadata.
    known = set(keys) | flat
    keys += [n for n in (state_dict_name(n) for n, _ in m.named_parameters(remove_duplicate=False)) if n not in known]
    skip = _non_persistent(m)
    return keys + [b for b in map(state_dict_name, md["buffer_names"]) if b not in skip]


def _plain_tensors(model: nn.Module, inside: Sequence[str]) -> Dict[str, torch.Tensor]:
    """Parameters and persistent buffers that no FSDP module owns, by name (ties under every name)."""
    out: Dict[str, torch.Tensor] = {}
    for mname, m in model.named_modules():
        if any(mname == p or mname.startswith(p + ".") for p in inside) or "" in inside:
            continue
        for n, p in m._parameters.items():
            if p is not None:
                out[state_dict_name(join(mname, n))] = p
        for n, b in m._buffers.items():
            if b is not None and n not in getattr(m, "_non_persistent_buffers_set", set()):
                out[state_dict_name(join(mname, n))] = b
    return out


def expected_keys(model: nn.Module) -> List[str]:
    """The logical state-dict names of ``model``, whatever is wrapped."""
    tops = top_level_fsdp(model)
    keys = [join(state_dict_name(p), k) for p, m in tops for k in _fsdp_logical_keys(m)]
    return keys + list(_plain_tensors(model, [p for p, _ in tops]))


def _selected(name: str, only: Sequence[str]) -> bool:
    return not only or any(name == o or name.startswith(o.rstrip(".") + ".") for o in only)


def load_full_state(model: nn.Module, full: Mapping[str, torch.Tensor], only: Sequence[str] = ()) -> LoadReport:
    """Load a full state dict into ``model``; strict on the selected names."""
    tops = top_level_fsdp(model)
    expected = expected_keys(model)
    want = {k for k in expected if _selected(k, only)}
    given = {k for k in full if _selected(k, only)}
    missing, unexpected = sorted(want - given), sorted(given - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}")
        raise CheckpointError(
            "checkpoint does not fit the model: "
            + "; ".join(parts)
            + (" (pass only=[...] to load part of it)" if not only else "")
        )
    report = LoadReport(path="full", loaded=sorted(want), skipped=sorted(set(full) - want))
    for name, m in tops:
        prefix = state_dict_name(name)
        sub = {
            k[len(prefix) + 1 :] if prefix else k: v
            for k, v in full.items()
            if k == prefix or k.startswith(prefix + ".") or not prefix
        }
        if not any(_selected(join(prefix, k), only) for k in sub):
            continue
        own = _fsdp_logical_keys(m)
        chosen = {k: v for k, v in sub.items() if _selected(join(prefix, k), only)}
        if len(chosen) == len(own):
            m.load_state_dict(chosen, strict=True)
        else:  # part of this FSDP module: the rest keeps its values
            res = m.load_state_dict(chosen, strict=False)
            left = {state_dict_name(k) for k in res.missing_keys}
            if set(res.unexpected_keys) or left - {k for k in own if k not in chosen}:
                raise CheckpointError(f"{prefix or 'model'}: partial load went wrong: {sorted(left)[:8]}")
    with torch.no_grad():
        for name, t in _plain_tensors(model, [p for p, _ in tops]).items():
            if name in want:
                src = full[name]
                if tuple(src.shape) != tuple(t.shape):
                    raise CheckpointError(f"{name}: checkpoint has shape {list(src.shape)}, the model {list(t.shape)}")
                t.copy_(src)
    return report


def live_layout(model: Any) -> ShardedLayout:
    """An FSDP root's wrapping as a layout, from this rank's own metadata (no collectives)."""
    dtypes = {k: v.dtype for k, v in model.local_state_dict().items()}
    part = part_from_metadata("model", "", model.local_metadata_dict(), dtypes)
    return ShardedLayout(world_size=model.world_size, parts=(part,))


def _structure(md: Mapping[str, Any]) -> Any:
    return (
        [
            (i["fsdp_path"], [(k, list(v["names"]), [list(s) for s in v["shapes"]]) for k, v in i["params"].items()])
            for i in md["param_metadata"]
        ],
        list(md["buffer_names"]),
    )


def _matches_locally(model: nn.Module, ckpt: ShardedCheckpoint) -> bool:
    if not _is_fsdp(model) or len(ckpt.layout.parts) != 1 or not dist.is_initialized():
        return False
    md0 = ckpt.objs[0]
    from ..tree import get_path

    return _structure(get_path(md0, ckpt.container.parts[0].metadata)) == _structure(model.local_metadata_dict())


def load_checkpoint(
    model: nn.Module,
    src: str,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    only: Sequence[str] = (),
    weights: bool = True,
    full_optimizer: Optional[str] = None,
    trust_pickles: bool = False,
) -> LoadReport:
    """Load ``src`` into ``model``, whose heads may be wrapped in FSDP or not yet; no key is skipped silently.

    Args:
        model: a plain module, or an FSDP root (fairscale) at any world size.
        src: a sharded checkpoint of any world size, or a full state dict (.pt, .safetensors, index folder).
        optimizer: also load its state (the model must be an FSDP root).
        only: name prefixes to load (e.g. ``["trunk"]``); everything else in the checkpoint is skipped and
            reported.
        weights: load the weights (False: the optimizer state only).
        full_optimizer: a full optimizer state file, for full state dict sources.
        trust_pickles: unpickle without the weights-only safety net (files you trust only).

    Returns:
        ``LoadReport``: the keys loaded, the keys skipped (by ``only``) and where each came from.

    Raises:
        CheckpointError: a key the model has and the checkpoint lacks, or the other way round (outside
            ``only``), a shape that differs, or a bad checkpoint.
    """
    source = open_source(src, trust_pickles=trust_pickles, full=True, torch_free=False)
    if not isinstance(source, (FairscaleSource, FullStateSource)):
        raise source.refuse("load_checkpoint", "it loads fairscale checkpoints and full state dicts")
    ckpt = source.ckpt if isinstance(source, FairscaleSource) else None
    report: LoadReport
    if ckpt is not None and not only and _matches_locally(model, ckpt):
        rank, ws = dist.get_rank(), dist.get_world_size()
        report = LoadReport(path="local", source_world_size=ckpt.world_size)
        if weights:
            init_param_attributes(model)
            local = materialize(resharded_state(ckpt, 0, ws, rank))
            model.load_local_state_dict(local, strict=True)
            report.loaded = expected_keys(model)
        if optimizer is not None:
            osd = resharded_optimizer(ckpt, ws, rank)
            if osd is None:
                raise CheckpointError(f"{src}: no optimizer state to load")
            optimizer.load_state_dict(materialize(osd))
            report.optimizer_loaded = True
    else:
        if ckpt is not None:
            full = materialize(consolidated_weights(ckpt))
        else:
            full = {k: read_tensor(v) for k, v in source.refs.items()}
        report = load_full_state(model, full, only) if weights else LoadReport(path="full")
        report.source_world_size = ckpt.world_size if ckpt is not None else None
        if optimizer is not None:
            if not _is_fsdp(model):
                raise CheckpointError("optimizer state loads only into an FSDP-wrapped model (the flat parameters)")
            if ckpt is not None:
                full_optim = consolidated_optimizer(ckpt)
            elif full_optimizer is not None:
                full_optim = load_lazy(full_optimizer, trust_pickles)
            else:
                raise CheckpointError(f"{src}: a full state dict holds no optimizer state: pass full_optimizer=")
            init_param_attributes(model)
            # Our own sharding, not get_shard_from_optim_state_dict: fairscale's loses the state of
            # any flat parameter that holds a 0-dim parameter (see plan.shard.elementwise_state).
            shard = sharded_optimizer_from_full(live_layout(model), full_optim, model.world_size, model.rank)
            optimizer.load_state_dict(materialize(shard))
            report.optimizer_loaded = True
    reset_lazy_init_recursive(model)
    return report

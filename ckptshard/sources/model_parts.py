"""metaseq's model-parallel parts (K parts x M FSDP shards) as one source: join what tensor parallelism split
(by rules), check what it replicated (by reading it), cut it again for another number of parts, and describe
the parts for inspect."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..plan.consolidate import consolidated_weights
from ..plan.model_parallel import MpRule, joined, rescaled_layout, rule_for, split, tie_groups
from ..plan.optimizer import consolidated_optimizer, optimizer_param_names
from ..read.model_parts import PartFiles
from ..read.source import ShardedCheckpoint
from ..read.tensor_data import fill_digest, read_fill
from ..tensors import Fill
from .base import Source
from .fairscale import source_info

DEFAULT_TOLERANCE = 1e-5  # relative, as torch.allclose's rtol: real GPU runs drift a little between parts


class ModelPartsSource(Source):
    """``files``: every part's shard files; ``ckpts``: each part opened as a fairscale checkpoint, checked to
    share the FSDP world size and the step (``read.model_parts``)."""

    kind = "model-parts"
    family = "metaseq model-parallel parts"

    def __init__(self, path: str, files: PartFiles, ckpts: List[ShardedCheckpoint]) -> None:
        super().__init__(path, ckpts[0].world_size, tuple(files.paths))
        self.files, self.ckpts = files, ckpts

    def describe(self) -> Dict[str, Any]:
        return {**source_info(self.ckpts[0]), "files": list(self.files.paths), "model_parallel_parts": len(self.ckpts)}

    def full_weights(self) -> Dict[str, Any]:
        raise self.refuse("one full state dict without rules", "give --mp-rules metaseq or --mp-rule REGEX=DIM")


def part_output(out: str, part: int) -> str:
    """``full.pt`` -> ``full-model_part-0.pt``; a folder ``full`` -> ``full-model_part-0``."""
    stem, ext = out.rstrip("/"), ""
    for suffix in (".safetensors", ".pt", ".pth", ".torch", ".bin", ".ckpt"):
        if stem.endswith(suffix):
            stem, ext = stem[: -len(suffix)], suffix
    return f"{stem}-model_part-{part}{ext}"


def _replicated(name: str, fills: Sequence[Fill], tolerance: float, notes: List[str]) -> Fill:
    """A tensor no rule splits: the same in every part (bit for bit, or within ``tolerance`` with a note)."""
    first = fills[0]
    for k, f in enumerate(fills[1:], 1):
        if f.shape != first.shape or f.dtype != first.dtype:
            raise CheckpointError(
                f"{name}: part {k} is {f.dtype}{list(f.shape)}, part 0 {first.dtype}{list(first.shape)}: split by "
                "tensor parallelism, and no --mp-rule matches it; nothing written"
            )
    stored = [fill_digest(f) for f in fills]
    if stored[0] is not None and all(d == stored[0] for d in stored[1:]):
        return first  # bit-identical (the same SHA-256), seen without importing torch
    values = [read_fill(f) for f in fills]
    worst, where = 0.0, 0
    for k, v in enumerate(values[1:], 1):
        if not v.equal(values[0]):
            d = (v.double() - values[0].double()).abs().max().item() if v.numel() else 0.0
            if d > worst or not worst:
                worst, where = d, k
    if where == 0:
        return first
    scale = values[0].double().abs().max().item() if values[0].numel() else 0.0
    rel = worst / scale if scale else float("inf")
    if rel > tolerance:
        raise CheckpointError(
            f"{name}: differs between model parts 0 and {where} by {worst:.3g} ({rel:.3g} relative, over "
            f"--mp-tolerance {tolerance:g}): if tensor parallelism splits it, add an --mp-rule for it; nothing written"
        )
    notes.append(f"{name}: differs between model parts by up to {worst:.3g} ({rel:.3g} relative); taken from part 0")
    return first


def joined_weights(
    ckpts: Sequence[ShardedCheckpoint], rules: Sequence[MpRule], tolerance: float = DEFAULT_TOLERANCE
) -> Tuple[Dict[str, Fill], List[str]]:
    """The model at model-parallel size 1 (names as the live ``state_dict()``), and notes for the user."""
    per_part = [consolidated_weights(c) for c in ckpts]
    return _joined(per_part, rules, tolerance)


def _joined(
    per_part: Sequence[Dict[str, Fill]], rules: Sequence[MpRule], tolerance: float
) -> Tuple[Dict[str, Fill], List[str]]:
    names = list(per_part[0])
    for k, p in enumerate(per_part[1:], 1):
        if set(p) != set(names):
            odd = sorted(set(p) ^ set(names))[0]
            raise CheckpointError(f"model part {k} and part 0 hold different tensors (e.g. {odd}): not one model")
    ties = tie_groups(per_part[0])
    out: Dict[str, Fill] = {}
    done: Dict[int, Fill] = {}
    notes: List[str] = []
    for name in names:
        key = id(per_part[0][name])
        if key not in done:
            fills = [p[name] for p in per_part]
            rule = rule_for(ties[name], rules)
            done[key] = joined(name, fills, rule) if rule else _replicated(name, fills, tolerance, notes)
        out[name] = done[key]
    return out, notes


def joined_optimizer(
    ckpts: Sequence[ShardedCheckpoint], rules: Sequence[MpRule], tolerance: float = DEFAULT_TOLERANCE
) -> Tuple[Dict[str, Any], List[str]]:
    """The full optimizer state of the model at model-parallel size 1, in the format of one part's
    (``gather_full_optim_state_dict``'s): each moment joined by its parameter's rule, or checked replicated."""
    optims = [consolidated_optimizer(c) for c in ckpts]
    if any(o is None for o in optims):
        raise CheckpointError("--optimizer given, but a model part holds no optimizer state")
    names = optimizer_param_names(ckpts[0])
    ties = tie_groups(consolidated_weights(ckpts[0]))
    first = optims[0]
    for k, o in enumerate(optims[1:], 1):
        if _plain(o["param_groups"]) != _plain(first["param_groups"]) or sorted(o["state"]) != sorted(first["state"]):
            raise CheckpointError(f"model part {k}'s optimizer has other param groups or entries than part 0's")
    state: Dict[int, Dict[str, Any]] = {}
    notes: List[str] = []
    for gid, entry in first["state"].items():
        name = names[gid]
        rule = rule_for(ties.get(name, [name]), rules)
        out: Dict[str, Any] = {}
        for key, value in entry.items():
            where = f"optimizer state of {name}: {key}"
            values = [o["state"][gid][key] for o in optims]
            if isinstance(value, Fill):
                out[key] = joined(where, values, rule) if rule else _replicated(where, values, tolerance, notes)
            else:
                if key == "step" and any(v != value for v in values):
                    raise CheckpointError(f"{where}: {values[0]} in part 0, {values} in all: not one checkpoint")
                out[key] = value  # per-rank 0-dim values, as fairscale gathers them: part 0's
        state[gid] = out
    return {**first, "state": state}, notes


def _plain(tree: Any) -> Any:
    """Param groups without their ``params`` lists, which number the same parameters in every part."""
    return [{k: v for k, v in g.items() if k != "params"} for g in tree]


def summarize_parts(files: PartFiles, ckpts: Sequence[ShardedCheckpoint], first: Dict[str, Any]) -> Dict[str, Any]:
    """Part 0's summary, with both sizes: K model-parallel parts x M FSDP shards."""
    return {
        **first,
        "model_parallel_parts": len(ckpts),
        "files": list(files.paths),
        "part_files": [f"{p.head}*{p.tail}" for p in files.parts],
    }


@dataclass
class Repartition:
    """K parts planned as K2: the FSDP template of a new part, each new part's full tensors and optimizer."""

    template: ShardedCheckpoint
    fulls: List[Dict[str, Fill]]
    optims: Optional[List[Dict[str, Any]]]
    notes: List[str]


def _split_all(
    values: Dict[Any, Fill],
    name_of: Dict[Any, str],
    ties: Dict[str, List[str]],
    rules: Sequence[MpRule],
    j: int,
    k2: int,
) -> Dict[Any, Fill]:
    done: Dict[int, Fill] = {}
    out = {}
    for key, f in values.items():
        if id(f) not in done:
            name = name_of[key]
            rule = rule_for(ties.get(name, [name]), rules)
            done[id(f)] = split(name, f, rule, j, k2) if rule else f
        out[key] = done[id(f)]
    return out


def repartitioned(
    ckpts: Sequence[ShardedCheckpoint], rules: Sequence[MpRule], tolerance: float, new_parts: int, optimizer: bool
) -> Repartition:
    """The parts as ``new_parts`` model-parallel parts, planned: the joined model cut again by the same rules.
    No tensor is read but those no rule splits (checked replicated)."""
    weights, notes = joined_weights(ckpts, rules, tolerance)
    ties = tie_groups(weights)
    layout = rescaled_layout(ckpts[0].layout, rules, ties, len(ckpts), new_parts)
    template = dataclasses.replace(ckpts[0], layout=layout, memo={})
    template.objs = [_with_model_parallel_size(ckpts[0].objs[0], len(ckpts), new_parts, notes)]
    names = {n: n for n in weights}
    fulls = [_split_all(weights, names, ties, rules, j, new_parts) for j in range(new_parts)]
    optims = None
    if optimizer and ckpts[0].container.optimizer is not None:
        optim, optim_notes = joined_optimizer(ckpts, rules, tolerance)
        notes += optim_notes
        param_names = optimizer_param_names(ckpts[0])
        optims = []
        for j in range(new_parts):
            state = {}
            for gid, entry in optim["state"].items():
                moments = {k: v for k, v in entry.items() if isinstance(v, Fill)}
                cut = _split_all(moments, dict.fromkeys(moments, param_names[gid]), ties, rules, j, new_parts)
                state[gid] = {**entry, **cut}
            optims.append({**optim, "state": state})
    return Repartition(template, fulls, optims, notes)


def _with_model_parallel_size(tree: Any, parts: int, new_parts: int, notes: List[str]) -> Any:
    """The container with every ``model_parallel_size`` that says ``parts`` saying ``new_parts`` (metaseq's cfg)."""
    found: List[str] = []

    def walk(x: Any, where: str) -> Any:
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if k == "model_parallel_size" and v == parts:
                    found.append(f"{where}{k}")
                    out[k] = new_parts
                else:
                    out[k] = walk(v, f"{where}{k}.")
            return out
        if isinstance(x, list):
            return [walk(v, where) for v in x]
        return x

    out = walk(tree, "")
    if found:
        notes.append(f"{', '.join(found)}: {parts} -> {new_parts}")
    else:
        notes.append(f"no model_parallel_size in the container said {parts}: set the new size in your config yourself")
    return out

"""Several model-parallel parts as one model: join what tensor parallelism split (by rules), check what it
replicated (by reading it), and describe the parts for inspect."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ..errors import CheckpointError
from ..plan.consolidate import consolidated_weights
from ..plan.model_parallel import MpRule, joined, rule_for, tie_groups
from ..plan.optimizer import consolidated_optimizer, optimizer_param_names
from ..read.model_parts import PartFiles
from ..read.source import ShardedCheckpoint
from ..read.tensor_data import read_fill
from ..tensors import Fill

DEFAULT_TOLERANCE = 1e-5  # relative, as torch.allclose's rtol: real GPU runs drift a little between parts


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

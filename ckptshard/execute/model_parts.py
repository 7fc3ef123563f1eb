"""Several model-parallel parts as one model: join what tensor parallelism split (by rules), check what it
replicated (by reading it), and describe the parts for inspect."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ..errors import CheckpointError
from ..plan.consolidate import consolidated_weights
from ..plan.model_parallel import MpRule, joined, rule_for, tie_groups
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


def summarize_parts(files: PartFiles, ckpts: Sequence[ShardedCheckpoint], first: Dict[str, Any]) -> Dict[str, Any]:
    """Part 0's summary, with both sizes: K model-parallel parts x M FSDP shards."""
    return {
        **first,
        "model_parallel_parts": len(ckpts),
        "files": list(files.paths),
        "part_files": [f"{p.head}*{p.tail}" for p in files.parts],
    }

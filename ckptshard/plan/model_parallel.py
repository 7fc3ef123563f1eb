"""Join model-parallel parts into the model at model-parallel size 1, by rules. Pure: no I/O.

Which tensors tensor parallelism split, and along which dimension, is not
in a checkpoint; rules say it. ``REGEX=DIM`` joins the parts' tensors whose
name matches along ``DIM`` (0: column-parallel layers and vocab-parallel
embeddings; 1: row-parallel weights). ``REGEX=DIM/G`` is a grouped join: each
part holds ``G`` equal blocks along ``DIM`` (a fused qkv: ``[k_i; v_i; q_i]``)
and the whole holds block ``g`` of every part, in part order, before block
``g + 1``: ``[k_0..k_K; v_0..v_K; q_0..q_K]``. The first rule that matches a
name wins; a tensor tied to a ruled one is split like it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..layout.dim_shards import row_runs
from ..layout.model import Member, ShardedLayout
from ..tensors import Fill, Source, numel, sources_in


@dataclass(frozen=True)
class MpRule:
    pattern: str
    dim: int
    groups: int = 1

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None

    def __str__(self) -> str:
        return f"{self.pattern}={self.dim}" + (f"/{self.groups}" if self.groups > 1 else "")


# metaseq's own split (its stitch_fsdp_ckpt.reshard_megatron_parts): everything else is replicated.
PRESETS: Dict[str, Tuple[str, ...]] = {
    "metaseq": (
        r"qkv_proj\.(weight|bias)$=0/3",
        r"ffn_layernorm\.=0",
        r"(fc1|k_proj|q_proj|v_proj)\.(weight|bias)$=0",
        r"(fc2|out_proj)\.weight$=1",
        r"embed_tokens\.weight$=0",
        r"output_projection\.weight$=0",
    ),
}


def parse_rule(text: str) -> MpRule:
    """``REGEX=DIM`` or ``REGEX=DIM/GROUPS``."""
    pattern, sep, spec = text.rpartition("=")
    m = re.fullmatch(r"(\d+)(?:/(\d+))?", spec)
    if not sep or not pattern or not m:
        raise CheckpointError(f"--mp-rule {text!r}: expected REGEX=DIM or REGEX=DIM/GROUPS, e.g. 'fc1\\.weight$=0'")
    try:
        parsed = _regex_parser().parse(pattern)
    except re.error as e:
        raise CheckpointError(f"--mp-rule {text!r}: bad regular expression: {e}") from None
    if _nested_repeat(parsed):
        raise CheckpointError(
            f"--mp-rule {text!r}: a repeat inside a repeat (like '(a*)*') can take exponential time on long "
            "names; write the pattern without nesting them"
        )
    groups = int(m[2] or 1)
    if groups < 1:
        raise CheckpointError(f"--mp-rule {text!r}: groups must be >= 1")
    return MpRule(pattern, int(m[1]), groups)


def check_tolerance(tolerance: float) -> None:
    """``--mp-tolerance``: a finite relative difference, 0 or more (NaN would compare as within it)."""
    if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0:
        raise CheckpointError(f"--mp-tolerance must be a finite number >= 0, got {tolerance!r}")


def _regex_parser() -> Any:
    try:
        import re._parser as parser  # Python 3.11+
    except ImportError:
        import sre_parse as parser  # type: ignore[no-redef]
    return parser


def _nested_repeat(parsed: Any, inside: bool = False) -> bool:
    """Whether a repeat of more than one occurrence holds another: Python's ``re`` backtracks
    exponentially on such patterns, and offers no time limit."""
    for op, arg in parsed:
        name = str(op)
        if name.endswith("_REPEAT"):
            many = arg[1] > 1  # the most occurrences; MAXREPEAT (unbounded) included
            if (many and inside) or _nested_repeat(arg[2], inside or many):
                return True
        elif (name in ("SUBPATTERN", "ASSERT", "ASSERT_NOT") and _nested_repeat(arg[-1], inside)) or (
            name == "BRANCH" and any(_nested_repeat(b, inside) for b in arg[1])
        ):
            return True
    return False


def rules_from(rules: Sequence[str], presets: Sequence[str]) -> List[MpRule]:
    out = [parse_rule(r) for r in rules]
    for name in presets:
        if name not in PRESETS:
            raise CheckpointError(f"--mp-rules {name!r}: one of {', '.join(PRESETS)}")
        out += [parse_rule(r) for r in PRESETS[name]]
    return out


def rule_for(names: Sequence[str], rules: Sequence[MpRule]) -> Optional[MpRule]:
    """The first rule matching any of ``names`` (a tensor and the names tied to it)."""
    for rule in rules:
        if any(rule.matches(n) for n in names):
            return rule
    return None


def joined(name: str, fills: Sequence[Fill], rule: MpRule) -> Fill:
    """One tensor from every part's piece, joined as ``rule`` says."""
    first = fills[0]
    d, g = rule.dim, rule.groups
    if d >= len(first.shape):
        raise CheckpointError(f"{name}: rule {rule} joins dimension {d} of a {len(first.shape)}-d tensor")
    for k, f in enumerate(fills):
        if len(f.shape) != len(first.shape) or any(
            a != b for i, (a, b) in enumerate(zip(f.shape, first.shape)) if i != d
        ):
            raise CheckpointError(
                f"{name}: part {k} is {list(f.shape)}, part 0 {list(first.shape)}: cannot join on {d}"
            )
        if f.dtype != first.dtype:
            raise CheckpointError(f"{name}: part {k} is {f.dtype}, part 0 {first.dtype}")
        if f.shape[d] % g:
            raise CheckpointError(f"{name}: rule {rule}: part {k}'s {f.shape[d]} rows do not split into {g} groups")
    block = [f.shape[d] // g for f in fills]  # rows of one group in each part
    shape = tuple(sum(f.shape[d] for f in fills) if i == d else s for i, s in enumerate(first.shape))
    sources: List[Source] = []
    start = 0
    for grp in range(g):
        for k, f in enumerate(fills):
            # Rows [grp * block_k, (grp + 1) * block_k) of part k land at rows [start, start + block_k).
            for dst, src, length in _block_runs(shape, f.shape, d, start, grp * block[k], block[k]):
                sources.extend(sources_in(f, src, src + length, dst))
            start += block[k]
    return Fill(shape, first.dtype, tuple(sources))


def _block_runs(
    whole: Tuple[int, ...], piece: Tuple[int, ...], dim: int, at: int, first_row: int, rows: int
) -> List[Tuple[int, int, int]]:
    """(offset in the whole, offset in the piece, length) runs of piece rows [first_row, first_row + rows)
    landing at whole rows [at, at + rows) along ``dim``."""
    inner = 1
    for s in whole[dim + 1 :]:
        inner *= s
    out = []
    for dst, local, length in row_runs(whole, dim, at, rows):
        outer = local // (rows * inner) if rows * inner else 0
        out.append((dst, outer * piece[dim] * inner + first_row * inner, length))
    return out


def tie_groups(fills: Dict[str, Fill]) -> Dict[str, List[str]]:
    """Name -> every name sharing its Fill (tied parameters), itself first."""
    by_id: Dict[int, List[str]] = {}
    for name, f in fills.items():
        by_id.setdefault(id(f), []).append(name)
    return {n: [n] + [m for m in names if m != n] for names in by_id.values() for n in names}


def split(name: str, whole: Fill, rule: MpRule, part: int, parts: int) -> Fill:
    """Part ``part`` of ``parts`` of a joined tensor, as tensor parallelism at ``parts`` holds it: the inverse of
    :func:`joined` (each of the rule's groups cut into ``parts`` equal row ranges)."""
    d, g = rule.dim, rule.groups
    rows = whole.shape[d]
    if rows % (g * parts):
        raise CheckpointError(f"{name}: {rows} rows along {d} do not split into {parts} parts of {g} group(s)")
    group, block = rows // g, rows // (g * parts)
    shape = tuple(rows // parts if i == d else s for i, s in enumerate(whole.shape))
    inner = 1
    for s in whole.shape[d + 1 :]:
        inner *= s
    sources: List[Source] = []
    for grp in range(g):
        for src, local, length in row_runs(whole.shape, d, grp * group + part * block, block):
            outer = local // (block * inner) if block * inner else 0
            sources.extend(sources_in(whole, src, src + length, outer * shape[d] * inner + grp * block * inner))
    return Fill(shape, whole.dtype, tuple(sources))


def scaled_shape(shape: Tuple[int, ...], rule: MpRule, factor_num: int, factor_den: int) -> Tuple[int, ...]:
    """A split tensor's shape with its split dimension scaled by ``factor_num / factor_den`` (K/K2)."""
    d = rule.dim
    if (shape[d] * factor_num) % factor_den:
        raise CheckpointError(f"dimension {d} of {list(shape)} does not scale by {factor_num}/{factor_den}")
    return tuple(s * factor_num // factor_den if i == d else s for i, s in enumerate(shape))


def rescaled_layout(
    layout: ShardedLayout, rules: Sequence[MpRule], ties: Dict[str, List[str]], parts: int, new_parts: int
) -> ShardedLayout:
    """The FSDP layout of one part at ``new_parts`` model-parallel parts: every split parameter's split
    dimension scaled by ``parts / new_parts``, flat parameters re-packed (fairscale concatenates members)."""
    out_parts = []
    for part in layout.parts:
        instances = []
        for inst in part.instances:
            flat = []
            for fp in inst.flat_params:
                members, offset = [], 0
                for m in fp.members:
                    name = part.prefix + inst.logical_name(m.name)
                    rule = rule_for(ties.get(name, [name]), rules)
                    shape = scaled_shape(m.shape, rule, parts, new_parts) if rule else m.shape
                    n = numel(shape)
                    members.append(Member(m.name, shape, offset, n))
                    offset += n
                flat.append(dataclasses.replace(fp, members=tuple(members), numel=offset))
            instances.append(dataclasses.replace(inst, flat_params=tuple(flat)))
        out_parts.append(dataclasses.replace(part, instances=tuple(instances)))
    return dataclasses.replace(layout, parts=tuple(out_parts))

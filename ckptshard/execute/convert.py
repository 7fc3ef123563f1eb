"""``convert``: between fairscale shards, DCP folders, torch.save and safetensors.

fairscale -> dcp            a DCP folder FSDP2 loads at any world size
dcp -> torch | safetensors  one file (or an index folder), streaming
dcp -> fairscale            N shards wrapped like --like's checkpoint
fairscale -> torch | safetensors | fairscale  are consolidate and reshard
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..osio.atomic import atomic_output, check_output, check_space
from ..osio.hashing import Hashes
from ..osio.manifest import MANIFEST, build_manifest, write_json
from ..plan.dcp import (
    MODEL,
    OPTIM,
    Chunk,
    fairscale_full_optimizer,
    fairscale_to_dcp,
    flat_tensors,
    model_state,
    plan_dcp,
)
from ..plan.shard import check_full_against_plan, sharded_files
from ..plan.transform import cast_dtype, name_mapper, parse_renames, transform
from ..sources.base import Source
from ..sources.dcp import DcpSource
from ..sources.fairscale import FairscaleSource, source_info
from ..sources.probe import open_source, open_template
from ..sources.torch_ranks import TorchRanksSource
from ..tensors import Progress, is_tensor, tree_nbytes
from ..write.copier import Copier
from ..write.dcp_files import (
    data_file_names,
    data_files,
    write_data_file,
    write_metadata,
)
from ..write.torch_file import FILE_OVERHEAD, RECORD_OVERHEAD
from .command import command
from .consolidate import (
    Request,
    check_parallel,
    consolidate_source,
    full_size_bound,
    hf_folder_of,
    output_format,
    write_file_manifest,
    write_full,
)
from .parallel import (
    AUTO,
    Digests,
    leads,
    map_jobs,
    run_checked,
    torchrun_world,
    write_folder_across_ranks,
)
from .progress import progress_bar
from .reshard import Split, Target, reshard_source, write_rank_files

TARGETS = ("dcp", "torch", "safetensors", "fairscale")


@dataclass
class ConvertResult:
    outputs: List[str]
    tensors: int
    nbytes: int
    notes: List[str] = field(default_factory=list)  # what the user should know about the output


@command
def convert(
    src: str,
    out: str,
    to: str,
    *,
    like: Optional[str] = None,
    world_size: Optional[int] = None,
    optimizer: bool = True,
    max_shard_size: Optional[int] = None,
    overwrite: bool = False,
    trust_pickles: bool = False,
    progress: bool = True,
    select: Sequence[str] = (),
    strip_prefix: Sequence[str] = (),
    rename: Sequence[str] = (),
    dtype: Optional[str] = None,
    jobs: int = AUTO,
    fsync: bool = True,
) -> ConvertResult:
    """Convert ``src`` (fairscale shards or a DCP folder) into format ``to`` at ``out``.

    Args:
        src: fairscale shards (folder, one shard file or a VISSL shard_list), a DCP folder, or torch
            FSDP2/FSDP1 per-rank files (to ``"dcp"``, ``"torch"`` or ``"safetensors"``).
        out: the output: a folder for ``"dcp"``, ``"fairscale"`` or index-sharded safetensors, else a file.
        to: ``"dcp"`` (torch FSDP2 loads it at any world size), ``"torch"``, ``"safetensors"`` or
            ``"fairscale"`` (from DCP, with ``like`` and ``world_size``).
        like: DCP -> fairscale: the fairscale checkpoint whose wrapping, container and names to follow.
            FSDP1 LOCAL_STATE_DICT files -> DCP: the model's full state dict (see ``consolidate``).
        world_size: DCP -> fairscale: the number of ranks.
        optimizer: convert optimizer state too, where present.
        max_shard_size, select, strip_prefix, rename, dtype, jobs, overwrite, trust_pickles, progress:
            as for :func:`ckptshard.consolidate`.

        fsync: fsync each output before it is renamed into place (False: as ``cp``, faster, and a
            crash soon after may lose data the manifest vouches for).

    Returns:
        ``ConvertResult``: ``outputs`` (paths), ``tensors`` (count), ``nbytes`` (tensor bytes written).

    Raises:
        CheckpointError: bad or inconsistent input, an output that exists (without ``overwrite``) or that
            ckptshard did not write, too little disk space, an input changed while read. Nothing is written.
    """
    if to not in TARGETS:
        raise CheckpointError(f"--to {to!r}: choose one of {', '.join(TARGETS)}")
    cast_dtype(dtype)  # a bad --dtype fails before any file is opened
    renames = parse_renames(rename)
    if to == "fairscale" and (world_size is None or world_size < 1):
        raise CheckpointError("--to fairscale needs --world-size N (N >= 1)")
    source = open_source(src, like=like if to == "dcp" else None, trust_pickles=trust_pickles, like_option=LIKE)
    shape = (tuple(select), tuple(strip_prefix), tuple(renames), dtype)
    if to == "dcp":
        return _to_dcp(source, out, optimizer, overwrite, progress, shape, jobs)
    if to == "fairscale":
        how = (optimizer, overwrite, trust_pickles, progress, shape, jobs)
        return _to_fairscale(source, out, like, world_size or 1, *how)
    fmt = _check_format(out, to, max_shard_size)
    check_parallel(fmt, jobs)
    if isinstance(source, DcpSource):
        how = (optimizer, max_shard_size, overwrite, trust_pickles, progress, shape, jobs)
        return _dcp_to_full(source, out, to, fmt, *how)
    hf, notes = hf_folder_of(source, fmt, None)
    req = Request(
        out, fmt, False, optimizer=False, overwrite=overwrite, trust_pickles=trust_pickles, progress=progress,
        select=tuple(select), strip_prefix=tuple(strip_prefix), renames=tuple(renames), dtype=dtype,
        max_shard_size=max_shard_size, jobs=jobs, hf=hf,
    )  # fmt: skip
    res = consolidate_source(source, req)
    return ConvertResult(res.outputs, res.tensors, res.nbytes, res.notes + notes)


LIKE = "--like with --to dcp"
Shape = Tuple[Tuple[str, ...], Tuple[str, ...], Tuple[Any, ...], Optional[str]]  # select, strip, renames, dtype


def _to_dcp(
    source: Source, out: str, optimizer: bool, overwrite: bool, progress: bool, shape: Shape, jobs: int
) -> ConvertResult:
    if isinstance(source, DcpSource):
        raise CheckpointError(f"{source.path} is already a DCP checkpoint")
    if isinstance(source, TorchRanksSource):
        return _ranks_to_dcp(source, out, optimizer, overwrite, progress, *shape, jobs)
    if isinstance(source, FairscaleSource):
        return _fairscale_to_dcp(source, out, optimizer, overwrite, progress, *shape, jobs)
    raise source.refuse("--to dcp", "consolidate with --mp-rules metaseq first, then convert that full state dict")


def _to_fairscale(
    source: Source,
    out: str,
    like: Optional[str],
    world_size: int,
    optimizer: bool,
    overwrite: bool,
    trust_pickles: bool,
    progress: bool,
    shape: Shape,
    jobs: int,
) -> ConvertResult:
    if isinstance(source, DcpSource):
        how = (optimizer, overwrite, trust_pickles, progress, shape, jobs)
        return _dcp_to_fairscale(source, out, like, world_size, *how)
    if not isinstance(source, FairscaleSource):
        raise source.refuse(
            "--to fairscale", "`reshard` moves them to another world size, `consolidate` writes one state dict"
        )
    if any(shape) or like:
        raise CheckpointError("fairscale -> fairscale is a reshard: --select/--rename/--dtype/--like do not apply")
    res = reshard_source(source, out, Target(world_size, optimizer), Split(None, (), 0.0), overwrite, progress, jobs)
    return ConvertResult([res.folder], len(source.full_weights()), res.nbytes)  # tensors, not files


def _check_format(out: str, to: str, max_shard_size: Optional[int]) -> str:
    fmt = output_format(out, max_shard_size)
    if fmt.split("-")[0] != to:
        raise CheckpointError(
            f"{out}: --to {to} but the name says {fmt}: end it with "
            + (".safetensors (or give --max-shard-size)" if to == "safetensors" else ".pt/.pth/.torch")
        )
    return fmt


def _fairscale_to_dcp(
    source: FairscaleSource,
    out: str,
    optimizer: bool,
    overwrite: bool,
    progress: bool,
    select: Sequence[str],
    strip_prefix: Sequence[str],
    renames: Sequence[Any],
    dtype: Optional[str],
    jobs: int,
) -> ConvertResult:
    ckpt = source.ckpt  # read without torch where the files allow: the DCP writer needs none either
    run_checked(lambda: check_output(out, overwrite, tuple(ckpt.files.paths), is_dir=True))
    weights = transform(source.full_weights(), select, strip_prefix, renames, cast_dtype(dtype))
    with_optim = optimizer and ckpt.container.optimizer is not None
    tree = fairscale_to_dcp(ckpt, weights, with_optim, name_mapper(select, strip_prefix, renames))
    return _write_dcp(plan_dcp(tree), out, overwrite, source.describe(), progress, jobs, len(weights))


def _write_dcp(
    plan: Any, out: str, overwrite: bool, source: Dict[str, Any], progress: bool, jobs: int, count: int
) -> ConvertResult:
    world = torchrun_world()
    if world is not None:
        _dcp_across_ranks(plan, out, overwrite, source, *world)
        return ConvertResult([out], count, plan.nbytes)
    check_space(out, dcp_size_bound(plan))
    with (
        progress_bar(plan.nbytes, "convert -> dcp", progress) as tick,
        atomic_output(out, is_dir=True, overwrite=overwrite) as tmp,
    ):
        names, digests = _dcp_in_parallel(tmp, plan, jobs, tick)
        write_json(os.path.join(tmp, MANIFEST), build_manifest(tmp, names, source, "convert", None, digests))
    return ConvertResult([out], count, plan.nbytes)


def _ranks_to_dcp(
    source: TorchRanksSource,
    out: str,
    optimizer: bool,
    overwrite: bool,
    progress: bool,
    select: Sequence[str],
    strip_prefix: Sequence[str],
    renames: Sequence[Any],
    dtype: Optional[str],
    jobs: int,
) -> ConvertResult:
    """torch FSDP per-rank files -> DCP: ``{"model": ..., "optim": ...}`` as FSDP2's own ``dcp.save`` stores
    them."""
    ranks = source.ranks
    run_checked(lambda: check_output(out, overwrite, source.inputs, is_dir=True))
    weights = transform(ranks.full_model(), select, strip_prefix, renames, cast_dtype(dtype))
    tree: Dict[str, Any] = {MODEL: weights}
    if optimizer and ranks.optims is not None:
        rename = name_mapper(select, strip_prefix, renames)
        full = ranks.full_optimizer()
        state = {rename(n): v for n, v in full["state"].items() if rename(n) is not None}
        groups = [
            {**g, "params": [rename(n) for n in g["params"] if rename(n) is not None]} for g in full["param_groups"]
        ]
        tree[OPTIM] = {"state": state, "param_groups": groups}
    return _write_dcp(plan_dcp(tree), out, overwrite, source.describe(), progress, jobs, len(weights))


def dcp_size_bound(plan: Any) -> int:
    """An upper estimate of a DCP folder's bytes: data, each chunk's torch.save frame, and .metadata."""
    chunks = sum(len(e.chunks) for e in plan.entries.values() if hasattr(e, "chunks"))
    return plan.nbytes + (RECORD_OVERHEAD + FILE_OVERHEAD) * chunks + FILE_OVERHEAD * (1 + len(plan.entries))


def _write_data_file_hashed(
    path: str, items: List[Any], tick: Optional[Progress] = None
) -> Tuple[List[Tuple[int, int]], str]:
    """One data file and its digest, hashed by the process (or thread) that writes it."""
    with Copier() as copier, Hashes() as hashes:
        placed = write_data_file(path, items, copier, tick, hashes)
        return placed, hashes.digest(path)


def _write_data_file_job(
    job: Tuple[str, List[Any]], tick: Optional[Progress] = None
) -> Tuple[List[Tuple[int, int]], str]:
    return _write_data_file_hashed(*job, tick)


def _dcp_in_parallel(folder: str, plan: Any, jobs: int, tick: Any) -> Tuple[List[str], Digests]:
    """The data files in ``jobs`` local processes, or with ``jobs`` 1 in threads (the same bytes); then .metadata."""
    files = data_files(plan)
    names = data_file_names(files)
    work = [(os.path.join(folder, n), items) for n, items in zip(names, files)]
    results = map_jobs(
        _write_data_file_job, work, jobs, tick, lambda job: sum(c.fill.nbytes for c in job[1] if isinstance(c, Chunk))
    )
    return write_metadata(folder, plan, files, [p for p, _ in results]), dict(zip(names, (d for _, d in results)))


def _dcp_across_ranks(plan: Any, out: str, overwrite: bool, source: Dict[str, Any], rank: int, world: int) -> None:
    """Under torchrun: rank r writes data files r, r + world, ...; rank 0 writes .metadata and the manifest."""
    files = data_files(plan)
    names = data_file_names(files)

    def share(folder: str) -> Dict[int, Any]:  # placements and digest of each file this rank writes
        return {
            i: _write_data_file_hashed(os.path.join(folder, names[i]), files[i]) for i in range(rank, len(files), world)
        }

    def finish(folder: str, shares: List[Dict[int, Any]]) -> None:
        done = {i: r for s in shares for i, r in s.items()}
        written = write_metadata(folder, plan, files, [done[i][0] for i in range(len(files))])
        digests = {names[i]: done[i][1] for i in done}
        write_json(os.path.join(folder, MANIFEST), build_manifest(folder, written, source, "convert", None, digests))

    write_folder_across_ranks(out, overwrite, dcp_size_bound(plan), rank, world, share, finish)


def _dcp_to_full(
    source: DcpSource,
    out: str,
    to: str,
    fmt: str,
    optimizer: bool,
    max_shard_size: Optional[int],
    overwrite: bool,
    trust_pickles: bool,
    progress: bool,
    shape: Shape,
    jobs: int,
) -> ConvertResult:
    """A DCP folder as one torch.save or safetensors output: the whole nested tree where nothing is selected
    or renamed (what torch's ``format_utils.dcp_to_torch_save`` writes), else its flattened names."""
    d, inputs = source.dcp, source.inputs
    select, strip_prefix, renames, dtype = shape
    run_checked(lambda: check_output(out, overwrite, inputs, is_dir=fmt == "safetensors-index"))
    whole = d.tree if optimizer else {k: v for k, v in d.tree.items() if k != OPTIM}
    if fmt == "torch" and not any(shape):
        tree: Any = whole
        count = sum(1 for v in flat_tensors(whole, True, source.path).values() if is_tensor(v))
    else:
        tensors = flat_tensors(whole, False, source.path, select)
        tree = transform(tensors, select, strip_prefix, renames, cast_dtype(dtype))
        count = len(tree)
    total = tree_nbytes(tree) if fmt == "torch" else sum(f.nbytes for f in tree.values())
    run_checked(lambda: check_space(out, full_size_bound(fmt, tree)))
    info = source.describe()
    with Copier() as copier, Hashes() as hashes, progress_bar(total, f"convert -> {to}", progress and leads()) as tick:
        how = (max_shard_size, overwrite, trust_pickles, hashes, jobs)
        write_full(out, fmt, tree, copier, tick, info, "convert", *how)
        if os.path.isfile(out):
            write_file_manifest(out, info, "convert", hashes)
    return ConvertResult([out], count, total)


def _dcp_to_fairscale(
    source: DcpSource,
    out: str,
    like: Optional[str],
    world_size: int,
    optimizer: bool,
    overwrite: bool,
    trust_pickles: bool,
    progress: bool,
    shape: Shape,
    jobs: int,
) -> ConvertResult:
    select, strip_prefix, renames, dtype = shape
    if like is None:
        raise CheckpointError("--to fairscale needs --like SRC: a fairscale checkpoint whose FSDP wrapping to follow")
    if dtype is not None:
        raise CheckpointError("--dtype does not apply to --to fairscale: shards keep the wrapping's dtypes")
    d, inputs = source.dcp, source.inputs
    template = open_template(like, trust_pickles, torch_free=d.torch_free).ckpt  # one kind of dtype
    full = transform(model_state(d.tree, d.folder), select, strip_prefix, renames)
    check_full_against_plan(template, full)
    full_optim = None
    if optimizer and template.container.optimizer is not None and OPTIM not in d.tree:
        raise CheckpointError(
            f"{d.folder}: no optimizer state ('{OPTIM}') to shard; pass --no-optimizer to write weights only"
        )
    if optimizer and template.container.optimizer is not None:
        new_name = name_mapper(select, strip_prefix, renames)
        if not isinstance(d.tree[OPTIM], dict) or "param_groups" not in d.tree[OPTIM]:
            raise CheckpointError(f"{d.folder}: '{OPTIM}' holds no param_groups: not an optimizer state dict")
        # DCP stores no empty dict: an optimizer with no per-parameter state (SGD without momentum) has no 'state'.
        by_new = {new_name(k): v for k, v in d.tree[OPTIM].get("state", {}).items() if new_name(k) is not None}
        groups = [
            dict(g, params=[new_name(n) if isinstance(n, str) else n for n in g.get("params", [])])
            for g in d.tree[OPTIM]["param_groups"]
        ]
        full_optim = fairscale_full_optimizer(template, {"state": by_new, "param_groups": groups})
        # fairscale's other optimizer keys (e.g. fairseq's loss_scale) come from the template.
        extra = {k: v for k, v in template.optimizer_state(0).items() if k not in ("state", "param_groups")}
        full_optim.update(extra)
    check_output(out, overwrite, inputs + tuple(template.files.paths), is_dir=True)
    trees = sharded_files(template, full, world_size, full_optim)
    info = {"dcp": source.describe(), "like": source_info(template)}
    res = write_rank_files(template, trees, out, f"convert ->{world_size}", overwrite, progress, info, jobs)
    return ConvertResult([res.folder], len(full), res.nbytes)

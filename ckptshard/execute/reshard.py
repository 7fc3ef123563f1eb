"""``reshard`` (M shards -> N) and ``shard`` (full state dict -> N shards)."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..dtypes import StoredDType
from ..errors import CheckpointError
from ..layout.chunking import check_world_size
from ..osio.atomic import atomic_output, check_output, check_space
from ..osio.hashing import Hashes
from ..osio.manifest import MANIFEST, build_manifest, write_json
from ..plan.model_parallel import MpRule, check_tolerance, rules_from
from ..plan.reshard import resharded_file
from ..plan.shard import check_full_against_plan, sharded_files, sharded_from_full, sharded_optimizer_from_full
from ..plan.torch_ranks import (
    Fsdp1Optimizer,
    LocalReshard,
    TargetMesh,
    placement_rule,
    resharded_model,
    resharded_optimizer,
    shard_group,
)
from ..read.full_state import full_state_refs
from ..read.rank_files import FSDP_CONFIG, read_fsdp_config
from ..read.safe_load import load_lazy
from ..read.source import ShardedCheckpoint
from ..sources.base import Source
from ..sources.fairscale import FairscaleSource, source_info
from ..sources.model_parts import DEFAULT_TOLERANCE, ModelPartsSource, repartitioned
from ..sources.probe import open_source, open_template
from ..sources.torch_ranks import TorchRanksSource
from ..tensors import TensorRef, tree_nbytes
from ..tree import leaves
from ..write.copier import Copier
from ..write.torch_file import save_plain, torch_file_size_bound, write_torch
from .command import command
from .parallel import (
    AUTO,
    Digests,
    PlannedFiles,
    merged,
    run_checked,
    torchrun_world,
    write_folder_across_ranks,
    write_torch_files,
)
from .progress import progress_bar


@dataclass
class ReshardResult:
    folder: str
    files: List[str]
    nbytes: int
    notes: List[str] = field(default_factory=list)


WORLD_SIZE_1_NOTE = (
    "at world size 1 FSDP saves the parameters of unflattened instances in their own shape, not as "
    "1-D shards, and so do these files: fairscale's consolidate_shard_weights, which fairseq, metaseq and "
    "VISSL call, cannot read them; `ckptshard consolidate` makes a full state dict of them"
)


def _noted(res: ReshardResult, world_size: int) -> ReshardResult:
    if world_size == 1:
        res.notes.append(WORLD_SIZE_1_NOTE)
    return res


def shard_list_name(ckpt: ShardedCheckpoint) -> str:
    """VISSL's list file: ``model_phase2_shard{r}.torch`` -> ``model_phase2.torch``."""
    if ckpt.files.shard_list:
        return os.path.basename(ckpt.files.shard_list)
    head = ckpt.files.head
    return (head[: -len("_shard")] if head.endswith("_shard") else head.rstrip("_-")) + ckpt.files.tail


MANIFEST_ENTRY = 256  # bytes a file's line in the manifest takes, at most for any sane name


def _sizes(trees: Sequence[Any] | PlannedFiles) -> Tuple[int, int]:
    """(tensor bytes, the bytes on disk or an upper estimate) of every rank file and the manifest."""
    if isinstance(trees, PlannedFiles):
        return trees.nbytes * trees.count, (torch_file_size_bound(trees.first) + MANIFEST_ENTRY) * trees.count
    return sum(tree_nbytes(t) for t in trees), sum(torch_file_size_bound(t) + MANIFEST_ENTRY for t in trees)


def write_rank_files(
    template: ShardedCheckpoint,
    trees: Sequence[Any] | PlannedFiles,
    dst: str,
    desc: str,
    overwrite: bool,
    progress: bool,
    source: Dict[str, Any],
    jobs: int = AUTO,
    names: Optional[List[str]] = None,
) -> ReshardResult:
    """Write one file per planned rank tree into folder ``dst``, named like ``template``'s (or ``names``).

    The whole folder appears at once when complete (VISSL gets its shard_list
    too). ``jobs`` > 1 writes files in that many local processes, else
    threads of this one do; under torchrun the ranks share the files (see
    :mod:`.parallel`).
    """
    total, on_disk = _sizes(trees)
    count = trees.count if isinstance(trees, PlannedFiles) else len(trees)
    names = names or [template.files.name_for(r) for r in range(count)]
    world = torchrun_world()
    if world is not None:
        return _write_distributed(template, trees, names, dst, desc, overwrite, source, on_disk, *world)
    check_space(dst, on_disk)
    with progress_bar(total, desc, progress) as tick, atomic_output(dst, is_dir=True, overwrite=overwrite) as tmp:
        paths = [os.path.join(tmp, name) for name in names]
        work = trees.jobs(paths) if isinstance(trees, PlannedFiles) else list(zip(trees, paths))
        digests = write_torch_files(work, jobs, template.trust_pickles, tick)
        names = _finish_folder(template, tmp, names, source, desc, digests)
    return ReshardResult(dst, names, total)


def _finish_folder(
    template: ShardedCheckpoint, folder: str, names: List[str], source: Dict[str, Any], desc: str, digests: Digests
) -> List[str]:
    """VISSL's shard_list and the manifest, once every rank file is written (``digests``: by their writers)."""
    names = list(names)
    if template.container.kind == "vissl":
        list_name = shard_list_name(template)
        save_plain(os.path.join(folder, list_name), {"type": "shard_list", "shards": names})
        names.append(list_name)
    write_json(os.path.join(folder, MANIFEST), build_manifest(folder, names, source, desc.split()[0], None, digests))
    return names


def _write_distributed(
    template: ShardedCheckpoint,
    trees: Sequence[Any] | PlannedFiles,
    names: List[str],
    dst: str,
    desc: str,
    overwrite: bool,
    source: Dict[str, Any],
    total: int,
    rank: int,
    world: int,
) -> ReshardResult:
    tree = trees.tree if isinstance(trees, PlannedFiles) else trees.__getitem__

    def share(folder: str) -> Digests:  # each rank hashes what it writes: rank 0 reads nothing again
        with Copier() as copier, Hashes() as hashes:
            for i in range(rank, len(names), world):
                write_torch(os.path.join(folder, names[i]), tree(i), copier, None, template.trust_pickles, hashes)
            return {names[i]: hashes.digest(os.path.join(folder, names[i])) for i in range(rank, len(names), world)}

    def finish(folder: str, shares: List[Digests]) -> List[str]:
        return _finish_folder(template, folder, names, source, desc, merged(shares))

    written = write_folder_across_ranks(dst, overwrite, total, rank, world, share, finish)
    return ReshardResult(dst, written or names, total)


@command
def reshard(
    src: str,
    dst: str,
    world_size: int,
    *,
    overwrite: bool = False,
    trust_pickles: bool = False,
    progress: bool = True,
    jobs: int = AUTO,
    optimizer: bool = True,
    like: Optional[str] = None,
    model_parallel: Optional[int] = None,
    mp_rules: Sequence[str] = (),
    mp_presets: Sequence[str] = (),
    mp_tolerance: float = DEFAULT_TOLERANCE,
    shard_group: Optional[int] = None,
    mesh_dim_names: Optional[Sequence[str]] = None,
    fsync: bool = True,
    placement: Optional[str] = None,
) -> ReshardResult:
    """Write the checkpoint ``src`` as FSDP at ``world_size`` would have saved it, into folder ``dst``.

    Weights, FSDP metadata and optimizer state are resharded; the rest of
    each file's container is carried, file names follow the source's.

    Args:
        src: the shards: a folder, one shard file or a VISSL shard_list file; or torch FSDP2 per-rank
            files (written as FSDP2 at ``world_size`` saves them, see ``docs/torch-fsdp.md``).
        dst: the folder to create.
        world_size: the number of ranks to shard for.
        overwrite: replace an existing folder that ckptshard wrote (never anything else).
        trust_pickles: unpickle without the weights-only safety net (files you trust only).
        progress: show a progress bar.
        jobs: local processes writing the files (0: chosen from the plan; 1: threads of this process).
        optimizer: False leaves the optimizer state out (a model-only checkpoint).
        like: for FSDP1 LOCAL_STATE_DICT files, the model's full state dict (as ``consolidate``'s).
        model_parallel, mp_rules, mp_presets, mp_tolerance: for several model-parallel parts, the number of
            parts to write (default: as many as there are); another number needs the rules that say which
            tensors tensor parallelism split (see ``consolidate``).
        shard_group: for torch FSDP2 files, the ranks each parameter is sharded over: fewer than
            ``world_size`` writes HSDP's files (``world_size // shard_group`` replicas, verl's ``fsdp_size``).
            Default: an HSDP source's own group size, else ``world_size``.
        mesh_dim_names: for torch FSDP2 files, the names of the new device mesh's dimensions, as the training
            code names them (torch loads a DTensor only into a parameter on the same mesh). Default: the
            source's (see ``docs/torch-fsdp.md``).

        fsync: fsync each output before it is renamed into place (False: as ``cp``, faster, and a
            crash soon after may lose data the manifest vouches for).
        placement: for torch FSDP2 files, the rule that picks each parameter's shard dimension at
            ``world_size``: ``"dim0"`` (torch's default), ``"divisible"`` (verl's ``shard_placement_fn``: the
            first dimension the shard group divides) or ``"keep"`` (each parameter's dimension in the source).
            Default: the rule the source's placements fit, refused where they fit both and the two differ at
            ``world_size`` (``ckptshard.plan.placement``).

    Returns:
        ``ReshardResult``: ``folder``, ``files`` (names written), ``nbytes`` (tensor bytes), ``notes``
        (what the user should know of the output: at world size 1, which readers cannot take it).

    Raises:
        CheckpointError: bad or inconsistent input (a missing or extra shard, shards of different runs,
            metadata that does not describe the data), an output that exists (without ``overwrite``) or
            that ckptshard did not write, too little disk space, an input changed while read. Nothing is
            written. OSError: the system's own failures (disk full, permissions); nothing is left behind.
    """
    check_world_size(world_size)
    if model_parallel is not None:
        check_world_size(model_parallel, "--model-parallel")
    check_tolerance(mp_tolerance)
    source = open_source(src, like=like, trust_pickles=trust_pickles)
    split = Split(model_parallel, rules_from(mp_rules, mp_presets), mp_tolerance)
    target = Target(world_size, optimizer, shard_group, mesh_dim_names, placement)
    return reshard_source(source, dst, target, split, overwrite, progress, jobs)


@dataclass(frozen=True)
class Target:
    """What a reshard writes: FSDP at ``world_size`` (HSDP with ``shard_group``), with optimizer state or not."""

    world_size: int
    optimizer: bool = True
    shard_group: Optional[int] = None
    mesh_dim_names: Optional[Sequence[str]] = None
    placement: Optional[str] = None  # FSDP2's shard-dimension rule (plan.placement); None: the source's


def reshard_source(
    source: Source, dst: str, target: Target, split: Split, overwrite: bool, progress: bool, jobs: int
) -> ReshardResult:
    """:func:`reshard` of an opened source (``convert`` opens it once for both)."""
    n, optimizer = target.world_size, target.optimizer
    if isinstance(source, TorchRanksSource):
        how = (overwrite, progress, optimizer, target.shard_group, target.mesh_dim_names, jobs, target.placement)
        return reshard_ranks(source, dst, n, *how)
    if target.shard_group is not None or target.mesh_dim_names is not None or target.placement is not None:
        raise source.refuse("--shard-group, --mesh-dim-names or --placement", "they are for torch FSDP2 per-rank files")
    if isinstance(source, ModelPartsSource):
        return _reshard_parts(source, dst, n, overwrite, progress, jobs, optimizer, split)
    if split.parts is not None or split.rules:
        raise CheckpointError(f"{source.path}: --model-parallel/--mp-rule given, but it holds one model part")
    if not isinstance(source, FairscaleSource):
        raise source.refuse(
            "reshard", "FSDP2 loads a DCP folder at any world size; convert --to fairscale --like CKPT shards one"
        )
    if source.like is not None:
        raise CheckpointError(
            f"{source.path}: --like restores fairscale 0.3's tied parameters in a consolidated output; reshard "
            "writes 0.3's shards and metadata as they are"
        )
    ckpt = source.ckpt
    run_checked(lambda: check_output(dst, overwrite, tuple(ckpt.files.paths), is_dir=True))
    # Rank 0's plan runs every check of the input, before any byte is written; the others are planned
    # as they are written.
    trees = PlannedFiles(lambda r: resharded_file(ckpt, n, r, optimizer), n)
    res = write_rank_files(
        ckpt, trees, dst, f"reshard {ckpt.world_size}->{n}", overwrite, progress, source.describe(), jobs
    )
    return _noted(res, n)


def _reshard_parts(
    source: ModelPartsSource,
    dst: str,
    world_size: int,
    overwrite: bool,
    progress: bool,
    jobs: int,
    optimizer: bool,
    split: Split,
) -> ReshardResult:
    """Every model-parallel part's FSDP shards resharded to ``world_size``, the parts and names kept: each part
    as FSDP at ``world_size`` over that part's data-parallel group saves it. With ``split.parts`` another
    number of parts: the parts joined and cut again by ``split.rules``."""
    files, ckpts = source.files, source.ckpts
    run_checked(lambda: check_output(dst, overwrite, files.paths, is_dir=True))
    if split.parts is not None and split.parts != len(ckpts):
        return _repartition(source, dst, world_size, overwrite, progress, jobs, optimizer, split)
    for c in ckpts[1:]:  # every part's checks before any byte is written (part 0's run in PlannedFiles)
        resharded_file(c, world_size, 0, optimizer)
    n = world_size
    trees = PlannedFiles(lambda i: resharded_file(ckpts[i // n], n, i % n, optimizer), len(ckpts) * n)
    names = [ckpts[i // n].files.name_for(i % n) for i in range(len(ckpts) * n)]
    desc = f"reshard {len(ckpts)} parts x {ckpts[0].world_size}->{n}"
    res = write_rank_files(ckpts[0], trees, dst, desc, overwrite, progress, source.describe(), jobs, names)
    return _noted(res, world_size)


@dataclass(frozen=True)
class Split:
    """How model-parallel parts are written: how many (None: as many as read), by which rules."""

    parts: Optional[int]
    rules: Sequence[MpRule]
    tolerance: float


def _repartition(
    source: ModelPartsSource,
    dst: str,
    world_size: int,
    overwrite: bool,
    progress: bool,
    jobs: int,
    optimizer: bool,
    split: Split,
) -> ReshardResult:
    ckpts = source.ckpts
    k, k2, n = len(ckpts), split.parts or 1, world_size
    if not split.rules:
        raise CheckpointError(
            f"--model-parallel {k2} from {k} parts needs the rules saying which tensors tensor parallelism split: "
            "--mp-rules metaseq or --mp-rule REGEX=DIM[/G]"
        )
    plan = repartitioned(ckpts, split.rules, split.tolerance, k2, optimizer)
    template = plan.template

    def tree(i: int) -> Any:
        j, r = divmod(i, n)
        optim = None if plan.optims is None else sharded_optimizer_from_full(template.layout, plan.optims[j], n, r)
        return sharded_from_full(template, plan.fulls[j], n, r, optim)

    for full in plan.fulls:  # every new part's names and shapes against its plan, before any byte is written
        check_full_against_plan(template, full)
    trees = PlannedFiles(tree, k2 * n)
    head = ckpts[0].files.head
    names = [_part_head(head, j) + f"{r}{ckpts[0].files.tail}" for j in range(k2) for r in range(n)]
    desc = f"reshard {k} parts x {ckpts[0].world_size} -> {k2} parts x {n}"
    res = write_rank_files(template, trees, dst, desc, overwrite, progress, source.describe(), jobs, names)
    res.notes = list(plan.notes) + res.notes
    return _noted(res, world_size)


def _part_head(head: str, part: int) -> str:
    """``checkpoint_last-model_part-0-shard`` -> ``...-model_part-{part}-shard``."""
    return re.sub(r"model_part-\d+", f"model_part-{part}", head)


def _all_stored(*trees: Any) -> bool:
    """Every tensor of ``trees`` read without torch (a StoredDType)."""
    return all(isinstance(v.dtype, StoredDType) for t in trees for _, v in leaves(t) if isinstance(v, TensorRef))


def _shard_inputs(
    full: str, like: str, optimizer: Optional[str], trust_pickles: bool, torch_free: bool
) -> Tuple[ShardedCheckpoint, Mapping[str, TensorRef], Any]:
    """The template, the full state and the full optimizer state, all read without torch or all with it."""
    template = open_template(like, trust_pickles, torch_free).ckpt
    if optimizer is not None and template.container.optimizer is None:
        raise CheckpointError(f"{like}: its container has no place for optimizer state")
    free = torch_free and _all_stored(template.objs)
    refs = full_state_refs(full, trust_pickles, free)
    full_optim = load_lazy(optimizer, trust_pickles, free) if optimizer is not None else None
    if free and not _all_stored(refs, full_optim):  # one kind of dtype per run: everything through torch
        return _shard_inputs(full, like, optimizer, trust_pickles, torch_free=False)
    return template, refs, full_optim


@command
def shard(
    full: str,
    like: str,
    dst: str,
    world_size: int,
    *,
    optimizer: Optional[str] = None,
    overwrite: bool = False,
    trust_pickles: bool = False,
    progress: bool = True,
    fsync: bool = True,
) -> ReshardResult:
    """Shard the full state dict ``full`` for ``world_size`` ranks, wrapped as the checkpoint ``like`` is.

    Args:
        full: a full state dict: ``.pt``, ``.safetensors`` or an index-sharded safetensors folder.
        like: a sharded checkpoint whose FSDP wrapping (instances, flattening, order) and container to follow.
        dst: the folder to create.
        world_size: the number of ranks to shard for.
        optimizer: a full optimizer state (``consolidate(optimizer=True)``'s, or
            ``gather_full_optim_state_dict``'s) to shard too.
        overwrite, trust_pickles, progress: as for :func:`reshard`.

        fsync: fsync each output before it is renamed into place (False: as ``cp``, faster, and a
            crash soon after may lose data the manifest vouches for).

    Returns:
        ``ReshardResult``: ``folder``, ``files``, ``nbytes``, ``notes``.

    Raises:
        CheckpointError: bad or inconsistent input (names or shapes off the wrapping's plan, listed), an
            output that exists (without ``overwrite``) or
            that ckptshard did not write, too little disk space, an input changed while read. Nothing is
            written. OSError: the system's own failures (disk full, permissions); nothing is left behind.
    """
    check_world_size(world_size)
    template, refs, full_optim = _shard_inputs(full, like, optimizer, trust_pickles, torch_free=True)
    check_full_against_plan(template, refs)
    inputs = (full, *template.files.paths) + ((optimizer,) if optimizer is not None else ())
    run_checked(lambda: check_output(dst, overwrite, inputs, is_dir=True))
    trees = sharded_files(template, refs, world_size, full_optim)
    source = {"full": os.path.abspath(full), "like": source_info(template), "optimizer": optimizer}
    return _noted(
        write_rank_files(template, trees, dst, f"shard ->{world_size}", overwrite, progress, source), world_size
    )


def reshard_ranks(
    source: TorchRanksSource,
    dst: str,
    world: int,
    overwrite: bool,
    progress: bool,
    optimizer: bool,
    group: Optional[int] = None,
    dim_names: Optional[Sequence[str]] = None,
    jobs: int = AUTO,
    placement: Optional[str] = None,
) -> ReshardResult:
    """torch FSDP2 or FSDP1 per-rank files at ``world`` ranks, named and laid out as the source's.

    Each file is what ``model.state_dict()`` / ``optimizer.state_dict()``
    of FSDP at ``world`` saves (each DTensor or FSDP1 ShardedTensor its
    source's pickle rewritten for its new rank, ``write_torch``; FSDP1's optimizer slices
    are cut as the units' flat parameters at ``world`` cut them, the units
    told from the source's slices: ``plan.torch_ranks.fsdp1_units``).
    FSDP1 at world size 1 runs NO_SHARD: plain tensors, each moment in its
    parameter's shape, both ways (which of its plain tensors are parameters,
    the optimizer's moments tell: ``TorchRanks``).
    HSDP (``group`` below ``world``, or an HSDP source's default): rank r
    holds shard ``r % group`` of FSDP2 at ``group``, replicated on a 2-D mesh
    (``TargetMesh``), whose pickle torch makes (``mesh_template``).
    verl's ``extra_state`` files (LR scheduler, RNG states) are copied byte
    for byte, never unpickled: new rank r gets old rank ``r % M``'s.
    ``fsdp_config.json`` gets the new world size; the folder's other
    entries (``huggingface/``) are copied.
    """
    ranks = source.ranks
    ranks.require_params()
    group = shard_group(ranks, world, group)
    mesh = TargetMesh(ranks, world, group, dim_names)
    rule = placement_rule(ranks, group, placement)  # each DTensor's shard dimension at the new size
    if torchrun_world() is not None and mesh.replicas > 1:  # its mesh template needs a process group of its own
        raise CheckpointError("resharding torch FSDP files to HSDP runs in one process: start it without torchrun")
    files = ranks.files
    carried = files.carried_files()
    config = next((read_fsdp_config(p) for n, p in carried if n == FSDP_CONFIG), None)
    # verl's folder is read whole (its other entries are carried): an output inside it would copy itself.
    inputs = (*files.paths, *(p for _, p in carried)) + ((files.folder,) if files.verl else ())
    run_checked(lambda: check_output(dst, overwrite, inputs, is_dir=True))
    with_optim = optimizer and ranks.optims is not None
    wholes: Dict[Any, Any] = {}  # each DTensor assembled once, re-cut for every rank
    no_shard = ranks.kind == "fsdp1" and world == 1  # FSDP1 at one rank: plain tensors, no mesh, no torch
    local = LocalReshard(ranks, world) if ranks.local is not None and not no_shard else None
    if with_optim and ranks.local is not None and no_shard and not ranks.local.orig_params:
        raise CheckpointError(
            f"{ranks.files.folder}: FSDP1 at one rank keeps flat parameters without use_orig_params; resharding "
            "their optimizer state to one rank is not supported: reshard with --no-optimizer, or convert --to dcp"
        )
    fsdp1 = Fsdp1Optimizer(ranks, world) if with_optim and ranks.kind == "fsdp1" and local is None else None

    def rank_trees(r: int) -> Dict[str, Any]:
        if no_shard:  # every tensor whole
            trees = {"model": ranks.full_model()}
        elif local is not None:
            trees = {"model": local.rank(r)}
        else:
            trees = {"model": resharded_model(ranks, group, mesh.shard_rank(r), wholes, rule)}
        if fsdp1 is not None:
            trees["optim"] = fsdp1.rank(r)
        elif local is not None and with_optim:
            trees["optim"] = local.optimizer(r)
        elif with_optim:
            trees["optim"] = resharded_optimizer(ranks, group, mesh.shard_rank(r), wholes, rule)
        return mesh.placed(trees)

    planned = PlannedFiles(rank_trees, world)  # rank 0's plan runs every check; the others, as written
    per_rank = planned.nbytes
    extra = max((os.path.getsize(p) for p in files.extra or ()), default=0)  # each new rank copies one
    bound = world * (sum(torch_file_size_bound(t) for t in planned.first.values()) + 3 * MANIFEST_ENTRY)
    desc = f"reshard {_mesh_text(ranks.hsdp or (1, ranks.world_size))}->{_mesh_text((mesh.replicas, group))}"

    def place_of(r: int) -> Any:
        return None if no_shard else mesh.place(r)

    kinds = [*planned.first, *(["extra_state"] if files.extra else [])]  # each rank's files, in order
    names = [files.name_of(k, r, world) for r in range(world) for k in kinds]

    def write_share(folder: str, share: Callable[[List[Any]], List[Any]], tick: Any) -> Digests:
        """This process's (or rank's) share of the rank files, written by ``jobs`` processes or threads."""
        work = planned.rank_jobs(lambda k, r: os.path.join(folder, files.name_of(k, r, world)), place_of)
        return write_torch_files(share(work), jobs, False, tick)

    def finish(folder: str, digests: Digests) -> None:
        for r in range(world if files.extra else 0):  # verl's extra_state: copied byte for byte, never unpickled
            name = files.name_of("extra_state", r, world)
            shutil.copyfile(files.extra[r % len(files.extra)], os.path.join(folder, name))
        names.extend(_carry(carried, config, folder, world))
        manifest = build_manifest(folder, names, source.describe(), "reshard", None, digests)
        write_json(os.path.join(folder, MANIFEST), manifest)

    bytes_on_disk = bound + extra * world + sum(os.path.getsize(p) for _, p in carried)
    ranks_world = torchrun_world()
    if ranks_world is not None:  # torchrun: rank i writes files i, i + world, ...; rank 0 the rest
        rank, n = ranks_world
        write_folder_across_ranks(
            dst, overwrite, bytes_on_disk, rank, n,
            lambda folder: write_share(folder, lambda work: work[rank::n], None),
            lambda folder, shares: finish(folder, merged(shares)),
        )  # fmt: skip
        return ReshardResult(dst, names, per_rank * world, source.notes())
    check_space(dst, bytes_on_disk)
    with (
        progress_bar(per_rank * world, desc, progress) as tick,
        atomic_output(dst, is_dir=True, overwrite=overwrite) as tmp,
    ):
        finish(tmp, write_share(tmp, lambda work: work, tick))
    return ReshardResult(dst, names, per_rank * world, source.notes())


def _mesh_text(mesh: Tuple[int, int]) -> str:
    """``3`` for FSDP2's 1-D mesh, ``2x3`` for HSDP's replicas x shards."""
    return f"{mesh[0]}x{mesh[1]}" if mesh[0] > 1 else str(mesh[1])


def _carry(carried: Sequence[Tuple[str, str]], config: Any, folder: str, world: int) -> List[str]:
    """Copy the source folder's other files (``RankFiles.carried_files``); ``fsdp_config.json`` (``config``, as
    read) says the new world size. Their names."""
    for name, src in carried:
        dst = os.path.join(folder, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if name == FSDP_CONFIG:
            if isinstance(config, dict) and "world_size" in config:
                config = {**config, "world_size": world}
            write_json(dst, config)
        else:
            shutil.copyfile(src, dst)
    return [name for name, _ in carried]

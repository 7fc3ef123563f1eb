"""``consolidate``: shards -> one full state dict (torch.save or safetensors)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..formats.safetensors import safetensors_index_plan
from ..osio.atomic import atomic_output, check_output, check_space
from ..osio.hashing import Hashes
from ..osio.manifest import MANIFEST, build_manifest, manifest_path, write_json
from ..plan.consolidate import consolidated_weights, split_by_part
from ..plan.hf_folder import DEFAULT_SHARD_SIZE, SINGLE_FILE, config_for, untied
from ..plan.model_parallel import MpRule, check_tolerance, rules_from
from ..plan.optimizer import consolidated_optimizer
from ..plan.transform import cast_dtype, parse_renames, transform
from ..read.hf_config import HfConfigDir, read_hf_dir
from ..read.source import ShardedCheckpoint
from ..sources.base import Source
from ..sources.fairscale import FairscaleSource, source_info
from ..sources.model_parts import DEFAULT_TOLERANCE, ModelPartsSource, joined_optimizer, joined_weights, part_output
from ..sources.probe import open_source
from ..sources.torch_ranks import TorchRanksSource
from ..tensors import Fill, tree_nbytes, with_fills
from ..tree import copy_tree, get_path, set_path
from ..write.copier import Copier
from ..write.hf_files import write_hf_files
from ..write.safetensors_file import write_index_json, write_safetensors
from ..write.torch_file import (
    FILE_OVERHEAD,
    RECORD_OVERHEAD,
    torch_file_size_bound,
    write_torch,
)
from .command import command
from .parallel import (
    AUTO,
    Digests,
    leads,
    merged,
    run_checked,
    torchrun_world,
    write_folder_across_ranks,
    write_safetensors_files,
)
from .progress import progress_bar

TORCH_SUFFIXES = (".pt", ".pth", ".torch", ".bin", ".ckpt")


@dataclass
class ConsolidateResult:
    outputs: List[str]
    tensors: int
    nbytes: int
    notes: List[str] = field(default_factory=list)  # what the user should know about the output


def per_rank_note(ckpt: ShardedCheckpoint) -> List[str]:
    """FSDP instances each rank holds whole (own process group of 1, e.g. MoE experts): only rank 0's is written."""
    paths = ckpt.layout.per_rank_instances()
    if not paths or ckpt.world_size == 1:
        return []
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    others = "rank 1's copy is" if ckpt.world_size == 2 else f"ranks 1-{ckpt.world_size - 1}'s copies are"
    return [
        f"{len(paths)} FSDP instance(s) held whole by each rank (no_broadcast_optim_state, e.g. MoE experts): "
        f"{shown}; written from rank 0's copy, as fairscale's consolidate_shard_weights does "
        f"({others} not in the output)"
    ]


def output_format(out: str, max_shard_size: Optional[int], hf: bool = False) -> str:
    """``out``'s format by its name; ``hf``: a Hugging Face config comes with the weights, so a name that is
    no file's (``-o model/``) is a model folder."""
    if max_shard_size is not None:
        return "safetensors-index"
    if out.endswith(".safetensors"):
        return "safetensors"
    if out.endswith(TORCH_SUFFIXES):
        return "torch"
    if hf:
        return "safetensors-index"
    raise CheckpointError(
        f"{out}: cannot tell the format: end it with .safetensors or .pt/.pth/.torch, "
        "or give --max-shard-size for a folder of safetensors files"
    )


def hf_folder_of(source: Source, fmt: str, hf_config: Optional[str]) -> Tuple[Optional[HfConfigDir], List[str]]:
    """The Hugging Face config a folder output is finished with (``--hf-config``, else the one the source
    carries), and a note where a single-file output leaves the source's behind."""
    found = hf_config or source.hf_config_dir()
    if found is None:
        return None, []
    if fmt != "safetensors-index":
        if hf_config is not None:
            raise CheckpointError("--hf-config writes a model folder: name a folder with -o, not a file")
        return None, [
            f"{found}: a Hugging Face config came with the checkpoint; -o FOLDER writes a model folder that "
            "from_pretrained loads (weights, config.json, tokenizer)"
        ]
    return read_hf_dir(found), []


def container_tree(ckpt: ShardedCheckpoint, weights: Dict[str, Fill], optim: Optional[Any]) -> Any:
    """The source framework's own consolidated checkpoint around the full weights."""
    c = ckpt.container
    tree = copy_tree(ckpt.objs[0])
    if len(c.parts) > 1:  # each root's full weights where its shards were, names relative to it
        for spec, sd in zip(c.parts, split_by_part(ckpt, weights)):
            set_path(tree, spec.weights, sd)
    else:
        set_path(tree, c.parts[0].weights, weights)
    if c.kind == "vissl":
        tree["type"] = "consolidated"
        base = get_path(tree, ("classy_state_dict", "base_model"))
        base.pop("meta", None)
        heads = base.get("model", {}).get("heads")
        if isinstance(heads, list):  # VISSL's consolidated form, which its loaders read with .items()
            base["model"]["heads"] = {f"{j}.{k}": v for j, sd in enumerate(heads) for k, v in sd.items()}
    else:
        for spec in c.parts:
            get_path(tree, spec.metadata[:-1]).pop(spec.metadata[-1])
    if c.optimizer is not None:
        if optim is None:
            get_path(tree, c.optimizer[:-1]).pop(c.optimizer[-1])
        else:
            set_path(tree, c.optimizer, optim)
    return with_fills(tree)


def write_file_manifest(output: str, source: Dict[str, Any], command: str, hashes: Optional[Hashes] = None) -> None:
    """``OUT.manifest.json`` beside a single-file output, itself written atomically."""
    manifest = build_manifest(
        os.path.dirname(os.path.abspath(output)), [os.path.basename(output)], source, command, hashes
    )
    with atomic_output(manifest_path(output), is_dir=False, overwrite=True) as tmp:
        write_json(tmp, manifest)


SAFETENSORS_META = {"format": "pt"}  # what transformers' loaders expect


class HfFiles(NamedTuple):
    """A Hugging Face model folder's files beside its weights: ``config.json`` as written, and (name, path) of
    the files copied."""

    config: Dict[str, Any]
    carried: Tuple[Tuple[str, str], ...]


def check_parallel(fmt: str, jobs: int) -> None:
    """``--jobs`` and torchrun split the work by output file: only a folder output has several."""
    if fmt != "safetensors-index" and (jobs > 1 or torchrun_world() is not None):
        how = f"--jobs {jobs}" if jobs > 1 else "torchrun"
        raise CheckpointError(
            f"{how} splits the work by output file, and a single-file output has one: "
            "give --max-shard-size to write a folder of files"
        )


def write_index_folder(
    out: str,
    tensors: Dict[str, Fill],
    max_bytes: int,
    tick: Any,
    source: Dict[str, Any],
    command: str,
    overwrite: bool,
    jobs: int = AUTO,
    hf: Optional[HfFiles] = None,
) -> None:
    """An index-sharded safetensors folder, atomically, with its manifest inside; ``hf``: finished as a
    Hugging Face model folder (``config.json``, tokenizer..., one file named ``model.safetensors`` with no
    index, as ``save_pretrained`` writes).

    ``jobs`` > 1 writes its files in local processes, else threads of this
    one do; under torchrun rank r writes files r, r + world, ... and rank 0
    the index and the manifest.
    Every way gives the same bytes.
    """
    files, index = safetensors_index_plan(tensors, max_bytes, SAFETENSORS_META)
    if hf is not None and len(files) == 1:
        files, index = [(SINGLE_FILE, files[0][1])], None
    names = [name for name, _ in files]

    def finish(folder: str, shares: Sequence[Digests]) -> None:
        written = names + ([write_index_json(folder, index)] if index is not None else [])
        if hf is not None:
            written += write_hf_files(folder, hf.config, hf.carried)
        write_json(
            os.path.join(folder, MANIFEST), build_manifest(folder, written, source, command, None, merged(shares))
        )

    world = torchrun_world()
    if world is not None:
        rank, n = world

        def share(folder: str) -> Digests:  # each rank hashes what it writes: rank 0 reads nothing again
            with Copier() as own, Hashes() as hashed:
                for name, group in files[rank::n]:
                    write_safetensors(os.path.join(folder, name), group, own, None, SAFETENSORS_META, hashed)
                return {name: hashed.digest(os.path.join(folder, name)) for name, _ in files[rank::n]}

        write_folder_across_ranks(out, overwrite, sum(f.nbytes for f in tensors.values()), rank, n, share, finish)
        return
    with atomic_output(out, is_dir=True, overwrite=overwrite) as tmp:
        work = [(group, os.path.join(tmp, name)) for name, group in files]
        finish(tmp, [write_safetensors_files(work, jobs, SAFETENSORS_META, tick)])


def write_full(
    out: str,
    fmt: str,
    tree: Any,
    copier: Copier,
    tick: Any,
    source: Dict[str, Any],
    command: str,
    max_shard_size: Optional[int],
    overwrite: bool,
    trust_pickles: bool,
    hashes: Hashes,
    jobs: int = AUTO,
    hf: Optional[HfFiles] = None,
) -> None:
    """One full state dict, atomically: ``tree`` is any tree for torch, a flat ``{name: Fill}`` for safetensors.

    An index folder carries its manifest inside (its files written by
    threads, ``jobs`` processes or torchrun ranks); a single file gets it from
    :func:`write_file_manifest` once every output is in place. ``hashes``
    hashes the output while it is written.
    """
    if fmt == "safetensors-index":
        size = DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size
        write_index_folder(out, tree, size, tick, source, command, overwrite, jobs, hf)
        return
    with atomic_output(out, is_dir=False, overwrite=overwrite) as tmp:
        if fmt == "torch":
            write_torch(tmp, tree, copier, tick, trust_pickles, hashes)
        else:
            write_safetensors(tmp, tree, copier, tick, SAFETENSORS_META, hashes)
        hashes.settled(tmp)  # its CRCs are written by the hash pass: final from here, fsynced and renamed next
    hashes.moved(tmp, out)


def full_size_bound(fmt: str, tree: Any) -> int:
    """An upper estimate of the bytes a full state dict takes on disk: data, and each format's framing."""
    if fmt == "torch":
        return torch_file_size_bound(tree)
    return sum(f.nbytes for f in tree.values()) + RECORD_OVERHEAD * len(tree) + FILE_OVERHEAD


def optimizer_path(out: str) -> str:
    stem = out[: -len(os.path.splitext(out)[1])] if os.path.splitext(out)[1] else out.rstrip("/")
    return stem + ".optim.pt"


@command
def consolidate(
    src: str,
    out: str,
    *,
    max_shard_size: Optional[int] = None,
    container: bool = False,
    optimizer: bool = False,
    overwrite: bool = False,
    trust_pickles: bool = False,
    progress: bool = True,
    select: Sequence[str] = (),
    strip_prefix: Sequence[str] = (),
    rename: Sequence[str] = (),
    dtype: Optional[str] = None,
    jobs: int = AUTO,
    mp_rules: Sequence[str] = (),
    mp_presets: Sequence[str] = (),
    mp_tolerance: float = DEFAULT_TOLERANCE,
    like: Optional[str] = None,
    fsync: bool = True,
    hf_config: Optional[str] = None,
) -> ConsolidateResult:
    """Write the full state dict of the sharded checkpoint ``src`` to ``out``, streaming (memory stays flat).

    Args:
        src: the shards: a folder, one shard file (its siblings are found) or a VISSL shard_list file;
            or torch FSDP2/FSDP1 per-rank files (verl's folder, or one rank-numbered file per rank).
        out: ``OUT.safetensors``, ``OUT.pt`` (torch.save), or a folder with ``max_shard_size``: a Hugging Face
            model folder where a config comes with the weights (``hf_config``, or verl's ``huggingface/``),
            then with or without ``max_shard_size`` (default 5 GB files).
        max_shard_size: write index-sharded safetensors files of at most this many bytes.
        container: keep the source framework's container around the weights (torch.save output only).
        optimizer: also write the full optimizer state (fairscale's ``gather_full_optim_state_dict``
            format): inside the container, or beside ``out`` as ``OUT.optim.pt``.
        overwrite: replace an existing output that ckptshard wrote (never anything else).
        trust_pickles: unpickle without the weights-only safety net (files you trust only).
        progress: show a progress bar.
        select, strip_prefix, rename: keep tensors whose name starts with a prefix; remove prefixes;
            ``"FROM=TO"`` replacements, in order (see ``ckptshard.plan.transform``).
        dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``: cast floating-point tensors.
        jobs: processes writing the files of a ``max_shard_size`` folder (0: chosen from the plan; under
            torchrun the ranks share them instead).
        mp_rules, mp_presets, mp_tolerance: for several model-parallel parts (metaseq's
            ``model_part-K-shardR``): ``REGEX=DIM[/GROUPS]`` rules and presets (``"metaseq"``) saying which
            tensors tensor parallelism split (see ``ckptshard.plan.model_parallel``); every other tensor must be
            the same in every part, within ``mp_tolerance`` (relative). Without rules, one full file per part.
        like: for FSDP1 LOCAL_STATE_DICT files, the model's full state dict (safetensors, torch.save or an
            index folder): its names, shapes and ties say what each flat parameter holds. For fairscale 0.3
            shards (whose metadata does not record ties): torch.save of the model's ``state_dict()``, from which
            each tied name the shards leave out is restored as the tensor it shares storage with.

        fsync: fsync each output before it is renamed into place (False: as ``cp``, faster, and a
            crash soon after may lose data the manifest vouches for).
        hf_config: a folder holding the model's Hugging Face ``config.json`` (and tokenizer files), for a
            source whose names are the model's: the output folder is finished as ``save_pretrained`` lays it out
            (``docs/huggingface.md``). Default: verl's ``huggingface/`` beside its rank files.

    Returns:
        ``ConsolidateResult``: ``outputs`` (paths), ``tensors`` (count), ``nbytes`` (tensor bytes), ``notes``
        (what the user should know about the output).

    Raises:
        CheckpointError: bad or inconsistent input (a missing or extra shard, shards of different runs,
            metadata that does not describe the data), an output that exists (without ``overwrite``) or
            that ckptshard did not write, too little disk space, an input changed while read. Nothing is
            written. OSError: the system's own failures (disk full, permissions); nothing is left behind.
    """
    renames = parse_renames(rename)
    cast_dtype(dtype)  # a bad --dtype fails before any file is opened
    source = open_source(src, like=like, trust_pickles=trust_pickles)
    fmt = output_format(out, max_shard_size, hf=hf_config is not None or source.hf_config_dir() is not None)
    check_parallel(fmt, jobs)
    if container and fmt != "torch":
        raise CheckpointError("--container needs a torch.save output (.pt/.pth/.torch)")
    if (select or strip_prefix or renames) and (container or optimizer):
        raise CheckpointError(
            "--select/--strip-prefix/--rename write a plain state dict: not with --container or --optimizer"
        )
    rules = rules_from(mp_rules, mp_presets)
    check_tolerance(mp_tolerance)
    hf, notes = hf_folder_of(source, fmt, hf_config)
    req = Request(
        out, fmt, container, optimizer, overwrite, trust_pickles, progress,
        tuple(select), tuple(strip_prefix), tuple(renames), dtype, max_shard_size, jobs, hf,
    )  # fmt: skip
    res = consolidate_source(source, req, rules, mp_tolerance)
    return dataclasses.replace(res, notes=res.notes + notes)


def consolidate_source(
    source: Source, req: Request, rules: Sequence[MpRule] = (), tolerance: float = DEFAULT_TOLERANCE
) -> ConsolidateResult:
    """:func:`consolidate` of an opened source (``convert`` opens it once for both)."""
    if isinstance(source, ModelPartsSource):
        return _consolidate_parts(source, rules, tolerance, req)
    if rules:
        raise CheckpointError(f"{source.path}: --mp-rule/--mp-rules given, but it holds one model part")
    if isinstance(source, FairscaleSource):
        return _consolidate_checkpoint(source.ckpt, source.path, req, source)
    if req.container:
        raise source.refuse("--container", "only fairscale checkpoints have a container to keep")
    return _consolidate_plain(source, req)


@dataclass(frozen=True)
class Request:
    """A consolidate's output and options, whatever the source kind."""

    out: str
    fmt: str
    container: bool
    optimizer: bool
    overwrite: bool
    trust_pickles: bool
    progress: bool
    select: Tuple[str, ...]
    strip_prefix: Tuple[str, ...]
    renames: Tuple[Any, ...]
    dtype: Optional[str]
    max_shard_size: Optional[int]
    jobs: int
    hf: Optional[HfConfigDir] = None  # a folder output finished as a Hugging Face model folder

    def reshaped(self, weights: Dict[str, Fill]) -> Tuple[Dict[str, Fill], List[str]]:
        """The weights to write, and a note for each tied copy a Hugging Face model folder leaves out."""
        weights = transform(weights, self.select, self.strip_prefix, self.renames, cast_dtype(self.dtype))
        return untied(weights, self.hf.config) if self.hf is not None else (weights, [])


def _write(
    req: Request,
    tree: Any,
    beside: Optional[Any],
    total: int,
    source: Dict[str, Any],
    inputs: Sequence[str],
) -> Tuple[List[str], List[str]]:
    """``tree`` to ``req.out`` and ``beside`` (an optimizer state) to ``OUT.optim.pt``, each atomically and with
    its manifest; outputs checked before anything is written. The outputs, and notes on what they hold."""
    hf, notes = None, []
    if req.hf is not None:  # a folder of the weights: finished as a Hugging Face model folder
        config, notes = config_for(req.hf.config, tree)
        hf = HfFiles(config, req.hf.carried)
        inputs = (*inputs, *(p for _, p in req.hf.carried))
    opt_out = optimizer_path(req.out) if beside is not None else None
    run_checked(lambda: check_output(req.out, req.overwrite, tuple(inputs), is_dir=req.fmt == "safetensors-index"))
    if opt_out is not None:
        run_checked(lambda: check_output(opt_out, req.overwrite, tuple(inputs)))
    on_disk = full_size_bound(req.fmt, tree) + (torch_file_size_bound(beside) if beside is not None else 0)
    on_disk += sum(os.path.getsize(p) for _, p in req.hf.carried) if req.hf is not None else 0
    run_checked(lambda: check_space(req.out, on_disk))
    outputs = [req.out]
    lead = leads()  # under torchrun rank 0 reports and writes the single files
    with Copier() as copier, Hashes() as hashes, progress_bar(total, "consolidate", req.progress and lead) as tick:
        how = (source, "consolidate", req.max_shard_size, req.overwrite, req.trust_pickles, hashes, req.jobs)
        write_full(req.out, req.fmt, tree, copier, tick, *how, hf=hf)
        if opt_out is not None and lead:
            write_full(opt_out, "torch", beside, copier, tick, *how[:2], None, *how[3:6])
            outputs.append(opt_out)
        for o in outputs:
            if os.path.isfile(o):
                write_file_manifest(o, source, "consolidate", hashes)
    return outputs, notes


def _consolidate_checkpoint(
    ckpt: ShardedCheckpoint, src: str, req: Request, source: Optional[FairscaleSource] = None
) -> ConsolidateResult:
    """One fairscale checkpoint (one model part; ``source``: opened whole, its ties restored where ``--like``)."""
    weights, notes = req.reshaped(source.full_weights() if source is not None else consolidated_weights(ckpt))
    notes = (source.notes() if source is not None else []) + notes
    optim = None
    if req.optimizer:
        if ckpt.container.optimizer is None:
            raise CheckpointError(f"{src}: --optimizer given but the shards hold no optimizer state")
        optim = consolidated_optimizer(ckpt)
    # Tied tensors count twice: safetensors stores each copy.
    total = sum(f.nbytes for f in weights.values()) + (tree_nbytes(optim) if optim else 0)
    inside = req.container and req.fmt == "torch"
    tree: Any = container_tree(ckpt, weights, optim) if inside else weights
    outputs, written = _write(req, tree, None if inside else optim, total, source_info(ckpt), ckpt.files.paths)
    notes = per_rank_note(ckpt) + notes + written
    if optim is not None and len(optim["param_groups"]) > 1:
        notes.append(
            f"the optimizer has {len(optim['param_groups'])} param groups: each lists its parameters' "
            "global ids, which fairscale's get_shard_from_optim_state_dict (one group only) cannot "
            "read; ckptshard shard --optimizer and load_checkpoint can"
        )
    return ConsolidateResult(outputs, len(weights), total, notes)


def _consolidate_parts(
    source: ModelPartsSource, rules: Sequence[MpRule], tolerance: float, req: Request
) -> ConsolidateResult:
    """K model-parallel parts: joined by ``rules`` into the model at model-parallel size 1, or without rules
    one full file per part (``OUT-model_part-K``)."""
    files, ckpts = source.files, source.ckpts
    if not rules and req.hf is not None:
        raise CheckpointError(
            f"{source.path}: a model part is not the model a Hugging Face config describes: join the parts "
            "with --mp-rules/--mp-rule, or write a file per part (-o OUT.safetensors)"
        )
    if not rules:
        reqs = [dataclasses.replace(req, out=part_output(req.out, k)) for k in range(len(ckpts))]
        for r in reqs:  # every output checked before the first is written
            run_checked(lambda r=r: check_output(r.out, r.overwrite, files.paths, is_dir=r.fmt == "safetensors-index"))
        results = [_consolidate_checkpoint(c, c.files.paths[0], r) for c, r in zip(ckpts, reqs)]
        note = (
            f"{len(ckpts)} model-parallel parts and no --mp-rule: one full state dict per part "
            f"({os.path.basename(reqs[0].out)}, ...); --mp-rules metaseq or --mp-rule REGEX=DIM joins them into one"
        )
        return ConsolidateResult(
            [o for r in results for o in r.outputs],
            sum(r.tensors for r in results),
            sum(r.nbytes for r in results),
            [note] + [n for r in results for n in r.notes],
        )
    if req.container:
        raise CheckpointError(
            "--container with --mp-rule: joining model parts writes a plain state dict (consolidate without "
            "rules keeps each part's container)"
        )
    weights, notes = joined_weights(ckpts, rules, tolerance)
    weights, untie_notes = req.reshaped(weights)
    notes += untie_notes
    optim = None
    if req.optimizer:
        optim, optim_notes = joined_optimizer(ckpts, rules, tolerance)
        notes += optim_notes
    total = sum(f.nbytes for f in weights.values()) + (tree_nbytes(optim) if optim else 0)
    written, written_notes = _write(req, weights, optim, total, source.describe(), files.paths)
    return ConsolidateResult(written, len(weights), total, notes + written_notes)


def _consolidate_plain(source: Source, req: Request) -> ConsolidateResult:
    """Sources whose full state the family reads as a whole (torch FSDP per-rank files, DCP folders): the
    model's full state dict; ``optimizer``: the full optimizer state beside it, as the family's own full
    format keys it (torch's ``get_optimizer_state_dict(..., full_state_dict=True)``: by name)."""
    weights, notes = req.reshaped(source.full_weights())
    optim = source.full_optimizer() if req.optimizer else None
    if req.optimizer and optim is None:
        raise CheckpointError(f"{source.path}: --optimizer given, but {source.family} hold no optimizer state")
    total = sum(f.nbytes for f in weights.values()) + (tree_nbytes(optim) if optim else 0)
    if isinstance(source, TorchRanksSource):  # read without torch: written without it too
        req = dataclasses.replace(req, trust_pickles=False)
    outputs, written = _write(req, weights, optim, total, source.describe(), source.inputs)
    return ConsolidateResult(outputs, len(weights), total, source.notes() + notes + written)

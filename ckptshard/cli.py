"""The ``ckptshard`` command line: thin wrappers over the library."""

from __future__ import annotations

import json
import re
import signal
import sys
import warnings
from typing import Any, Callable, Optional, Tuple

import click

from .errors import CheckpointError
from .version import __version__


class BadInput(click.ClickException):
    exit_code = 2


def _size(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.I)
    if not m:
        raise BadInput(f"--max-shard-size: cannot read {text!r} (try 5GB, 500MiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    return int(float(m.group(1)) * mult)


def _leads() -> bool:
    """This process reports: not a torchrun rank other than 0 (the command has imported parallel already)."""
    from .execute.parallel import leads

    return leads()


def _sigterm(signum: int, frame: Any) -> None:
    # Raise through the stack so atomic outputs remove their temporaries.
    raise SystemExit(128 + signum)


def _one_line_warning(
    message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Optional[str] = None
) -> None:
    # A user of the command needs the message, not the library line that raised it.
    click.echo(f"warning: {message}", err=True)


def _run(ctx: click.Context, fn: Callable[[], Any]) -> Any:
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        return fn()
    except CheckpointError as e:
        if ctx.obj.get("debug"):
            import traceback  # on this path only: every command would pay its import

            traceback.print_exc()
        raise BadInput(str(e)) from None
    except OSError as e:  # the machine's answer (disk full, permissions...), not a bug: one line, as for bad input
        if ctx.obj.get("debug"):
            import traceback

            traceback.print_exc()
        raise BadInput(_os_error(e)) from None
    except KeyboardInterrupt:
        click.echo("interrupted; no output was written", err=True)
        sys.exit(130)


def _os_error(e: OSError) -> str:
    import errno

    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{where}{what}: the disk filled up while writing; nothing was written (temporaries removed)"
    return f"{where}{what}; nothing was written"


common_trust = click.option(
    "--trust-pickles",
    is_flag=True,
    help="Unpickle shards without the weights-only safety net. Only for files you trust: they can run code.",
)
common_quiet = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")


class PathOrUrl(click.Path):
    """A local path (checked as click.Path checks it) or a URL of object storage (s3://, gs://, az://...),
    which the command stages (execute/staging.py)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from .osio.remote import is_url, local_path

        return value if is_url(value) else super().convert(local_path(value), param, ctx)


def _storage_options(ctx: click.Context, param: Any, value: Tuple[str, ...]) -> None:
    from .execute.staging import STORAGE_OPTIONS
    from .osio.remote import parse_storage_options

    try:
        STORAGE_OPTIONS.set(parse_storage_options(value))
    except CheckpointError as e:
        raise click.BadParameter(str(e)) from None


def common_storage(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--storage-option",
        multiple=True,
        metavar="KEY=VALUE",
        expose_value=False,
        callback=_storage_options,
        help="For s3://, gs://, az://... paths: an option of the fsspec filesystem (repeatable; a JSON value is "
        "read as JSON), e.g. endpoint_url=http://127.0.0.1:9000, anon=true. Credentials come as each store's "
        "tools take them (AWS_* variables and files, AWS_ENDPOINT_URL; gcloud; Azure's).",
    )(f)


common_overwrite = click.option("--overwrite", is_flag=True, help="Replace an existing output.")


# --jobs 0: chosen from the plan (execute/parallel.py: auto_processes).
AUTO_JOBS = (
    "0 (the default) chooses: up to one process per core, two files each, where there are 4 files or "
    "more, copied in runs under 4 MiB on average (optimizer state, many FSDP instances), 1 GiB or "
    "5,000 runs in all; else 1. "
)

common_no_fsync = click.option(
    "--no-fsync",
    is_flag=True,
    help="Do not fsync outputs (as cp does): faster, and still renamed into place only when complete, "
    "but a crash or power loss soon after may lose data the manifest vouches for.",
)


def reshape_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--select, --strip-prefix, --rename: the naming options of every full-state output."""
    f = click.option(
        "--rename", multiple=True, metavar="FROM=TO", help="Replace FROM by TO in names, in order (repeatable)."
    )(f)
    f = click.option(
        "--strip-prefix", multiple=True, help="Remove this prefix from names (repeatable; the first that matches)."
    )(f)
    return click.option(
        "--select",
        multiple=True,
        help="Keep only tensors whose name starts with this prefix, e.g. 'trunk.' (repeatable).",
    )(f)


def mp_rule_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--mp-rule, --mp-rules and --mp-tolerance: how model-parallel parts are joined (consolidate, reshard)."""
    for option in reversed(
        [
            click.option(
                "--mp-rule",
                "mp_rules",
                multiple=True,
                metavar="REGEX=DIM[/G]",
                help="Model-parallel parts (metaseq's model_part-K-shardR): join tensors whose name matches "
                "REGEX along DIM (0: column-parallel layers, vocab-parallel embeddings; 1: row-parallel "
                "weights); /G: each part holds G blocks along DIM (a fused qkv: 0/3). First match wins; "
                "repeatable. Every other tensor must be the same in every part.",
            ),
            click.option(
                "--mp-rules",
                "mp_presets",
                multiple=True,
                type=click.Choice(["metaseq"]),
                help="A preset rule set: metaseq (OPT's names; its stitch_fsdp_ckpt's split).",
            ),
            click.option(
                "--mp-tolerance",
                default=1e-5,
                show_default=True,
                type=float,
                help="Tensors no rule splits may differ between parts by this much (relative to their largest "
                "value): taken from part 0 with a note; beyond it, an error.",
            ),
        ]
    ):
        f = option(f)
    return f


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ckptshard")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Consolidate and reshard sharded FSDP checkpoints: fairscale's (fairseq, metaseq, VISSL) and torch
    FSDP2/FSDP1 per-rank files (verl's layout).

    SRC is a folder of shards, one shard file, or a VISSL shard_list file; or a folder of torch FSDP
    per-rank files (model_world_size_W_rank_R.pt, ...).
    Inputs are never modified; outputs appear whole or not at all.
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if not debug:
        warnings.showwarning = _one_line_warning


@main.result_callback()
def _done(*_: Any, **__: Any) -> None:
    from .execute.parallel import leave_torchrun

    leave_torchrun()  # a torchrun rank that did its share exits 0, whatever gloo's teardown does


@main.command()
@click.argument("src", type=PathOrUrl(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@common_trust
@common_storage
@click.pass_context
def inspect(ctx: click.Context, src: str, as_json: bool, trust_pickles: bool) -> None:
    """Show what a sharded checkpoint holds: container, world size, FSDP
    instances, parameters, buffers, padding, optimizer state; for a DCP
    folder, every entry with its dtype, shape and chunks. Reads no tensor data."""
    from .execute.inspect import format_summary, inspect_checkpoint

    summary = _run(ctx, lambda: inspect_checkpoint(src, trust_pickles))
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


@main.command()
@click.argument("src", type=PathOrUrl(exists=True))
@click.option(
    "-o",
    "--output",
    "out",
    required=True,
    type=PathOrUrl(),
    help="OUT.safetensors, OUT.pt (torch.save), or a folder with --max-shard-size; a Hugging Face model folder "
    "(from_pretrained loads it) where a config comes with the weights: --hf-config, or verl's huggingface/.",
)
@click.option(
    "--max-shard-size",
    default=None,
    help="Write a folder of index-sharded safetensors files of at most this size (e.g. 5GB; a model folder's default).",
)
@click.option(
    "--hf-config",
    default=None,
    type=PathOrUrl(exists=True, file_okay=False),
    help="A folder holding the model's Hugging Face config.json (and tokenizer files), for weights named as the "
    "model names them: the output folder gets config.json (its dtype the one written), the tokenizer and "
    "generation config, tied copies left out, as save_pretrained writes it. Default: verl's huggingface/.",
)
@click.option(
    "--container",
    is_flag=True,
    help="Keep the source framework's container (VISSL 'consolidated', fairseq/metaseq 'model' + other keys).",
)
@click.option(
    "--optimizer",
    is_flag=True,
    help="Also write the full optimizer state (fairscale's gather_full_optim_state_dict format): inside the "
    "container, or beside OUT as OUT.optim.pt.",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "fp16", "bf16"]),
    default=None,
    help="Cast floating-point tensors (integers such as num_batches_tracked are kept).",
)
@reshape_options
@mp_rule_options
@click.option(
    "--like",
    "like",
    default=None,
    type=PathOrUrl(exists=True),
    help="For FSDP1 LOCAL_STATE_DICT files (flat parameters): the model's full state dict (its safetensors, "
    "a torch.save file or an index folder), whose names, shapes and ties say what the flat parameters hold. "
    "For fairscale 0.3 shards, whose metadata does not record tied parameters: torch.save of the model's "
    "state_dict(), whose tied names share storage; each tied name the shards leave out is written again.",
)
@click.option(
    "--jobs",
    "-j",
    default=0,
    show_default=True,
    type=click.IntRange(0, 256),
    help="With --max-shard-size: write the folder's files in this many local processes (same bytes). "
    "With 1, one process writes them in one thread per file (at most 4). "
    + AUTO_JOBS
    + "Under torchrun, ranks share the files instead.",
)
@common_no_fsync
@common_overwrite
@common_trust
@common_quiet
@common_storage
@click.pass_context
def consolidate(
    ctx: click.Context,
    src: str,
    out: str,
    max_shard_size: Optional[str],
    hf_config: Optional[str],
    container: bool,
    optimizer: bool,
    dtype: Optional[str],
    select: tuple,
    strip_prefix: tuple,
    rename: tuple,
    mp_rules: tuple,
    mp_presets: tuple,
    mp_tolerance: float,
    like: Optional[str],
    jobs: int,
    overwrite: bool,
    trust_pickles: bool,
    quiet: bool,
    no_fsync: bool,
) -> None:
    """Write one full state dict from the shards in SRC, streaming: memory stays
    flat whatever the model's size. Several model-parallel parts are joined
    into one model by --mp-rule/--mp-rules, or written one file per part."""
    from .execute.consolidate import consolidate as run

    res = _run(
        ctx,
        lambda: run(
            src,
            out,
            max_shard_size=_size(max_shard_size),
            container=container,
            optimizer=optimizer,
            overwrite=overwrite,
            trust_pickles=trust_pickles,
            progress=not quiet,
            select=select,
            strip_prefix=strip_prefix,
            rename=rename,
            dtype=dtype,
            jobs=jobs,
            fsync=not no_fsync,
            mp_rules=mp_rules,
            mp_presets=mp_presets,
            mp_tolerance=mp_tolerance,
            like=like,
            hf_config=hf_config,
        ),
    )
    if _leads():
        click.echo(f"wrote {', '.join(res.outputs)}: {res.tensors} tensors, {res.nbytes:,} bytes")
        for note in res.notes:
            click.echo(f"note: {note}", err=True)


@main.command()
@click.argument("src", type=PathOrUrl(exists=True))
@click.option("--world-size", "-n", required=True, type=int, help="Number of ranks to shard for.")
@click.option("-o", "--output", "dst", required=True, type=PathOrUrl(), help="Folder to create for the new shards.")
@click.option(
    "--jobs",
    "-j",
    default=0,
    show_default=True,
    type=click.IntRange(0, 256),
    help="Write output files in this many local processes (same bytes). With 1, one process writes them in "
    "one thread per file (at most 4). " + AUTO_JOBS + "Under torchrun, ranks share the files instead.",
)
@click.option(
    "--no-optimizer",
    is_flag=True,
    help="Leave the optimizer state out: a model-only checkpoint (weights, buffers, the rest of the container).",
)
@click.option(
    "--like",
    "like",
    default=None,
    type=PathOrUrl(exists=True),
    help="For FSDP1 LOCAL_STATE_DICT files (flat parameters): the model's full state dict, as for consolidate.",
)
@click.option(
    "--model-parallel",
    default=None,
    type=int,
    help="Model-parallel parts to write (metaseq's model_part-K-shardR; default: as many as SRC has). Another "
    "number joins the parts and cuts them again by --mp-rule/--mp-rules.",
)
@click.option(
    "--shard-group",
    default=None,
    type=click.IntRange(1),
    help="torch FSDP2 files: the ranks each parameter is sharded over. Below --world-size writes HSDP's files "
    "(world-size / shard-group replicas on a 2-D mesh, verl's fsdp_size); equal to it, plain FSDP2. "
    "Default: an HSDP source's own group size, else --world-size.",
)
@click.option(
    "--mesh-dim-names",
    default=None,
    help="torch FSDP2 files: the new device mesh's dimension names, comma-separated, as your training code names "
    "them (verl: fsdp, or ddp,fsdp for HSDP); torch loads a DTensor only into a parameter on the same mesh. "
    "Default: the source's.",
)
@click.option(
    "--placement",
    default=None,
    type=click.Choice(["dim0", "divisible", "keep"]),
    help="torch FSDP2 files: the dimension each parameter is sharded on at --world-size, as your training code's "
    "fully_shard picks it: dim0 (torch's default, Shard(0)), divisible (verl's shard_placement_fn: the first "
    "dimension the shard group divides), keep (each parameter's dimension in SRC). Default: the rule SRC's "
    "placements fit; refused where they fit both and the two differ at --world-size.",
)
@mp_rule_options
@common_no_fsync
@common_overwrite
@common_trust
@common_quiet
@common_storage
@click.pass_context
def reshard(
    ctx: click.Context,
    src: str,
    world_size: int,
    dst: str,
    jobs: int,
    no_optimizer: bool,
    like: Optional[str],
    model_parallel: Optional[int],
    shard_group: Optional[int],
    mesh_dim_names: Optional[str],
    placement: Optional[str],
    mp_rules: tuple,
    mp_presets: tuple,
    mp_tolerance: float,
    overwrite: bool,
    trust_pickles: bool,
    quiet: bool,
    no_fsync: bool,
) -> None:
    """Reshard SRC to --world-size ranks: weights, metadata and optimizer state,
    exactly as FSDP at that world size would have saved them, in the same
    container and file naming. Model-parallel parts are resharded each, or
    re-cut to --model-parallel parts by --mp-rule/--mp-rules."""
    from .execute.reshard import reshard as run

    res = _run(
        ctx,
        lambda: run(
            src,
            dst,
            world_size,
            overwrite=overwrite,
            trust_pickles=trust_pickles,
            progress=not quiet,
            jobs=jobs,
            fsync=not no_fsync,
            optimizer=not no_optimizer,
            like=like,
            model_parallel=model_parallel,
            mp_rules=mp_rules,
            mp_presets=mp_presets,
            mp_tolerance=mp_tolerance,
            shard_group=shard_group,
            mesh_dim_names=mesh_dim_names.split(",") if mesh_dim_names is not None else None,
            placement=placement,
        ),
    )
    if _leads():
        click.echo(f"wrote {len(res.files)} files to {res.folder}: {res.nbytes:,} bytes")
        for note in res.notes:
            click.echo(f"note: {note}", err=True)


@main.command()
@click.argument("full", type=PathOrUrl(exists=True))
@click.option(
    "--like",
    required=True,
    type=PathOrUrl(exists=True),
    help="A sharded checkpoint whose FSDP wrapping (instances, flattening, order) and container to follow.",
)
@click.option("--world-size", "-n", required=True, type=int, help="Number of ranks to shard for.")
@click.option("-o", "--output", "dst", required=True, type=PathOrUrl(), help="Folder to create for the shards.")
@click.option(
    "--optimizer",
    "optim",
    type=PathOrUrl(exists=True),
    default=None,
    help="A full optimizer state (from consolidate --optimizer, or gather_full_optim_state_dict) to shard too.",
)
@common_no_fsync
@common_overwrite
@common_trust
@common_quiet
@common_storage
@click.pass_context
def shard(
    ctx: click.Context,
    full: str,
    like: str,
    world_size: int,
    dst: str,
    optim: Optional[str],
    overwrite: bool,
    trust_pickles: bool,
    quiet: bool,
    no_fsync: bool,
) -> None:
    """Shard a full state dict FULL (.pt, .safetensors, or an index folder) for
    --world-size ranks, wrapped as the checkpoint --like is. Names and shapes
    must match its plan exactly; mismatches are listed and nothing is written."""
    from .execute.reshard import shard as run

    res = _run(
        ctx,
        lambda: run(
            full,
            like,
            dst,
            world_size,
            optimizer=optim,
            overwrite=overwrite,
            trust_pickles=trust_pickles,
            progress=not quiet,
            fsync=not no_fsync,
        ),
    )
    click.echo(f"wrote {len(res.files)} files to {res.folder}: {res.nbytes:,} bytes")
    for note in res.notes:
        click.echo(f"note: {note}", err=True)


@main.command()
@click.argument("src", type=PathOrUrl(exists=True))
@click.option(
    "--to",
    "to",
    required=True,
    type=click.Choice(["dcp", "torch", "safetensors", "fairscale"]),
    help="dcp: a torch.distributed.checkpoint folder (FSDP2 loads it at any world size); torch/safetensors: "
    "one full state dict; fairscale: N shards (with --world-size, and --like for a DCP source).",
)
@click.option(
    "-o",
    "--output",
    "out",
    required=True,
    type=PathOrUrl(),
    help="Folder (dcp, fairscale, or safetensors with --max-shard-size) or file (.pt, .safetensors).",
)
@click.option(
    "--like",
    type=PathOrUrl(exists=True),
    default=None,
    help="DCP -> fairscale: the fairscale checkpoint whose FSDP wrapping, container and naming to follow. "
    "FSDP1 LOCAL_STATE_DICT files -> dcp: the model's full state dict (as consolidate --like).",
)
@click.option("--world-size", "-n", type=int, default=None, help="--to fairscale: number of ranks.")
@click.option(
    "--no-optimizer", is_flag=True, help="Leave optimizer state out (it is converted by default where present)."
)
@click.option(
    "--max-shard-size",
    default=None,
    help="safetensors: a folder of index-sharded files of at most this size (e.g. 5GB).",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "fp16", "bf16"]),
    default=None,
    help="Cast floating-point weights (integers such as num_batches_tracked are kept; optimizer state is not cast).",
)
@reshape_options
@click.option(
    "--jobs",
    "-j",
    default=0,
    show_default=True,
    type=click.IntRange(0, 256),
    help="--to dcp, fairscale, or safetensors with --max-shard-size: write the output's files in this many "
    "local processes (same bytes). With 1, one process writes them in one thread per file (at most 4). "
    + AUTO_JOBS
    + "Under torchrun, ranks share the files instead.",
)
@common_no_fsync
@common_overwrite
@common_trust
@common_quiet
@common_storage
@click.pass_context
def convert(
    ctx: click.Context,
    src: str,
    to: str,
    out: str,
    like: Optional[str],
    world_size: Optional[int],
    no_optimizer: bool,
    max_shard_size: Optional[str],
    dtype: Optional[str],
    select: tuple,
    strip_prefix: tuple,
    rename: tuple,
    jobs: int,
    overwrite: bool,
    trust_pickles: bool,
    quiet: bool,
    no_fsync: bool,
) -> None:
    """Convert SRC (fairscale shards, or a DCP checkpoint folder) to --to.

    \b
    fairscale -> dcp: dcp.load + set_model_state_dict/set_optimizer_state_dict
                      in torch FSDP2 at any world size; keys "model", "optim",
                      "extra" (the container's other keys)
    dcp -> torch:     the whole nested state dict (as format_utils.dcp_to_torch_save)
    dcp -> safetensors, dcp -> fairscale --like SRC --world-size N
    Streaming: no tensor is gathered whole in memory.
    """
    from .execute.convert import convert as run

    res = _run(
        ctx,
        lambda: run(
            src,
            out,
            to,
            like=like,
            world_size=world_size,
            optimizer=not no_optimizer,
            max_shard_size=_size(max_shard_size),
            overwrite=overwrite,
            trust_pickles=trust_pickles,
            progress=not quiet,
            select=select,
            strip_prefix=strip_prefix,
            rename=rename,
            dtype=dtype,
            jobs=jobs,
            fsync=not no_fsync,
        ),
    )
    if _leads():
        click.echo(f"wrote {', '.join(res.outputs)}: {res.tensors} tensors, {res.nbytes:,} bytes")
        for note in res.notes:
            click.echo(f"note: {note}", err=True)


@main.command()
@click.argument("path", type=PathOrUrl(exists=True))
@common_storage
@click.pass_context
def verify(ctx: click.Context, path: str) -> None:
    """Re-check an output of ckptshard (a folder of shards, or a consolidated
    file) against its manifest (sizes, XXH3-128 checksums, every file listed) and its own metadata.
    Exits 2 on any difference."""
    from .execute.verify import verify as run

    problems = _run(ctx, lambda: run(path))
    if problems:
        raise BadInput(f"{path}: " + "; ".join(problems))
    click.echo(f"{path}: ok")


@main.command("verify-resume")
@click.option(
    "--recipe",
    default=None,
    metavar="SPEC",
    help="Your model, wrapping, optimizer and data: pkg.module:NAME or path/to/file.py:NAME (docs/recipes.md). "
    "Default: the built-in VISSL-like model, and torch FSDP2 rows.",
)
@click.option(
    "--from",
    "from_checkpoint",
    type=click.Path(exists=True),
    default=None,
    help="Start from this sharded checkpoint (the recipe's) instead of step 0: resumed as is at its world "
    "size, and resharded/consolidated and resumed at each target; needs --recipe.",
)
@click.option("--steps", default=6, show_default=True, help="Training steps (with --from: steps after the checkpoint).")
@click.option(
    "--ckpt-step", default=3, show_default=True, help="Step after which the checkpoint is taken and resumed from."
)
@click.option("--scenario", "names", multiple=True, help="Run only scenarios whose name contains this (repeatable).")
@click.option(
    "--reshard",
    "extra",
    multiple=True,
    metavar="M->N",
    help="Add a scenario: train at M ranks (with --from: the checkpoint's), reshard, resume at N (repeatable).",
)
@click.option(
    "--container",
    type=click.Choice(["fairseq", "metaseq", "vissl"]),
    default=None,
    help="Files fairscale runs save and resume from (default: the recipe's, else fairseq).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="cpu: gloo with the CPU compat layer; cuda: NCCL, one GPU per rank, no compat layer.",
)
@click.option(
    "--work",
    type=click.Path(),
    default=None,
    help="Folder for the runs' checkpoints (default: a temporary one, removed).",
)
@click.option(
    "--step-timeout",
    type=float,
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="Stop every rank of a run in which no rank finishes a step for this long (start-up included).",
)
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON (per-step losses included).")
@common_trust
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a PNG of the per-step losses and their relative differences (needs matplotlib).",
)
@click.pass_context
def verify_resume(
    ctx: click.Context,
    recipe: Optional[str],
    from_checkpoint: Optional[str],
    steps: int,
    ckpt_step: int,
    names: tuple,
    extra: tuple,
    container: Optional[str],
    device: str,
    work: Optional[str],
    step_timeout: float,
    as_json: bool,
    trust_pickles: bool,
    plot: Optional[str],
) -> None:
    """Prove that resuming works for your model: real multi-process FSDP
    training of a recipe, uninterrupted vs stopped, converted by ckptshard
    (local shards, reshard, consolidate and load before/after wrapping) and
    resumed. Weights, optimizer state, LR scheduler, non-persistent buffers
    and per-step losses are compared: same world size bit-exact, other world
    sizes within the recipe's tolerance (1e-5 relative). Exits 1 on any
    unexpected result, 2 on a bad recipe or bad arguments."""
    from .harness.verify_resume import (
        DEFAULT_SCENARIOS,
        format_table,
        recipe_scenarios,
        reshard_scenario,
        results_json,
    )
    from .harness.verify_resume import verify_resume as run

    if from_checkpoint is not None and recipe is None:
        raise BadInput("--from needs --recipe: the model and wrapping that saved the checkpoint")
    added = _run(ctx, lambda: [reshard_scenario(s) for s in extra])
    if recipe is None:
        base = list(DEFAULT_SCENARIOS)
    else:
        from .harness.verify_resume import checkpoint_world_size

        ws = _run(ctx, lambda: checkpoint_world_size(from_checkpoint, trust_pickles)) if from_checkpoint else 2
        base = list(recipe_scenarios(ws))
    chosen = [s for s in base if not (names or added) or any(n in s.name for n in names)]
    chosen += [s for s in added if all(s.name != c.name for c in chosen)]
    if not chosen:
        raise BadInput(f"no scenario matches {list(names)}")
    if device == "cuda":
        import torch

        need = max(max(s.train_ws, s.resume_ws) for s in chosen)
        if torch.cuda.device_count() < need:
            raise BadInput(f"--device cuda needs {need} GPUs, found {torch.cuda.device_count()}")
    if plot is not None:
        from .harness.plot import check_plotting

        _run(ctx, check_plotting)
    results = _run(
        ctx,
        lambda: run(
            recipe,
            chosen,
            steps=steps,
            ckpt_step=ckpt_step,
            device=device,
            container=container,
            from_checkpoint=from_checkpoint,
            work=work,
            trust_pickles=trust_pickles,
            step_timeout=step_timeout,
        ),
    )
    click.echo(json.dumps(results_json(results), indent=2) if as_json else format_table(results))
    if plot is not None:
        from .harness.plot import plot_results

        _run(ctx, lambda: plot_results(results, plot))
        click.echo(f"plot: {plot}", err=True)
    if not all(r.ok for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

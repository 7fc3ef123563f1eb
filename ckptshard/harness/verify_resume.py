"""Scenarios: train a recipe uninterrupted, or stop, convert and resume; then compare.

Every rank draws the same global batch of a step whatever the world size
(the recipe's rule, checked before any run), and every step starts from its
own seed. Same world size must be bit-exact; across world sizes the gradient
reduction order differs, so weights and losses must agree to the recipe's
tolerance (relative) with learning rate, step and every other non-tensor
value exactly equal.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import CheckpointError
from ..execute.consolidate import consolidate
from ..execute.reshard import reshard
from ..fsdp.launch import run_world
from .compare import Diff, compare_checkpoints, compare_local, compare_losses, compare_state
from .frameworks import local_files
from .recipe import CONTAINERS, RecipeRef, check_global_batch, recipe_ref
from .worker import recipe_worker

TOLERANCE = 1e-5
BUILTIN = "ckptshard.recipes.vissl_like"
FSDP2_BUILTIN = "ckptshard.recipes.verl_fsdp2:RECIPE"
VIAS = ("local", "reshard", "consolidated-before", "consolidated-after", "resave")


@dataclass(frozen=True)
class Scenario:
    name: str
    train_ws: int
    resume_ws: int
    via: str  # one of VIAS
    optimizer: bool = True
    expect_mismatch: bool = False
    recipe: Optional[str] = None  # a recipe spec; None: the recipe the run was given

    @property
    def exact(self) -> bool:
        return self.train_ws == self.resume_ws


DEFAULT_SCENARIOS: Tuple[Scenario, ...] = (
    Scenario("same world size, local shards", 2, 2, "local"),
    Scenario("reshard 2->4", 2, 4, "reshard"),
    Scenario("reshard 4->2", 4, 2, "reshard"),
    Scenario("reshard 2->3", 2, 3, "reshard"),
    Scenario("reshard 3->1", 3, 1, "reshard"),
    Scenario("consolidated, loaded before head wrapping", 2, 2, "consolidated-before"),
    Scenario("consolidated, loaded after head wrapping", 2, 2, "consolidated-after"),
    Scenario("mixed precision, fp32 prototypes", 2, 2, "local", recipe=f"{BUILTIN}:MIXED"),
    Scenario("frozen trunk (not in the optimizer), reshard 2->3", 2, 3, "reshard", recipe=f"{BUILTIN}:FROZEN"),
    Scenario("two param groups, head listed first, reshard 2->3", 2, 3, "reshard", recipe=f"{BUILTIN}:GROUPS"),
    Scenario("negative control: no optimizer state", 2, 2, "local", optimizer=False, expect_mismatch=True),
    Scenario("load and re-save, no step", 2, 2, "resave"),
    Scenario("torch FSDP2 (verl files), same world size", 2, 2, "local", recipe=FSDP2_BUILTIN),
    Scenario("torch FSDP2 (verl files), reshard 2->3", 2, 3, "reshard", recipe=FSDP2_BUILTIN),
    Scenario(
        "FSDP2 negative control: no optimizer state",
        2,
        2,
        "local",
        optimizer=False,
        expect_mismatch=True,
        recipe=FSDP2_BUILTIN,
    ),
)


def recipe_scenarios(train_ws: int = 2, resume: Sequence[int] = ()) -> Tuple[Scenario, ...]:
    """The scenarios for one recipe trained (or checkpointed) at ``train_ws``: resumed as is, resharded to
    each of ``resume`` (default: one more rank, and half as many), consolidated and loaded before or after
    wrapping, the negative control, and load-and-re-save."""
    targets = list(resume) or [train_ws + 1] + ([max(1, train_ws // 2)] if train_ws > 1 else [])
    m = train_ws
    return (
        Scenario("same world size, local shards", m, m, "local"),
        *(Scenario(f"reshard {m}->{n}", m, n, "reshard") for n in targets if n != m),
        Scenario("consolidated, loaded before wrapping", m, m, "consolidated-before"),
        Scenario("consolidated, loaded after wrapping", m, m, "consolidated-after"),
        Scenario("negative control: no optimizer state", m, m, "local", optimizer=False, expect_mismatch=True),
        Scenario("load and re-save, no step", m, m, "resave"),
    )


@dataclass
class Result:
    scenario: str
    world_sizes: str
    steps: str
    max_abs: float
    max_rel: float
    matched: bool
    expected_match: bool
    problems: List[str]
    recipe: str = ""
    applicable: bool = True
    seconds: float = 0.0
    first_step: int = 0  # the step the resumed run starts at: its first loss is step first_step + 1's
    reference_losses: List[float] = field(default_factory=list)  # the uninterrupted run's, from its first step
    resumed_losses: List[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.applicable or self.matched == self.expected_match

    @property
    def verdict(self) -> str:
        if not self.applicable:
            return "not applicable"
        if self.matched:
            return "match" if self.expected_match else "MATCH (expected a mismatch)"
        return "mismatch (expected)" if not self.expected_match else "MISMATCH"


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s).strip("-")


class _Recipes:
    """The recipes of a run by spec (None: the main one), resolved once: how ranks get them, the objects."""

    def __init__(self, main: Union[str, Any]) -> None:
        self.main = main
        self._by: Dict[Optional[str], Tuple[RecipeRef, Any]] = {}

    def get(self, spec: Optional[str]) -> Tuple[RecipeRef, Any]:
        if spec not in self._by:
            self._by[spec] = recipe_ref(self.main if spec is None else spec)
        return self._by[spec]


STEP_TIMEOUT = 300.0  # seconds a run may go without any rank finishing a step (start-up included)


def _spawn(world: int, job: Dict[str, Any], device: str) -> None:
    """The recipe on ``world`` ranks; a rule the recipe broke, or a step that never ends, comes back as one
    line."""
    for stale in glob.glob(job["errors"] + ".rank*"):
        os.remove(stale)
    timeout = job["step_timeout"]
    try:
        backend = "nccl" if device == "cuda" else "gloo"
        run_world(recipe_worker, world, job, backend=backend, heartbeat=job["beat"], idle_timeout=timeout)
    except TimeoutError:
        raise CheckpointError(
            f"no rank finished a step in {timeout:g} s (a recipe's batch() or loss() that never returns?); "
            "every rank was stopped: raise --step-timeout if a step really takes that long"
        ) from None
    except Exception:
        found = sorted(glob.glob(job["errors"] + ".rank*"))
        if found:
            with open(found[0]) as f:
                raise CheckpointError(f.read().strip()) from None
        raise


def checkpoint_world_size(path: str, trust_pickles: bool = False) -> int:
    """The world size that saved a checkpoint verify-resume starts from (fairscale shards or torch FSDP files)."""
    from ..sources.fairscale import FairscaleSource
    from ..sources.probe import open_source
    from ..sources.torch_ranks import TorchRanksSource

    source = open_source(path, trust_pickles=trust_pickles)
    if not isinstance(source, (FairscaleSource, TorchRanksSource)) or source.world_size is None:
        raise source.refuse("verify-resume --from", "training resumes from fairscale shards or torch FSDP files")
    return source.world_size


def _no_fsdp2() -> Optional[str]:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.6+)"
    return None


def not_applicable(sc: Scenario, recipe: Any) -> List[str]:
    """Why a scenario cannot run here (a row marked not applicable), or nothing."""
    if sc.via.startswith("consolidated") and not getattr(recipe, "heads", ()):
        return ["the recipe names no heads"]
    missing = _no_fsdp2() if sc.recipe == FSDP2_BUILTIN else None
    return [missing] if missing else []


def run_scenarios(
    work: str,
    scenarios: Optional[Sequence[Scenario]] = None,
    steps: int = 6,
    ckpt_step: int = 3,
    seed: int = 0,
    device: str = "cpu",
    container: Optional[str] = None,
    recipe: Union[str, Any, None] = None,
    from_checkpoint: Optional[str] = None,
    trust_pickles: bool = False,
    step_timeout: float = STEP_TIMEOUT,
) -> List[Result]:
    """Run ``scenarios`` (see :func:`verify_resume`) with ``work`` as the folder for every run's files."""
    if from_checkpoint is None and not 0 < ckpt_step < steps:
        raise CheckpointError(f"--ckpt-step must be between 1 and --steps - 1, got {ckpt_step} of {steps}")
    if from_checkpoint is not None and steps < 1:
        raise CheckpointError(f"--steps must be at least 1, got {steps}")
    if container is not None and container not in CONTAINERS:
        raise CheckpointError(f"--container {container!r}: one of {', '.join(CONTAINERS)}")
    recipes = _Recipes(recipe if recipe is not None else f"{BUILTIN}:RECIPE")
    source_ws = None
    if from_checkpoint is not None:
        source_ws = checkpoint_world_size(from_checkpoint, trust_pickles)
    if scenarios is None:
        scenarios = DEFAULT_SCENARIOS if recipe is None and source_ws is None else recipe_scenarios(source_ws or 2)
    for sc in scenarios:
        if sc.via not in VIAS:
            raise CheckpointError(f"scenario {sc.name!r}: via {sc.via!r}, not one of {', '.join(VIAS)}")
        if source_ws is not None and sc.train_ws != source_ws:
            raise CheckpointError(
                f"scenario {sc.name!r} starts at {sc.train_ws} ranks; {from_checkpoint} was saved by {source_ws}"
            )
    world_sizes: Dict[Optional[str], set] = {}
    for sc in scenarios:
        world_sizes.setdefault(sc.recipe, set()).update((sc.train_ws, sc.resume_ws))
    for spec, sizes in world_sizes.items():
        ref, obj = recipes.get(spec)
        check_global_batch(obj, ref.label, sorted(sizes))
    os.makedirs(work, exist_ok=True)
    if not step_timeout > 0:
        raise CheckpointError(f"--step-timeout must be a number of seconds above 0, got {step_timeout}")
    run = _Run(
        work, recipes, steps, ckpt_step, seed, device, container, from_checkpoint, trust_pickles, float(step_timeout)
    )
    results: List[Result] = []
    finals: Dict[str, Tuple[str, str]] = {}
    for sc in scenarios:
        result, final = run.scenario(sc)
        results.append(result)
        if final is not None:
            finals[sc.name] = (final, run.baseline(sc)[0])
    for before, after in _head_pairs(scenarios, finals):
        results.append(run.before_vs_after(before, after, finals))
    return results


def _head_pairs(scenarios: Sequence[Scenario], finals: Dict[str, Any]) -> List[Tuple[Scenario, Scenario]]:
    pairs = []
    for b in scenarios:
        if b.via == "consolidated-before" and b.name in finals:
            for a in scenarios:
                if a.via == "consolidated-after" and a.recipe == b.recipe and a.name in finals:
                    pairs.append((b, a))
                    break
    return pairs


class _Run:
    def __init__(
        self,
        work: str,
        recipes: _Recipes,
        steps: int,
        ckpt_step: int,
        seed: int,
        device: str,
        container: Optional[str],
        from_checkpoint: Optional[str],
        trust_pickles: bool,
        step_timeout: float,
    ) -> None:
        self.work, self.recipes, self.steps, self.seed, self.device = work, recipes, steps, seed, device
        self.container, self.source, self.trust = container, from_checkpoint, trust_pickles
        self.start = 0 if from_checkpoint is not None else ckpt_step
        self._baselines: Dict[Tuple[Optional[str], int], Tuple[str, str]] = {}
        self.step_timeout = step_timeout

    def _job(self, spec: Optional[str], folder: str, **kw: Any) -> Dict[str, Any]:
        ref, obj = self.recipes.get(spec)
        return {
            "recipe": ref,
            "seed": self.seed,
            "device": self.device,
            "container": self.container or getattr(obj, "container", "fairseq"),
            "errors": os.path.join(folder, "error"),
            "beat": os.path.join(folder, "progress"),
            "step_timeout": self.step_timeout,
            **kw,
        }

    def baseline(self, sc: Scenario) -> Tuple[str, str]:
        """(folder of the uninterrupted run's final files, the checkpoint scenarios start from)."""
        key = (sc.recipe, sc.train_ws)
        if key not in self._baselines:
            label = _slug(self.recipes.get(sc.recipe)[0].label)
            folder = os.path.join(self.work, f"uninterrupted-{label}-ws{sc.train_ws}")
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            if self.source is not None:  # the user's checkpoint, resumed as it is
                ckpt = self.source
                load = {"mode": "local", "path": ckpt, "scheduler_from": ckpt, "trust_pickles": self.trust}
                job = self._job(sc.recipe, folder, start=0, stop=self.steps, load=load)
            else:
                ckpt = os.path.join(folder, "ckpt")
                job = self._job(sc.recipe, folder, start=0, stop=self.steps, save_at=self.start, ckpt=ckpt)
            _spawn(sc.train_ws, {**job, "final": os.path.join(folder, "final")}, self.device)
            self._baselines[key] = (os.path.join(folder, "final"), ckpt)
        return self._baselines[key]

    def scenario(self, sc: Scenario) -> Tuple[Result, Optional[str]]:
        ref, obj = self.recipes.get(sc.recipe)
        steps = f"{self.start}..{self.start if sc.via == 'resave' else self.steps}"
        why = not_applicable(sc, obj)
        if why:
            return Result(
                sc.name, f"{sc.train_ws}->{sc.resume_ws}", steps, 0, 0, False, True, why, ref.label, False
            ), None
        began = time.monotonic()
        base, ckpt = self.baseline(sc)
        folder = os.path.join(self.work, _slug(f"{ref.label}-{sc.name}"))
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        load: Dict[str, Any] = {"optimizer": sc.optimizer, "scheduler_from": ckpt, "trust_pickles": self.trust}
        if sc.via in ("local", "resave"):
            load.update(mode="local", path=ckpt)
        elif sc.via == "reshard":
            out = os.path.join(folder, "resharded")
            reshard(ckpt, out, sc.resume_ws, progress=False, trust_pickles=self.trust)
            load.update(mode="local", path=out, scheduler_from=out)
        else:
            full = os.path.join(folder, "full.pt")
            consolidate(ckpt, full, optimizer=True, progress=False, trust_pickles=self.trust)
            mode = "full-before" if sc.via == "consolidated-before" else "full-after"
            load.update(mode=mode, path=full, optim_path=os.path.join(folder, "full.optim.pt"))
        final = os.path.join(folder, "final")
        stop = self.start if sc.via == "resave" else self.steps
        _spawn(
            sc.resume_ws, self._job(sc.recipe, folder, start=self.start, stop=stop, load=load, final=final), self.device
        )
        tolerance = 0.0 if sc.exact else float(getattr(obj, "tolerance", TOLERANCE))
        a, b = _run_record(base), _run_record(final)
        diff = Diff(tolerance=tolerance)
        if sc.via == "resave":
            diff = _compare_files(a["framework"], ckpt, final)
            matched = diff.identical
        else:
            _compare_finals(a, b, base, final, diff)
            compare_losses(a["losses"][self.start :], b["losses"], diff, self.start)
            matched = (
                diff.identical if sc.exact else not diff.problems and not diff.unsaved and diff.max_rel <= tolerance
            )
        result = Result(
            sc.name,
            f"{sc.train_ws}->{sc.resume_ws}",
            steps,
            diff.max_abs,
            diff.max_rel,
            matched,
            not sc.expect_mismatch,
            diff.report(),
            ref.label,
            seconds=time.monotonic() - began,
            first_step=self.start,
            reference_losses=list(a["losses"][:stop]),
            resumed_losses=list(b["losses"]),
        )
        return result, final

    def before_vs_after(self, before: Scenario, after: Scenario, finals: Dict[str, Tuple[str, str]]) -> Result:
        (fb, _), (fa, _) = finals[before.name], finals[after.name]
        a, b = _run_record(fb), _run_record(fa)
        diff = Diff()
        _compare_finals(a, b, fb, fa, diff)
        compare_losses(a["losses"], b["losses"], diff, self.start)
        label = self.recipes.get(before.recipe)[0].label
        steps = f"{self.start}..{self.steps}"
        ws = f"{before.resume_ws}->{after.resume_ws}"
        return Result(
            "before vs after head wrapping",
            ws,
            steps,
            diff.max_abs,
            diff.max_rel,
            diff.identical,
            True,
            diff.report(),
            label,
        )


def _run_record(final: str) -> Dict[str, Any]:
    return torch.load(os.path.join(final, "run.pt"), weights_only=False)


def _compare_finals(a: Dict[str, Any], b: Dict[str, Any], fa: str, fb: str, diff: Diff) -> None:
    """Full weights, optimizer state, LR scheduler and unsaved buffers at the end of two runs."""
    for name in sorted(set(a["unsaved_buffers"]) & set(b["unsaved_buffers"])):
        x, y = a["unsaved_buffers"][name], b["unsaved_buffers"][name]
        if x.shape != y.shape or not torch.equal(x, y):
            sub = Diff(tolerance=diff.tolerance)
            sub.tensor(name, x, y)
            if sub.problems or sub.differing:
                diff.unsaved.append(
                    f"buffer {name} is not in the checkpoint (non-persistent) and differs at the end "
                    f"(by {sub.max_abs:.3g}): the resumed run did not rebuild it"
                )
    if a["framework"] == "fairscale":
        compare_checkpoints(fa, fb, diff)
    else:
        compare_state(a["full"], b["full"], diff, "")
    if a["scheduler"] is not None or b["scheduler"] is not None:
        compare_state({"lr_scheduler": a["scheduler"]}, {"lr_scheduler": b["scheduler"]}, diff, "")


def _compare_files(framework: str, a: str, b: str) -> Diff:
    """Every rank's saved tensors and values, file by file (same world size)."""
    if framework == "fairscale":
        return compare_local(a, b)
    diff = Diff()
    fa, fb = local_files(a), local_files(b)
    compare_state(fa, fb, diff, "")
    return diff


def verify_resume(
    recipe: Union[str, Any, None] = None,
    scenarios: Optional[Sequence[Scenario]] = None,
    *,
    steps: int = 6,
    ckpt_step: int = 3,
    device: str = "cpu",
    container: Optional[str] = None,
    from_checkpoint: Optional[str] = None,
    work: Optional[str] = None,
    trust_pickles: bool = False,
    step_timeout: float = STEP_TIMEOUT,
) -> List[Result]:
    """Prove that resuming works for a model: real multi-process FSDP training, uninterrupted vs stopped,
    converted by ckptshard and resumed.

    Each scenario trains the recipe for ``steps`` steps without a stop, and
    again stopped after ``ckpt_step`` steps, its checkpoint converted (local
    shards, reshard M->N, consolidated and loaded before or after wrapping)
    and resumed. Weights, optimizer state, LR scheduler, non-persistent
    buffers and per-step losses are compared: same world size bit-exact,
    other world sizes within the recipe's tolerance (1e-5 relative).

    Args:
        recipe: a recipe object (docs/recipes.md) or its spec, ``pkg.module:NAME`` or ``file.py:NAME``;
            None: the built-in VISSL-like model and the default scenarios, torch FSDP2 ones included.
        scenarios: which runs; default :data:`DEFAULT_SCENARIOS` without a recipe, else
            :func:`recipe_scenarios` (add :func:`reshard_scenario` specs as needed).
        steps, ckpt_step: length of the run, and the step after which it is stopped.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, a GPU per rank).
        container: ``"fairseq"``, ``"metaseq"`` or ``"vissl"``, the files fairscale runs save (default: the
            recipe's).
        from_checkpoint: start from this sharded checkpoint instead of step 0: the reference resumes it at
            its own world size for ``steps`` steps, each scenario converts it and resumes at its target.
        work: folder for the runs' checkpoints; a temporary one, removed afterwards, if None.
        trust_pickles: unpickle ``from_checkpoint``'s files without the weights-only safety net (its LR
            scheduler state included): they can run code. Without it no file of the checkpoint runs code.
        step_timeout: seconds a run may go without any rank finishing a step (start-up and loading
            included); past it every rank is stopped and CheckpointError raised.

    Returns:
        One :class:`Result` per scenario (``ok``, the differences found, the per-step losses, timings).

    Raises:
        CheckpointError: bad arguments, or a recipe that breaks a rule (a member missing, a model that
            differs between ranks, a global batch that depends on the world size), in one line.
    """
    kw: Dict[str, Any] = {"steps": steps, "ckpt_step": ckpt_step, "device": device, "container": container}
    kw.update(recipe=recipe, from_checkpoint=from_checkpoint, trust_pickles=trust_pickles, step_timeout=step_timeout)
    if work is not None:
        return run_scenarios(work, scenarios, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        return run_scenarios(tmp, scenarios, **kw)


def reshard_scenario(spec: str) -> Scenario:
    """``"2->5"`` as a scenario: train at 2, reshard, resume at 5."""
    try:
        a, b = (int(x) for x in spec.split("->"))
    except ValueError:
        raise CheckpointError(f"--reshard {spec!r}: expected M->N, e.g. 2->5") from None
    if a < 1 or b < 1:
        raise CheckpointError(f"--reshard {spec!r}: world sizes must be >= 1")
    return Scenario(f"reshard {a}->{b}", a, b, "reshard")


def format_table(results: Sequence[Result]) -> str:
    head = f"{'scenario':52} {'world':6} {'steps':6} {'max abs':>10} {'max rel':>10}  verdict"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.scenario:52} {r.world_sizes:6} {r.steps:6} {r.max_abs:10.3g} {r.max_rel:10.3g}  {r.verdict}")
        for p in r.problems:
            lines.append(f"{'':54}{p}")
    return "\n".join(lines)


def results_json(results: Sequence[Result]) -> List[Dict[str, Any]]:
    return [dict(asdict(r), verdict=r.verdict, ok=r.ok) for r in results]

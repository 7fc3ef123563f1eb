"""Scenarios: train uninterrupted, or stop, convert and resume; then compare.

Deterministic data is indexed by global step and sample, so every world size
sees the same global batch; BatchNorm runs in eval mode for the same reason.
Same world size must be bit-exact; across world sizes the gradient reduction
order differs, so weights and losses must agree to ``tolerance`` (relative)
with learning rate, step and every other non-tensor value exactly equal.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError
from ..execute.consolidate import consolidate
from ..execute.reshard import reshard
from ..fsdp.launch import run_world
from .compare import Diff, compare_checkpoints, compare_local, compare_losses, compare_state
from .worker import CONTAINER_FILES, train_worker

TOLERANCE = 1e-5


@dataclass(frozen=True)
class Scenario:
    name: str
    train_ws: int
    resume_ws: int
    via: str  # local | reshard | consolidated-before | consolidated-after | resave
    variant: str = "fp32"
    optimizer: bool = True
    expect_mismatch: bool = False
    framework: str = "fairscale"  # or "fsdp2": torch's fully_shard, verl's per-rank files

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
    Scenario("mixed precision, fp32 prototypes", 2, 2, "local", variant="mixed"),
    Scenario("frozen trunk (not in the optimizer), reshard 2->3", 2, 3, "reshard", variant="frozen"),
    Scenario("two param groups, head listed first, reshard 2->3", 2, 3, "reshard", variant="groups"),
    Scenario("negative control: no optimizer state", 2, 2, "local", optimizer=False, expect_mismatch=True),
    Scenario("load and re-save, no step", 2, 2, "resave"),
    Scenario("torch FSDP2 (verl files), same world size", 2, 2, "local", framework="fsdp2"),
    Scenario("torch FSDP2 (verl files), reshard 2->3", 2, 3, "reshard", framework="fsdp2"),
    Scenario(
        "FSDP2 negative control: no optimizer state",
        2,
        2,
        "local",
        optimizer=False,
        expect_mismatch=True,
        framework="fsdp2",
    ),
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

    @property
    def ok(self) -> bool:
        return self.matched == self.expected_match

    @property
    def verdict(self) -> str:
        if self.matched:
            return "match" if self.expected_match else "MATCH (expected a mismatch)"
        return "mismatch (expected)" if not self.expected_match else "MISMATCH"


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s).strip("-")


def _verdict(diff: Diff, exact: bool) -> bool:
    if exact:
        return diff.identical
    return not diff.problems and diff.max_rel <= TOLERANCE


def run_scenarios(
    work: str,
    scenarios: Sequence[Scenario] = DEFAULT_SCENARIOS,
    steps: int = 6,
    ckpt_step: int = 3,
    seed: int = 0,
    device: str = "cpu",
    container: str = "fairseq",
) -> List[Result]:
    if not 0 < ckpt_step < steps:
        raise CheckpointError(f"--ckpt-step must be between 1 and --steps - 1, got {ckpt_step} of {steps}")
    os.makedirs(work, exist_ok=True)
    if container not in CONTAINER_FILES:
        raise CheckpointError(f"--container {container!r}: one of {', '.join(CONTAINER_FILES)}")
    base_job = {"seed": seed, "device": device, "container": container}
    fsdp2 = [sc for sc in scenarios if sc.framework == "fsdp2"]  # on gloo ranks, whatever ``device`` says
    scenarios = [sc for sc in scenarios if sc.framework != "fsdp2"]
    baselines: Dict[Tuple[str, int], str] = {}
    for sc in scenarios:
        key = (sc.variant, sc.train_ws)
        if key in baselines:
            continue
        folder = os.path.join(work, f"uninterrupted-{sc.variant}-ws{sc.train_ws}")
        shutil.rmtree(folder, ignore_errors=True)
        run_world(
            train_worker,
            sc.train_ws,
            {
                **base_job,
                "variant": sc.variant,
                "start": 0,
                "stop": steps,
                "save_at": ckpt_step,
                "ckpt": os.path.join(folder, "ckpt"),
                "final": os.path.join(folder, "final"),
            },
            backend=_backend(device),
        )
        baselines[key] = folder
    results: List[Result] = []
    finals: Dict[str, str] = {}
    for sc in scenarios:
        base = baselines[(sc.variant, sc.train_ws)]
        ckpt = os.path.join(base, "ckpt")
        folder = os.path.join(work, _slug(sc.name))
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        load: Dict[str, object] = {"optimizer": sc.optimizer}
        if sc.via in ("local", "resave"):
            load.update(mode="local", path=ckpt)
        elif sc.via == "reshard":
            reshard(ckpt, os.path.join(folder, "resharded"), sc.resume_ws, progress=False)
            load.update(mode="local", path=os.path.join(folder, "resharded"))
        else:
            full = os.path.join(folder, "full.pt")
            consolidate(ckpt, full, optimizer=True, progress=False)
            load.update(
                mode="full-before" if sc.via == "consolidated-before" else "full-after",
                path=full,
                optim_path=os.path.join(folder, "full.optim.pt"),
            )
        start = ckpt_step
        stop = ckpt_step if sc.via == "resave" else steps
        final = os.path.join(folder, "final")
        run_world(
            train_worker,
            sc.resume_ws,
            {**base_job, "variant": sc.variant, "start": start, "stop": stop, "load": load, "final": final},
            backend=_backend(device),
        )
        finals[sc.name] = final
        if sc.via == "resave":
            diff = compare_local(ckpt, final)
            matched = diff.identical
        else:
            diff = compare_checkpoints(os.path.join(base, "final"), final)
            base_losses = torch.load(os.path.join(base, "final", "losses.pt"), weights_only=True)["losses"][ckpt_step:]
            compare_losses(base_losses, torch.load(os.path.join(final, "losses.pt"), weights_only=True)["losses"], diff)
            matched = _verdict(diff, sc.exact)
        results.append(_scenario_result(sc, f"{start}..{stop} of {steps}", diff, matched))
    results += [fsdp2_scenario(work, sc, steps, ckpt_step) for sc in fsdp2]
    before = [s.name for s in scenarios if s.via == "consolidated-before"]
    after = [s.name for s in scenarios if s.via == "consolidated-after"]
    if before and after:
        diff = compare_checkpoints(finals[before[0]], finals[after[0]])
        results.append(
            Result(
                "before vs after head wrapping",
                "2->2",
                f"{ckpt_step}..{steps} of {steps}",
                diff.max_abs,
                diff.max_rel,
                diff.identical,
                True,
                diff.problems[:5],
            )
        )
    return results


def verify_resume(
    scenarios: Sequence[Scenario] = DEFAULT_SCENARIOS,
    *,
    steps: int = 6,
    ckpt_step: int = 3,
    device: str = "cpu",
    container: str = "fairseq",
    work: Optional[str] = None,
) -> List[Result]:
    """Prove that resuming works: real multi-process FSDP training, uninterrupted vs stopped and resumed.

    Each scenario trains the built-in VISSL-like model for ``steps`` steps
    without a stop, and again stopped after ``ckpt_step`` steps, its
    checkpoint converted by ckptshard (local shards, reshard M->N,
    consolidate before or after head wrapping) and resumed. Same world size
    must be bit-exact, other world sizes within 1e-5 relative.

    Args:
        scenarios: which runs (:data:`DEFAULT_SCENARIOS`, or :func:`reshard_scenario` specs).
        steps, ckpt_step: length of the run, and the step after which it is stopped.
        device: ``"cpu"`` (gloo, with the CPU compatibility layer) or ``"cuda"`` (NCCL, a GPU per rank).
        container: ``"fairseq"`` or ``"metaseq"``, the files the runs save.
        work: folder for the runs' checkpoints; a temporary one, removed afterwards, if None.

    Returns:
        One :class:`Result` per scenario (``ok``, the differences found, timings).

    Raises:
        CheckpointError: bad arguments (``ckpt_step`` not inside the run, an unknown container).
    """
    if work is not None:
        return run_scenarios(work, scenarios, steps, ckpt_step, device=device, container=container)
    with tempfile.TemporaryDirectory() as tmp:
        return run_scenarios(tmp, scenarios, steps, ckpt_step, device=device, container=container)


def reshard_scenario(spec: str) -> Scenario:
    """``"2->5"`` as a scenario: train at 2, reshard, resume at 5."""
    try:
        a, b = (int(x) for x in spec.split("->"))
    except ValueError:
        raise CheckpointError(f"--reshard {spec!r}: expected M->N, e.g. 2->5") from None
    if a < 1 or b < 1:
        raise CheckpointError(f"--reshard {spec!r}: world sizes must be >= 1")
    return Scenario(f"reshard {a}->{b}", a, b, "reshard")


def fsdp2_scenario(work: str, sc: Scenario, steps: int, ckpt_step: int) -> Result:
    """torch FSDP2: uninterrupted at ``train_ws``, or stopped after ``ckpt_step`` (verl's per-rank files),
    resharded by ckptshard to ``resume_ws`` where it differs, and resumed; full states and losses compared."""
    from ..testing.torch_fsdp_runs import resume_run

    folder = os.path.join(work, _slug(sc.name))
    shutil.rmtree(folder, ignore_errors=True)
    ckpt, base = os.path.join(folder, "ckpt"), os.path.join(folder, "uninterrupted")
    resume_run(sc.train_ws, {"start": 0, "stop": steps, "save_at": ckpt_step, "ckpt": ckpt, "final": base})
    src = ckpt
    if sc.resume_ws != sc.train_ws:
        src = os.path.join(folder, "resharded")
        reshard(ckpt, src, sc.resume_ws, progress=False)
    final = os.path.join(folder, "resumed")
    job = {"start": ckpt_step, "stop": steps, "load": src, "optimizer": sc.optimizer, "final": final}
    resume_run(sc.resume_ws, job)
    a = torch.load(os.path.join(base, "full.pt"), weights_only=True)
    b = torch.load(os.path.join(final, "full.pt"), weights_only=True)
    diff = Diff()
    compare_state({"model": a["model"], "optim": a["optim"]}, {"model": b["model"], "optim": b["optim"]}, diff, "")
    compare_losses(a["losses"][ckpt_step:], b["losses"], diff)
    matched = _verdict(diff, sc.exact)
    return _scenario_result(sc, f"{ckpt_step}..{steps} of {steps}", diff, matched)


def _scenario_result(sc: Scenario, steps: str, diff: Diff, matched: bool) -> Result:
    return Result(
        sc.name,
        f"{sc.train_ws}->{sc.resume_ws}",
        steps,
        diff.max_abs,
        diff.max_rel,
        matched,
        not sc.expect_mismatch,
        diff.problems[:5],
    )


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def format_table(results: Sequence[Result]) -> str:
    head = f"{'scenario':44} {'world':6} {'steps':10} {'max abs':>10} {'max rel':>10}  verdict"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.scenario:44} {r.world_sizes:6} {r.steps:10} {r.max_abs:10.3g} {r.max_rel:10.3g}  {r.verdict}")
        for p in r.problems:
            lines.append(f"{'':46}{p}")
    return "\n".join(lines)


def results_json(results: Sequence[Result]) -> List[Dict[str, object]]:
    return [dict(asdict(r), verdict=r.verdict, ok=r.ok) for r in results]

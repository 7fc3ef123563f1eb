"""verify-resume on recipes written only against the public recipe API (tests/recipes/): real multi-process
runs pass where resuming is right, and the harness catches what a checkpoint misses and refuses bad recipes."""

import json
import os
import subprocess
import sys

import pytest

import ckptshard
from ckptshard.harness.verify_resume import recipe_scenarios, reshard_scenario

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

RECIPES = os.path.join(os.path.dirname(__file__), "recipes")
GROUPS = os.path.join(RECIPES, "groups_fairscale.py") + ":RECIPE"
TIED = os.path.join(RECIPES, "tied_fsdp2.py") + ":RECIPE"
BROKEN = os.path.join(RECIPES, "broken.py")
SAME_WS = (
    "same world size, local shards",
    "consolidated, loaded before wrapping",
    "consolidated, loaded after wrapping",
    "load and re-save, no step",
    "before vs after head wrapping",
)


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("groups"))
    return work, {r.scenario: r for r in ckptshard.verify_resume(GROUPS, work=work)}


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("tied"))
    return work, {r.scenario: r for r in ckptshard.verify_resume(TIED, work=work)}


@pytest.fixture(scope="module")
def tied(tied_run):
    return tied_run[1]


def _check_all_pass(results):
    names = [s.name for s in recipe_scenarios(2)] + ["before vs after head wrapping"]
    assert sorted(results) == sorted(names)
    for name, r in results.items():
        assert r.ok and r.applicable, (name, r.verdict, r.problems)
    for name in SAME_WS:
        assert results[name].max_abs == 0.0 and not results[name].problems, name
    for name in ("reshard 2->3", "reshard 2->1"):  # reduction order differs across world sizes, a little
        assert 0 < results[name].max_rel <= 1e-5, name
    control = results["negative control: no optimizer state"]
    assert control.verdict == "mismatch (expected)" and control.max_rel > 1e-3
    assert any("step" in p for p in control.problems)


def test_fairscale_recipe_with_two_param_groups_weight_decay_and_scheduler(groups):
    _check_all_pass(groups[1])


def test_fsdp2_recipe_with_tied_weights(tied):
    _check_all_pass(tied)


def test_losses_are_recorded_per_step(groups):
    r = groups[1]["reshard 2->3"]
    assert r.first_step == 3 and len(r.reference_losses) == 6 and len(r.resumed_losses) == 3
    assert r.resumed_losses == pytest.approx(r.reference_losses[3:], rel=1e-5)


def test_from_a_checkpoint_an_earlier_run_saved(groups, tmp_path):
    ckpt = os.path.join(groups[0], "uninterrupted-" + _slug(GROUPS) + "-ws2", "ckpt")
    assert os.path.isfile(os.path.join(ckpt, "checkpoint_last-shard1.pt"))
    scenarios = [reshard_scenario("2->3"), recipe_scenarios(2)[-2]]  # and the negative control
    results = ckptshard.verify_resume(GROUPS, scenarios, from_checkpoint=ckpt, steps=3, work=str(tmp_path))
    assert [r.ok for r in results] == [True, True], [(r.verdict, r.problems) for r in results]
    assert results[0].steps == "0..3" and 0 < results[0].max_rel <= 1e-5
    assert not results[1].matched


def test_from_a_checkpoint_of_another_world_size_than_the_scenario(groups, tmp_path):
    ckpt = os.path.join(groups[0], "uninterrupted-" + _slug(GROUPS) + "-ws2", "ckpt")
    with pytest.raises(ckptshard.CheckpointError, match="saved by 2"):
        ckptshard.verify_resume(GROUPS, [reshard_scenario("3->2")], from_checkpoint=ckpt, work=str(tmp_path))


class _Payload:
    """Unpickled with its code, it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _with_payload(tied_run, tmp_path, where):
    """A copy of the tied recipe's verl checkpoint, rank 0's extra_state carrying a payload in ``where``."""
    import shutil

    import torch

    ckpt = os.path.join(tied_run[0], "uninterrupted-" + _slug(TIED) + "-ws2", "ckpt")
    src = tmp_path / "ckpt"
    shutil.copytree(ckpt, src)
    extra = src / "extra_state_world_size_2_rank_0.pt"
    state = torch.load(extra, weights_only=False)
    marker = tmp_path / "payload-ran"
    if where == "rng":
        state["rng"]["evil"] = _Payload(marker)
    else:
        state["lr_scheduler"]["evil"] = _Payload(marker)
    torch.save(state, extra)
    return src, marker


def test_verify_resume_from_never_runs_code_pickled_beside_the_scheduler_state(tied_run, tmp_path):
    src, marker = _with_payload(tied_run, tmp_path, "rng")
    res = _verify_resume_cli(
        "--recipe", TIED, "--from", str(src), "--scenario", "same world size", "--steps", "1", "--work", str(tmp_path)
    )
    assert not marker.exists(), "a pickled payload ran"
    assert res.returncode == 0, res.stderr


def test_verify_resume_from_refuses_a_scheduler_state_that_holds_pickled_code(tied_run, tmp_path):
    src, marker = _with_payload(tied_run, tmp_path, "lr_scheduler")
    args = ["--recipe", TIED, "--from", str(src), "--scenario", "same world size", "--steps", "1"]
    res = _verify_resume_cli(*args, "--work", str(tmp_path / "w1"))
    assert not marker.exists(), "a pickled payload ran"
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "lr_scheduler" in errors[0] and "--trust-pickles" in errors[0], res.stderr
    assert "Traceback" not in res.stderr
    res = _verify_resume_cli(*args, "--trust-pickles", "--work", str(tmp_path / "w2"))  # the user's own file
    assert marker.exists()


def test_verify_resume_from_a_checkpoint_of_another_model_is_one_line(tied_run, tmp_path):
    ckpt = os.path.join(tied_run[0], "uninterrupted-" + _slug(TIED) + "-ws2", "ckpt")
    other = "ckptshard.recipes.verl_fsdp2:RECIPE"
    res = _verify_resume_cli(
        "--recipe", other, "--from", ckpt, "--scenario", "same world size", "--work", str(tmp_path)
    )
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "a checkpoint of another model than the recipe's" in errors[0], res.stderr
    assert "Traceback" not in res.stderr


def _slug(s):
    return "".join(c if c.isalnum() else "-" for c in s).strip("-")


def test_a_non_persistent_buffer_is_a_mismatch_naming_it(tmp_path):
    (r,) = ckptshard.verify_resume(
        f"{BROKEN}:NON_PERSISTENT", [recipe_scenarios(2)[0]], steps=4, ckpt_step=2, work=str(tmp_path)
    )
    assert r.verdict == "MISMATCH" and not r.ok
    assert r.problems[0].startswith("the loss of step 3 differs first")
    assert "buffer calls is not in the checkpoint" in r.problems[1]


def test_an_unsaved_scheduler_is_a_mismatch_naming_the_learning_rate(tmp_path):
    (r,) = ckptshard.verify_resume(
        f"{BROKEN}:HIDDEN_SCHEDULER", [recipe_scenarios(2)[0]], steps=5, ckpt_step=2, work=str(tmp_path)
    )
    assert r.verdict == "MISMATCH"
    assert any("param_groups[0].lr" in p or "param_groups[1].lr" in p for p in r.problems), r.problems


def _verify_resume_cli(*args):
    cmd = [sys.executable, "-m", "ckptshard.cli", "verify-resume", *args]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize(
    "name, message",
    [
        ("WORLD_SIZE_BATCH", "batch() depends on the world size"),
        ("NO_LOSS", "no loss (a recipe needs"),
        ("RANK_MODEL", "build_model() differs between ranks: blocks.0.0.weight on rank 1"),
    ],
)
def test_bad_recipes_get_one_line_and_exit_2(name, message, tmp_path):
    res = _verify_resume_cli("--recipe", f"{BROKEN}:{name}", "--work", str(tmp_path))
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], res.stderr
    assert "Traceback" not in res.stderr


def _all_gone(pids, within=15.0):
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "zombie" not in _state(p)]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _state(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return f.read().lower()
    except OSError:
        return "zombie"


def test_a_recipe_that_hangs_is_stopped_after_the_step_timeout_with_every_rank(tmp_path):
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    began = time.monotonic()
    cmd = [sys.executable, "-m", "ckptshard.cli", "verify-resume", "--recipe", f"{BROKEN}:HANG"]
    args = ["--scenario", "same world size", "--step-timeout", "15", "--work", str(tmp_path / "w")]
    res = subprocess.run(cmd + args, capture_output=True, text=True, env={**os.environ, "HANG_PIDS": str(pids)})
    assert res.returncode == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no rank finished a step in 15 s" in errors[0], res.stderr
    assert time.monotonic() - began < 120
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(ranks) == 2 and _all_gone(ranks)


def test_sigterm_of_verify_resume_ends_every_rank_it_started(tmp_path):
    import signal
    import time

    pids = tmp_path / "pids"
    pids.mkdir()
    cmd = [sys.executable, "-m", "ckptshard.cli", "verify-resume", "--recipe", f"{BROKEN}:HANG"]
    args = ["--scenario", "same world size", "--work", str(tmp_path / "w")]
    proc = subprocess.Popen(cmd + args, env={**os.environ, "HANG_PIDS": str(pids)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # the ranks are inside the hanging step
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Traceback" not in err, err
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(ranks) == 2 and _all_gone(ranks)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", "expected package.module:NAME"),
        ("tests/recipes/missing.py:RECIPE", "no file"),
        (f"{BROKEN}:NOPE", "defines no NOPE"),
        ("ckptshard.nonexistent:RECIPE", "cannot import"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(ckptshard.CheckpointError, match=message):
        ckptshard.verify_resume(spec)


def test_a_recipe_object_travels_to_the_ranks_pickled(tmp_path):
    from ckptshard.recipes.vissl_like import RECIPE

    (r,) = ckptshard.verify_resume(RECIPE, [recipe_scenarios(2)[-1]], steps=2, ckpt_step=1, work=str(tmp_path))
    assert r.ok and r.recipe == "VisslLike" and r.max_abs == 0.0


def test_cli_recipe_json_and_plot(tmp_path):
    png = tmp_path / "resume.png"
    res = _verify_resume_cli(
        "--recipe", TIED, "--scenario", "same world size", "--reshard", "2->4",
        "--steps", "3", "--ckpt-step", "1", "--json", "--plot", str(png),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["scenario"] for r in rows] == ["same world size, local shards", "reshard 2->4"]
    assert all(r["ok"] and len(r["resumed_losses"]) == 2 for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    import builtins

    from ckptshard.harness.plot import check_plotting

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ckptshard.CheckpointError, match=r"pip install 'ckptshard\[plot\]'"):
        check_plotting()


def test_scenarios_without_heads_are_listed_not_applicable(tmp_path):
    heads = [s for s in recipe_scenarios(2) if s.via.startswith("consolidated")]
    results = ckptshard.verify_resume(
        "ckptshard.recipes.transformer:RECIPE", heads, steps=2, ckpt_step=1, work=str(tmp_path)
    )
    assert [r.verdict for r in results] == ["not applicable", "not applicable"]
    assert all(r.ok and r.problems == ["the recipe names no heads"] for r in results)


def test_vissl_container_saves_vissls_files_and_resumes_resharded(tmp_path):
    """container "vissl": the trunk and each head's local state in VISSL's sharded checkpoint and a shard_list,
    resharded 2->3 by ckptshard and resumed."""
    import torch

    from ckptshard.recipes.vissl_like import RECIPE

    work = tmp_path / "work"
    scenarios = [reshard_scenario("2->3"), recipe_scenarios(2)[2]]  # + consolidated, loaded before wrapping
    results = ckptshard.verify_resume(RECIPE, scenarios, steps=3, ckpt_step=1, container="vissl", work=str(work))
    assert [r.ok for r in results] == [True, True], [r.problems for r in results]
    sizes = []
    for path in sorted(work.rglob("model_iteration.torch")):
        listed = torch.load(path, weights_only=True)
        assert listed["type"] == "shard_list"
        sizes.append(len(listed["shards"]))
        for name in listed["shards"]:
            model = torch.load(path.parent / name, weights_only=False)["classy_state_dict"]["base_model"]["model"]
            assert set(model) == {"trunk", "heads"} and len(model["heads"]) == 1
    assert 2 in sizes, sizes  # the run at 2 ranks saved VISSL's files


def test_vissl_container_needs_vissls_trunk_and_heads(tmp_path):
    with pytest.raises(ckptshard.CheckpointError, match="container vissl: VISSL saves the model's `trunk`"):
        ckptshard.verify_resume(GROUPS, [recipe_scenarios(2)[0]], steps=2, ckpt_step=1, container="vissl")

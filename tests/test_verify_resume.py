"""The verify-resume harness: resumed runs match uninterrupted ones, and it can fail."""

import json
import subprocess
import sys

import pytest

from ckptshard.harness.verify_resume import DEFAULT_SCENARIOS, TOLERANCE, run_scenarios

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    return {r.scenario: r for r in run_scenarios(str(tmp_path_factory.mktemp("resume")))}


@pytest.mark.parametrize("name", [s.name for s in DEFAULT_SCENARIOS] + ["before vs after head wrapping"])
def test_scenario(results, name):
    r = results[name]
    assert r.ok, (r.verdict, r.problems)


def test_same_world_size_is_bit_exact(results):
    for name in (
        "same world size, local shards",
        "mixed precision, fp32 prototypes",
        "load and re-save, no step",
        "consolidated, loaded before head wrapping",
        "consolidated, loaded after head wrapping",
        "torch FSDP2 (verl files), same world size",
    ):
        assert results[name].max_abs == 0.0 and not results[name].problems, name


def test_other_world_sizes_within_tolerance_and_not_trivially(results):
    for name in (
        "reshard 2->4",
        "reshard 4->2",
        "reshard 2->3",
        "reshard 3->1",
        "two param groups, head listed first, reshard 2->3",
        "torch FSDP2 (verl files), reshard 2->3",
    ):
        assert 0 < results[name].max_rel <= TOLERANCE, name  # reduction order differs, a little


def test_negative_control_is_caught(results):
    r = results["negative control: no optimizer state"]
    assert not r.matched and r.verdict == "mismatch (expected)"
    assert r.max_rel > 1e-3 and any("step" in p for p in r.problems)
    r = results["FSDP2 negative control: no optimizer state"]
    assert not r.matched and r.verdict == "mismatch (expected)" and r.max_rel > 1e-3


def test_cli_table_json_and_exit_code():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptshard.cli",
            "verify-resume",
            "--scenario",
            "re-save",
            "--json",
            "--steps",
            "4",
            "--ckpt-step",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["scenario"] for r in rows] == ["load and re-save, no step"] and rows[0]["ok"]
    extra = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptshard.cli",
            "verify-resume",
            "--reshard",
            "3->2",
            "--container",
            "metaseq",
            "--steps",
            "3",
            "--ckpt-step",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert extra.returncode == 0, extra.stderr
    assert "reshard 3->2" in extra.stdout and "match" in extra.stdout and "same world size" not in extra.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ckptshard.cli", "verify-resume", "--ckpt-step", "9"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--ckpt-step" in bad.stderr


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 4,
    reason="needs 4 CUDA GPUs",
)
def test_cuda_path(tmp_path):
    import dataclasses

    chosen = [dataclasses.replace(s) for s in DEFAULT_SCENARIOS[:2]]
    assert all(r.ok for r in run_scenarios(str(tmp_path), chosen, device="cuda"))


def test_fsdp2_rows_are_not_applicable_on_a_torch_without_fully_shard(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_fully_shard(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "torch.distributed.fsdp" and fromlist and "fully_shard" in fromlist:
            raise ImportError("cannot import name 'fully_shard' from 'torch.distributed.fsdp'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_fully_shard)
    fsdp2 = [s for s in DEFAULT_SCENARIOS if "FSDP2" in s.name]
    results = run_scenarios(str(tmp_path), fsdp2)
    assert [r.verdict for r in results] == ["not applicable"] * len(fsdp2)
    assert all(r.ok and "has no FSDP2" in r.problems[0] for r in results)
    assert not any(tmp_path.iterdir())  # no rank was started

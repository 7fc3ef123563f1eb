"""Model-parallel parts x FSDP shards (metaseq's OPT layout): real fairscale model-parallel layers on gloo,
FSDP over each data-parallel group. Consolidate across parts equals the model gathered by layer type (and
runs as the model at model-parallel size 1); reshard equals FSDP at N over each part's group."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

import ckptshard
from ckptshard.plan.model_parallel import PRESETS, MpRule, joined, parse_rule
from ckptshard.testing.model_parallel import build_mp_run, fsdp_at, logits_at_mp1
from ckptshard.testing.synthetic import write_synthetic_parts

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

PARTS = "checkpoint_last-model_part-{}-shard{}.pt"


@pytest.fixture(scope="module", params=[2, 3], ids=["mp2xdp2", "mp2xdp3"])
def run(request, tmp_path_factory):
    return build_mp_run(str(tmp_path_factory.mktemp(f"mp2dp{request.param}")), 2, request.param), request.param


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ckptshard.cli", *args], capture_output=True, text=True)


def test_inspect_shows_both_sizes(run):
    src, dp = run
    s = ckptshard.inspect_checkpoint(src)
    assert s["model_parallel_parts"] == 2 and s["world_size"] == dp and len(s["files"]) == 2 * dp
    out = _cli("inspect", src)
    assert out.returncode == 0 and f"{dp} FSDP shards x 2 model-parallel parts" in out.stdout


def test_consolidate_with_metaseq_rules_is_the_gathered_model(run, tmp_path):
    src, _ = run
    out = str(tmp_path / "full.pt")
    res = ckptshard.consolidate(src, out, mp_presets=["metaseq"], progress=False)
    assert res.outputs == [out] and not res.notes
    full = torch.load(out, weights_only=True)
    gathered = torch.load(os.path.join(src, "ref", "gathered.pt"), weights_only=True)
    assert sorted(full) == sorted(gathered)
    for k in gathered:
        assert torch.equal(full[k], gathered[k]), k
    # The tied output projection is split like the embedding and stored once.
    assert full["decoder.output_projection.weight"].data_ptr() == full["decoder.embed_tokens.weight"].data_ptr()
    # And it runs: the model at model-parallel size 1 gives the live model's logits.
    logits_at_mp1(out, str(tmp_path / "logits.pt"))
    live = torch.load(os.path.join(src, "ref", "logits.pt"), weights_only=True)
    assert torch.allclose(torch.load(tmp_path / "logits.pt", weights_only=True), live, atol=1e-5, rtol=0)


def test_the_same_rules_written_out_by_hand(run, tmp_path):
    src, _ = run
    out = tmp_path / "full.safetensors"
    res = _cli("consolidate", src, "-o", str(out), *[a for r in PRESETS["metaseq"] for a in ("--mp-rule", r)], "-q")
    assert res.returncode == 0, res.stderr
    from safetensors.torch import load_file

    full, gathered = load_file(str(out)), torch.load(os.path.join(src, "ref", "gathered.pt"), weights_only=True)
    assert all(torch.equal(full[k], gathered[k]) for k in gathered) and sorted(full) == sorted(gathered)


def test_a_missing_rule_is_refused_and_nothing_written(run, tmp_path):
    src, _ = run
    out = tmp_path / "full.pt"
    rules = [r for r in PRESETS["metaseq"] if "fc2" not in r]  # row-parallel fc2/out_proj weights left out
    res = _cli("consolidate", src, "-o", str(out), *[a for r in rules for a in ("--mp-rule", r)], "-q")
    assert res.returncode == 2
    (line,) = [x for x in res.stderr.splitlines() if x.strip()]
    assert "out_proj.weight: differs between model parts" in line and "--mp-rule" in line
    assert not out.exists() and os.listdir(tmp_path) == []


def test_without_rules_one_full_file_per_part(run, tmp_path):
    src, _ = run
    res = ckptshard.consolidate(src, str(tmp_path / "full.pt"), optimizer=True, progress=False)
    parts = torch.load(os.path.join(src, "ref", "parts.pt"), weights_only=True)
    assert "one full state dict per part" in res.notes[0]
    for k, live in enumerate(parts):
        got = torch.load(tmp_path / f"full-model_part-{k}.pt", weights_only=True)
        assert sorted(got) == sorted(live) and all(torch.equal(got[n], live[n]) for n in live)
        assert (tmp_path / f"full-model_part-{k}.optim.pt").exists()


def test_reshard_every_part_is_what_fsdp_at_n_saves(run, tmp_path):
    src, dp = run
    n = 5 - dp  # 2x2 -> 2x3, 2x3 -> 2x2
    out = tmp_path / "resharded"
    res = ckptshard.reshard(src, str(out), n, progress=False)
    assert sorted(res.files) == sorted(PARTS.format(k, r) for k in range(2) for r in range(n))
    fsdp_at(src, 2, n, str(tmp_path / "fsdp"))
    for k in range(2):
        for r in range(n):
            ours = torch.load(out / PARTS.format(k, r), weights_only=False)
            theirs = torch.load(tmp_path / "fsdp" / f"part-{k}-shard{r}.pt", weights_only=True)
            assert sorted(ours["model"]) == sorted(theirs)
            assert all(torch.equal(ours["model"][x], theirs[x]) for x in theirs), (k, r)
            assert ours["optimizer_history"] == [{"num_updates": 2}]
    assert ckptshard.inspect_checkpoint(str(out))["world_size"] == n
    # Weights and optimizer state come back unchanged through the resharded files.
    for tag, path in (("src", src), ("resharded", str(out))):
        ckptshard.consolidate(path, str(tmp_path / f"{tag}.pt"), optimizer=True, progress=False)
    for k in range(2):
        for suffix in ("", ".optim"):
            a = torch.load(tmp_path / f"src-model_part-{k}{suffix}.pt", weights_only=False)
            b = torch.load(tmp_path / f"resharded-model_part-{k}{suffix}.pt", weights_only=False)
            _assert_equal_trees(a, b)


def _assert_equal_trees(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str)
        for k in a:
            _assert_equal_trees(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_trees(x, y)
    else:
        assert a == b


def test_grouped_join_is_metaseqs_qkv_regrouping(tmp_path):
    from ckptshard.read.tensor_data import read_fill
    from ckptshard.read.torch_file import read_torch_file
    from ckptshard.tensors import whole

    parts = [torch.randn(6, 4), torch.randn(6, 4), torch.randn(6, 4)]
    torch.save({str(i): p for i, p in enumerate(parts)}, tmp_path / "t.pt")
    refs = read_torch_file(str(tmp_path / "t.pt"))
    fills = [whole(refs[str(i)]) for i in range(3)]
    ks, vs, qs = zip(*(p.chunk(3) for p in parts))
    expected = torch.cat(list(ks) + list(vs) + list(qs))
    assert torch.equal(read_fill(joined("qkv", fills, MpRule("qkv", 0, 3))), expected)
    assert torch.equal(read_fill(joined("w", fills, MpRule("w", 1))), torch.cat(parts, 1))
    assert torch.equal(read_fill(joined("w", fills, MpRule("w", 0))), torch.cat(parts, 0))
    with pytest.raises(ckptshard.CheckpointError, match="do not split into 4 groups"):
        joined("qkv", fills, MpRule("qkv", 0, 4))


@pytest.mark.parametrize("text", ["fc1", "fc1=x", "(=0", "=0"])
def test_bad_rules(text):
    with pytest.raises(ckptshard.CheckpointError, match="--mp-rule"):
        parse_rule(text)


def test_drift_within_tolerance_is_taken_from_part_0_with_a_note(tmp_path):
    src = str(tmp_path / "src")
    write_synthetic_parts(src, 3, 2, 2, 8, drift=1e-7)
    res = ckptshard.consolidate(src, str(tmp_path / "full.pt"), mp_rules=[r"layers\.1\.weight$=1"], progress=False)
    assert any(n.startswith("norm.weight: differs between model parts") for n in res.notes)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    # One shard file names its part alone.
    ckptshard.consolidate(os.path.join(src, PARTS.format(0, 0)), str(tmp_path / "p.pt"), progress=False)
    first = torch.load(tmp_path / "p.pt", weights_only=True)
    assert torch.equal(full["norm.weight"], first["norm.weight"])
    assert full["layers.1.weight"].shape == (8, 24) and torch.equal(
        full["layers.1.weight"][:, 8:16], first["layers.1.weight"]
    )


def test_drift_beyond_tolerance_is_an_error(tmp_path):
    src = str(tmp_path / "src")
    write_synthetic_parts(src, 2, 2, 2, 8, drift=1e-3)
    with pytest.raises(ckptshard.CheckpointError, match=r"norm\.(weight|bias): differs between model parts 0 and 1"):
        ckptshard.consolidate(src, str(tmp_path / "full.pt"), mp_rules=["layers=0"], progress=False)
    assert not (tmp_path / "full.pt").exists()
    res = ckptshard.consolidate(src, str(tmp_path / "ok.pt"), mp_rules=["layers=0"], mp_tolerance=1e-2, progress=False)
    assert res.notes


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing_part", "model part 1 of 3 is missing"),
        ("world_size", "model part 1 has FSDP world size 3, part 0 has 2"),
        ("step", "model part 1 was saved at update 11, part 0 at 10"),
        ("mixed", "holds model-parallel parts and other shard files"),
    ],
)
def test_parts_that_do_not_belong_together(tmp_path, damage, message):
    src = str(tmp_path / "src")
    write_synthetic_parts(src, 3, 2, 2, 8)
    if damage == "missing_part":
        for r in range(2):
            os.remove(os.path.join(src, PARTS.format(1, r)))
    elif damage == "world_size":
        other = str(tmp_path / "other")
        write_synthetic_parts(other, 2, 3, 2, 8)
        for r in range(2):
            os.remove(os.path.join(src, PARTS.format(1, r)))
        for r in range(3):
            shutil.copy(os.path.join(other, PARTS.format(1, r)), src)
    elif damage == "step":
        for r in range(2):
            path = os.path.join(src, PARTS.format(1, r))
            obj = torch.load(path, weights_only=False)
            obj["optimizer_history"] = [{"num_updates": 11}]
            torch.save(obj, path)
    else:
        shutil.copy(os.path.join(src, PARTS.format(0, 0)), os.path.join(src, "checkpoint_last-rank-0-shard0.pt"))
    for args in (("inspect", src), ("reshard", src, "-n", "2", "-o", str(tmp_path / "out"))):
        res = _cli(*args)
        assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_rules_need_several_parts_and_a_plain_output(tmp_path):
    src = str(tmp_path / "src")
    write_synthetic_parts(src, 2, 2, 2, 8)
    with pytest.raises(ckptshard.CheckpointError, match="joining model parts writes a plain state dict"):
        ckptshard.consolidate(src, str(tmp_path / "f.pt"), mp_rules=["layers=0"], container=True, progress=False)
    from ckptshard.testing.synthetic import write_synthetic

    single = str(tmp_path / "single")
    write_synthetic(single, 2, 2, 8)
    with pytest.raises(ckptshard.CheckpointError, match="holds one model part"):
        ckptshard.consolidate(single, str(tmp_path / "g.pt"), mp_rules=["layers=0"], progress=False)
    with pytest.raises(ckptshard.CheckpointError, match="holds one model part"):
        ckptshard.reshard(single, str(tmp_path / "h"), 2, model_parallel=2, mp_rules=["layers=0"], progress=False)


def test_optimizer_state_joined_by_the_same_rules(run, tmp_path):
    from ckptshard.plan.optimizer import optimizer_param_names
    from ckptshard.read.source import open_checkpoint

    src, _ = run
    out = str(tmp_path / "full.pt")
    res = ckptshard.consolidate(src, out, mp_presets=["metaseq"], optimizer=True, progress=False)
    assert res.outputs == [out, str(tmp_path / "full.optim.pt")]
    optim = torch.load(tmp_path / "full.optim.pt", weights_only=False)
    oracle = torch.load(os.path.join(src, "ref", "gathered_moments.pt"), weights_only=True)
    names = optimizer_param_names(open_checkpoint(os.path.join(src, PARTS.format(0, 0))))
    assert len(optim["state"]) == len(names) == len(oracle["exp_avg"]) - 1  # the tied projection: one entry
    for gid, name in enumerate(names):
        entry = optim["state"][gid]
        assert entry["step"] == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[moment], oracle[moment][name]), (name, moment)


@pytest.mark.parametrize("k2, n", [(1, 3), (4, 1)])
def test_reshard_to_another_number_of_parts_is_what_fsdp_saves_there(run, tmp_path, k2, n):
    from ckptshard.plan.optimizer import optimizer_param_names
    from ckptshard.read.source import open_checkpoint

    src, _ = run
    out = tmp_path / "out"
    res = ckptshard.reshard(src, str(out), n, model_parallel=k2, mp_presets=["metaseq"], progress=False)
    assert sorted(res.files) == sorted(PARTS.format(j, r) for j in range(k2) for r in range(n))
    assert "cfg.model.model_parallel_size: 2 -> " + str(k2) in res.notes[0]
    fsdp_at(src, k2, n, str(tmp_path / "fsdp"))
    for j in range(k2):
        for r in range(n):
            ours = torch.load(out / PARTS.format(j, r), weights_only=False)
            theirs = torch.load(tmp_path / "fsdp" / f"part-{j}-shard{r}.pt", weights_only=True)
            assert sorted(ours["model"]) == sorted(theirs)
            assert all(torch.equal(ours["model"][x], theirs[x]) for x in theirs), (j, r)
            assert ours["cfg"]["model"]["model_parallel_size"] == k2
    # Back to one model: the same gathered weights and Adam moments.
    full = tmp_path / "full.pt"
    if k2 == 1:
        ckptshard.consolidate(str(out), str(full), optimizer=True, progress=False)
    else:
        ckptshard.consolidate(str(out), str(full), mp_presets=["metaseq"], optimizer=True, progress=False)
    gathered = torch.load(os.path.join(src, "ref", "gathered.pt"), weights_only=True)
    weights = torch.load(full, weights_only=True)
    assert sorted(weights) == sorted(gathered) and all(torch.equal(weights[k], gathered[k]) for k in gathered)
    optim = torch.load(tmp_path / "full.optim.pt", weights_only=False)
    moments = torch.load(os.path.join(src, "ref", "gathered_moments.pt"), weights_only=True)
    names = optimizer_param_names(open_checkpoint(str(out / PARTS.format(0, 0))))
    for gid, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][gid][moment], moments[moment][name]), (name, moment)


def test_another_number_of_parts_needs_rules_that_divide(run, tmp_path):
    src, _ = run
    with pytest.raises(ckptshard.CheckpointError, match="needs the rules"):
        ckptshard.reshard(src, str(tmp_path / "a"), 2, model_parallel=1, progress=False)
    with pytest.raises(ckptshard.CheckpointError, match="do not split into 3 parts|does not scale by 2/3"):
        ckptshard.reshard(src, str(tmp_path / "b"), 2, model_parallel=3, mp_presets=["metaseq"], progress=False)
    assert os.listdir(tmp_path) == []

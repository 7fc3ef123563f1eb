"""The command line: output, JSON, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from conftest import load_ref


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "ckptshard.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


def test_inspect_json(fixtures):
    res = cli("inspect", fixtures[3] / "vissl" / "model_phase2.torch", "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["container"]["kind"] == "vissl" and s["world_size"] == 3
    names = [
        p["name"] for part in s["parts"] for i in part["instances"] for fp in i["flat_params"] for p in fp["params"]
    ]
    full = load_ref(fixtures[3], "full_state_dict.pt")
    buffers = [b["name"] for part in s["parts"] for b in part["buffers"]]
    tied = [t[1] for part in s["parts"] for i in part["instances"] for t in i["tied"]]
    assert sorted(names + buffers + tied) == sorted(full)
    assert s["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    gate = next(
        fp
        for part in s["parts"]
        for i in part["instances"]
        for fp in i["flat_params"]
        if fp["key"] == "gate.flat_param_0"
    )
    assert gate["padding_per_rank"] == [0, 0, 0]  # 3 elements, 3 ranks


def test_inspect_text_accepts_one_shard_file(fixtures):
    res = cli("inspect", fixtures[4] / "metaseq" / "checkpoint_last-model_part-0-shard2.pt")
    assert res.returncode == 0, res.stderr
    assert "world size  4" in res.stdout and "metaseq" in res.stdout


def test_consolidate_and_reshard_commands(fixtures, tmp_path):
    res = cli("consolidate", fixtures[2] / "fairseq", "-o", tmp_path / "f.safetensors", "-q")
    assert res.returncode == 0, res.stderr
    assert "34 tensors" in res.stdout
    got = safetensors.torch.load_file(str(tmp_path / "f.safetensors"))
    assert set(got) == set(load_ref(fixtures[2], "full_state_dict.pt"))
    res = cli("reshard", fixtures[2] / "fairseq", "-n", "5", "-o", tmp_path / "r5", "-q")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "r5").iterdir()) == [f"checkpoint_last-shard{r}.pt" for r in range(5)] + [
        "ckptshard-manifest.json"
    ]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["inspect", "{tmp}/nothing-here"], "does not exist"),
        (["consolidate", "{fx}/fairseq", "-o", "{tmp}/out.txt"], "cannot tell the format"),
        (["consolidate", "{fx}/fairseq", "-o", "{fx}/fairseq/checkpoint_last-shard0.pt"], "overwrite the input"),
        (
            ["reshard", "{fx}/fairseq", "-n", "0", "-o", "{tmp}/r"],
            "--world-size must be between 1 and 1,048,576, got 0",
        ),
        (["consolidate", "{fx}/fairseq", "-o", "{tmp}/no/such/dir/x.pt"], "does not exist"),
        (["reshard", "{fx}/fairseq", "-n", "4", "--shard-group", "2", "-o", "{tmp}/r"], "for torch FSDP2 per-rank"),
        (["reshard", "{fx}/fairseq", "-n", "4", "--mesh-dim-names", "fsdp", "-o", "{tmp}/r"], "for torch FSDP2"),
    ],
)
def test_errors_are_one_line_with_exit_2(fixtures, tmp_path, args, needle):
    args = [a.format(tmp=tmp_path, fx=fixtures[2]) for a in args]
    res = cli(*args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    # One error line (click adds its usage hint above argument errors).
    assert [line for line in res.stderr.splitlines() if line.startswith("Error:")] == [
        res.stderr.strip().splitlines()[-1]
    ]


def test_existing_output_needs_overwrite_and_only_ckptshard_outputs_are_replaced(fixtures, tmp_path):
    out = tmp_path / "x.pt"
    out.write_bytes(b"keep me")
    res = cli("consolidate", fixtures[2] / "fairseq", "-o", out, "-q")
    assert res.returncode == 2 and "--overwrite" in res.stderr
    assert out.read_bytes() == b"keep me"
    res = cli("consolidate", fixtures[2] / "fairseq", "-o", out, "-q", "--overwrite")  # not ckptshard's: kept
    assert res.returncode == 2 and "replaces only what ckptshard wrote" in res.stderr, res.stderr
    assert out.read_bytes() == b"keep me"
    out.unlink()
    assert cli("consolidate", fixtures[2] / "fairseq", "-o", out, "-q").returncode == 0
    res = cli("consolidate", fixtures[3] / "fairseq", "-o", out, "-q", "--overwrite")  # its own output: replaced
    assert res.returncode == 0, res.stderr
    assert set(torch.load(out, weights_only=True)) == set(load_ref(fixtures[3], "full_state_dict.pt"))
    assert json.loads((tmp_path / "x.pt.manifest.json").read_text())["source"]["world_size"] == 3


def test_help_explains_commands():
    res = cli("--help")
    assert res.returncode == 0
    for cmd in ("inspect", "consolidate", "reshard", "shard"):
        assert cmd in res.stdout


def test_reshard_to_one_rank_says_which_readers_cannot_take_it(fixtures, tmp_path):
    """The note is true: fairscale's consolidate_shard_weights fails on FSDP's own world-size-1 layout."""
    from fairscale.nn import FullyShardedDataParallel as FSDP

    res = cli("reshard", fixtures[2] / "fairseq", "-n", "1", "-o", tmp_path / "one")
    assert res.returncode == 0, res.stderr
    assert "consolidate_shard_weights" in res.stderr and "ckptshard consolidate" in res.stderr
    shard = torch.load(tmp_path / "one" / "checkpoint_last-shard0.pt", weights_only=True)
    with pytest.raises(Exception):  # noqa: B017 - fairscale fails in more than one way on these files
        FSDP.consolidate_shard_weights([shard["model"]], [shard["fsdp_metadata"]])
    assert "note:" not in cli("reshard", fixtures[2] / "fairseq", "-n", "3", "-o", tmp_path / "three").stderr

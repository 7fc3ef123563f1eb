"""consolidate --select/--strip-prefix/--rename/--dtype."""

import subprocess
import sys

import pytest
import safetensors.torch
import torch
from conftest import load_ref

from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate


def test_trunk_only_with_plain_names(fixtures, tmp_path):
    out = tmp_path / "trunk.safetensors"
    consolidate(
        str(fixtures[3] / "vissl" / "model_phase2.torch"),
        str(out),
        select=["trunk."],
        strip_prefix=["trunk."],
        rename=["embed_in=stem.conv", "blocks.=layer"],
        progress=False,
    )
    got = safetensors.torch.load_file(str(out))
    full = load_ref(fixtures[3], "full_state_dict.pt")
    want = {
        k[len("trunk.") :].replace("embed_in", "stem.conv").replace("blocks.", "layer"): v
        for k, v in full.items()
        if k.startswith("trunk.")
    }
    assert set(got) == set(want) and "layer0.fc.weight" in got and "stem.conv.weight" in got
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_casts_floats_keeps_integers_and_ties(fixtures, tmp_path, dtype, torch_dtype):
    out = tmp_path / "half.pt"
    consolidate(str(fixtures[2] / "fairseq"), str(out), dtype=dtype, progress=False)
    got = torch.load(out, weights_only=True)
    full = load_ref(fixtures[2], "full_state_dict.pt")
    for k, v in full.items():
        if v.is_floating_point():
            assert got[k].dtype == torch_dtype and torch.equal(got[k], v.to(torch_dtype)), k
        else:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    a, b = got["trunk.embed_out.weight"], got["trunk.embed_in.weight"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_collisions_and_bad_options_refused(fixtures, tmp_path):
    src = str(fixtures[2] / "fairseq")
    with pytest.raises(CheckpointError, match="would both be named"):
        consolidate(src, str(tmp_path / "x.pt"), rename=["weight=w", "bias=w"], progress=False)
    with pytest.raises(CheckpointError, match="matches no tensor"):
        consolidate(src, str(tmp_path / "x.pt"), select=["nope."], progress=False)
    with pytest.raises(CheckpointError, match="not with --container"):
        consolidate(src, str(tmp_path / "x.pt"), select=["trunk."], container=True, progress=False)
    assert list(tmp_path.iterdir()) == []
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptshard.cli",
            "consolidate",
            src,
            "-o",
            str(tmp_path / "y.pt"),
            "--rename",
            "noequals",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "expected FROM=TO" in res.stderr

"""shard: full state dict + a template's wrapping -> N shards, equal to real FSDP at N."""

import pytest
import torch
from conftest import CONTAINERS, src_of
from test_reshard import (
    assert_optim_equal,
    assert_tensors_equal,
    optim_of,
    parts_of,
    rank_file,
)

from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard, shard


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("fmt", [".pt", ".safetensors"])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_shard_of_consolidated_equals_reshard(fixtures, container, fmt, n, tmp_path):
    # reshard is checked against real FSDP at N (test_reshard); shard must give the same files.
    src = src_of(fixtures[4], container)
    full = str(tmp_path / f"full{fmt}")
    consolidate(src, full, optimizer=fmt == ".pt", progress=False)
    optim = str(tmp_path / "full.optim.pt") if fmt == ".pt" else None
    shard(full, src, str(tmp_path / "s"), n, optimizer=optim, progress=False)
    reshard(src, str(tmp_path / "r"), n, progress=False)
    for r in range(n):
        a, b = rank_file(tmp_path / "s", container, r), rank_file(tmp_path / "r", container, r)
        for (aw, am), (bw, bm) in zip(parts_of(a, container), parts_of(b, container)):
            assert_tensors_equal(aw, bw, f"rank {r}")
            assert am == bm
        if optim:
            assert_optim_equal(optim_of(a, container), optim_of(b, container), f"rank {r}", flat_ok=n == 1)


def test_shard_refuses_mismatched_names_and_shapes(fixtures, tmp_path):
    src = str(fixtures[2] / "fairseq")
    full = str(tmp_path / "full.pt")
    consolidate(src, full, progress=False)
    sd = torch.load(full, weights_only=True)
    sd["trunk.gate.scale"] = torch.zeros(4)
    del sd["heads.0.prototypes1.weight"]
    sd["surprise.weight"] = torch.zeros(1)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        shard(str(tmp_path / "bad.pt"), src, str(tmp_path / "out"), 3, progress=False)
    msg = str(e.value)
    assert "heads.0.prototypes1.weight" in msg and "trunk.gate.scale [4]" in msg and "surprise.weight" in msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", [".pt", ".safetensors"])
def test_shard_imports_no_torch_and_equals_the_torch_reader(fixtures, fmt, tmp_path, monkeypatch):
    import subprocess
    import sys

    from test_dcp import _assert_tree_equal

    src = src_of(fixtures[3], "fairseq")
    full = str(tmp_path / f"full{fmt}")
    consolidate(src, full, optimizer=fmt == ".pt", progress=False)
    opt = ["--optimizer", str(tmp_path / "full.optim.pt")] if fmt == ".pt" else []
    code = (
        "import sys; from ckptshard.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    args = ["shard", full, "--like", src, "-n", "2", "-q", *opt]
    res = subprocess.run(
        [sys.executable, "-c", code, *args, "-o", str(tmp_path / "free")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "NO-TORCH"
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    shard(full, src, str(tmp_path / "torch"), 2, optimizer=opt[1] if opt else None, progress=False)
    for r in range(2):
        name = f"checkpoint_last-shard{r}.pt"
        _assert_tree_equal(
            torch.load(tmp_path / "free" / name, weights_only=True),
            torch.load(tmp_path / "torch" / name, weights_only=True),
            name,
        )

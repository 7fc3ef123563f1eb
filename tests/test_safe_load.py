"""Shards are never unpickled with arbitrary code unless the user opts in."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from ckptshard.errors import CheckpointError
from ckptshard.read.safe_load import load_lazy
from ckptshard.read.tensor_data import read_flat, read_tensor
from ckptshard.tensors import TensorRef


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_pickle_is_refused_naming_the_global(tmp_path):
    p = tmp_path / "evil-shard0.pt"
    torch.save({"model": {}, "payload": Evil()}, p)
    with pytest.raises(CheckpointError) as e:
        load_lazy(str(p))
    assert "posix.system" in str(e.value) or "os.system" in str(e.value)
    assert "--trust-pickles" in str(e.value)


def test_trust_pickles_opt_in_warns(tmp_path):
    p = tmp_path / "ns.pt"
    torch.save({"x": torch.ones(2), "obj": pickle.loads(pickle.dumps(ValueError("a")))}, p)
    with pytest.raises(CheckpointError):
        load_lazy(str(p))
    with pytest.warns(UserWarning, match="trust-pickles"):
        obj = load_lazy(str(p), trust_pickles=True)
    assert isinstance(obj["x"], TensorRef) and torch.equal(read_tensor(obj["x"]), torch.ones(2))


def test_metadata_globals_load_safely(fixtures):
    obj = load_lazy(str(fixtures[2] / "fairseq" / "checkpoint_last-shard0.pt"))
    shapes = obj["fsdp_metadata"]["param_metadata"][1]["params"]["flat_param_0"]["shapes"]
    assert isinstance(shapes[0], torch.Size)


def test_refs_read_exact_slices(tmp_path):
    t = torch.arange(100, dtype=torch.float64)
    torch.save({"t": t, "v": t[10:20], "b": torch.zeros(3, dtype=torch.bfloat16)}, tmp_path / "x.pt")
    obj = load_lazy(str(tmp_path / "x.pt"))
    assert torch.equal(read_flat(obj["t"], 37, 61), t[37:61])
    assert torch.equal(read_tensor(obj["v"]), t[10:20])
    assert obj["b"].dtype == torch.bfloat16 and read_tensor(obj["b"]).shape == (3,)


def test_cli_refuses_pickle_with_exit_2(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    torch.save(
        {"model": {}, "fsdp_metadata": {"param_metadata": [], "buffer_names": []}, "x": Evil()},
        d / "checkpoint-shard0.pt",
    )
    res = subprocess.run([sys.executable, "-m", "ckptshard.cli", "inspect", str(d)], capture_output=True, text=True)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "--trust-pickles" in res.stderr


def test_cli_trust_pickles_for_numpy_rng_state(fixtures, tmp_path):
    # Training loops often save numpy/random RNG state beside the model: safe loading refuses it with
    # a pointer to --trust-pickles, which then converts, saying so in one line per file.
    import numpy as np

    src = tmp_path / "src"
    src.mkdir()
    for r in range(2):
        d = torch.load(fixtures[2] / "fairseq" / f"checkpoint_last-shard{r}.pt", weights_only=False)
        d["extra_state"]["rng"] = {"numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        torch.save(d, src / f"checkpoint_last-shard{r}.pt")
    cmd = [sys.executable, "-m", "ckptshard.cli", "consolidate", str(src), "-o", str(tmp_path / "out.pt"), "-q"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 2 and "--trust-pickles" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out.pt").exists()
    res = subprocess.run(cmd + ["--trust-pickles"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if "full unpickling" in line]
    assert len(warned) == 2 and all(line.startswith("warning: ") for line in warned), res.stderr
    assert "warnings.warn" not in res.stderr and "UserWarning" not in res.stderr
    want = torch.load(fixtures[2] / "ref" / "full_state_dict.pt", weights_only=True)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)

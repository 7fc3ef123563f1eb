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


@pytest.fixture
def old_torch(monkeypatch):
    """torch up to 2.5 (meta tensors carry no offset) and before 2.4 (no way to widen the weights-only list)."""
    from ckptshard.read import safe_load
    from ckptshard.write import torch_file

    monkeypatch.setattr(safe_load, "torch_gives_offsets", lambda: False)
    monkeypatch.setattr(torch_file, "torch_gives_offsets", lambda: False)
    monkeypatch.setattr(torch_file, "torch_skips_data", lambda: False)
    monkeypatch.delattr(torch.serialization, "safe_globals")
    monkeypatch.delattr(torch.serialization, "add_safe_globals")


def test_offsets_come_from_ckptshards_reader_where_torch_gives_none(tmp_path, old_torch):
    """The reliance that broke ``verify``, ``--trust-pickles`` and the torch reader on torch 2.0-2.5."""
    import argparse

    want = {"w": torch.arange(12.0).reshape(3, 4)[:, 1:], "b": torch.arange(5, dtype=torch.int64)}
    torch.save({"model": want, "args": argparse.Namespace(lr=0.1)}, tmp_path / "a.pt")
    for trust in (False, True):
        got = load_lazy(str(tmp_path / "a.pt"), trust_pickles=trust)
        assert got["args"].lr == 0.1 and got["model"]["w"].dtype is torch.float32  # torch's dtypes, as torch gives
        for k, v in want.items():
            assert torch.equal(read_tensor(got["model"][k]), v)


def test_a_file_torch_and_ckptshard_read_differently_is_refused(tmp_path, old_torch, monkeypatch):
    from ckptshard.read import safe_load

    torch.save({"w": torch.ones(3)}, tmp_path / "a.pt")
    real = safe_load.read_torch_zip
    monkeypatch.setattr(safe_load, "read_torch_zip", lambda *a, **k: {"w": real(*a, **k)["w"], "x": 1})
    with pytest.raises(CheckpointError, match="unpickle different trees"):
        load_lazy(str(tmp_path / "a.pt"), trust_pickles=True)


def test_commands_on_torch_up_to_2_5(fixtures, tmp_path, old_torch, monkeypatch):
    """consolidate through torch's reader, and a reshard written by torch's own writer, as torch 2.0-2.5 run them."""
    from ckptshard.execute.consolidate import consolidate
    from ckptshard.execute.reshard import reshard
    from ckptshard.execute.verify import verify

    src = str(fixtures[2] / "fairseq")
    ref = torch.load(fixtures[2] / "ref" / "full_state_dict.pt", weights_only=True)
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    reshard(src, str(tmp_path / "r3"), 3, progress=False)
    assert verify(str(tmp_path / "r3")) == []
    consolidate(str(tmp_path / "r3"), str(tmp_path / "full.pt"), progress=False)
    got = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def test_repeated_values_reads_only_what_could_repeat(tmp_path, monkeypatch):
    """Ties found by value: same shape, dtype and bytes; a tensor whose shape nothing else has is not read,
    and one whose first bytes differ from every other's is not read whole."""
    from ckptshard.read import tensor_data
    from ckptshard.read.full_state import full_state_refs
    from ckptshard.tensors import whole

    a = torch.arange(4096, dtype=torch.float32)
    late = a.clone()
    late[-1] = -1.0  # the same first bytes, another tensor
    torch.save({"a": a, "b": torch.ones(3), "tied": a.clone(), "late": late, "other": a + 1}, tmp_path / "sd.pt")
    refs = full_state_refs(str(tmp_path / "sd.pt"))
    calls = []
    real = tensor_data.fill_digest
    monkeypatch.setattr(
        tensor_data, "fill_digest", lambda f, limit=None: calls.append((f.shape, limit)) or real(f, limit)
    )
    found = tensor_data.repeated_values([(n, whole(r)) for n, r in refs.items()], probe=64)
    assert found == {"tied": "a"}
    assert ((3,), 64) not in calls and ((3,), None) not in calls  # "b": no other tensor of its shape
    assert sum(1 for c in calls if c[1] is None) == 3  # whole: a, tied, late (other's first bytes differ)


class _Marks:
    """Unpickled with its code, it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


SCHEDULER = {"last_epoch": 3, "_last_lr": [0.1, 0.01], "base_lrs": [1.0, 0.1], "_step_count": 4}


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize(
    "layout",
    [
        (
            "fairscale",
            "checkpoint_last-shard0.pt",
            lambda s, p: {"optimizer_history": [{"lr_scheduler_state": s}], "x": p},
        ),
        (
            "fairscale",
            "model_iteration_shard0.torch",
            lambda s, p: {"classy_state_dict": {"lr_scheduler": s}, "p": p},
        ),
        ("fsdp2", "extra_state_world_size_2_rank_0.pt", lambda s, p: {"lr_scheduler": s, "rng": {"numpy": p}}),
    ],
    ids=["fairseq", "vissl", "verl"],
)
def test_the_scheduler_state_is_read_without_running_what_lies_beside_it(tmp_path, layout, legacy):
    from ckptshard.harness.frameworks import scheduler_state

    framework, name, build = layout
    marker = tmp_path / "payload-ran"
    state = build({**SCHEDULER, "t": torch.arange(3.0)}, _Marks(marker))
    torch.save(state, tmp_path / name, _use_new_zipfile_serialization=not legacy)
    got = scheduler_state(framework, str(tmp_path))
    assert not marker.exists(), "a pickled payload ran"
    assert torch.equal(got.pop("t"), torch.arange(3.0)) and got == SCHEDULER


def test_a_scheduler_state_holding_pickled_code_is_refused_unless_trusted(tmp_path):
    from ckptshard.harness.frameworks import scheduler_state

    marker = tmp_path / "payload-ran"
    torch.save({"lr_scheduler": {**SCHEDULER, "fn": _Marks(marker)}}, tmp_path / "extra_state_world_size_1_rank_0.pt")
    with pytest.raises(CheckpointError, match=r"lr_scheduler: holds a pickled io.open.*--trust-pickles"):
        scheduler_state("fsdp2", str(tmp_path))
    assert not marker.exists(), "a pickled payload ran"
    scheduler_state("fsdp2", str(tmp_path), trust_pickles=True)  # the user's own file: torch.load runs it
    assert marker.exists()

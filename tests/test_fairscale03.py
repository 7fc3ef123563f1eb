"""fairscale 0.3.x shards (VISSL's pip wheel bundles 0.3.7): another metadata shape, read and written back.

tests/data/fairscale037 is a real fairscale 0.3.7 run (torch 1.13.1, two ranks,
made by scripts/make_fairscale037_fixture.py): a flat root, a flat nested
instance and an unflattened one. Its ws3/ holds what FSDP 0.3.7 at three
ranks saved after loading the run's full state dict.
"""

import pathlib

import pytest
import torch

import ckptshard

DATA = pathlib.Path(__file__).parent / "data" / "fairscale037"


def _load(path):
    return torch.load(path, weights_only=True)


def test_consolidate_equals_its_live_state_dict(tmp_path):
    ckptshard.consolidate(str(DATA), str(tmp_path / "full.pt"), progress=False)
    got, want = _load(tmp_path / "full.pt"), _load(DATA / "full_state_dict.pt")
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("r", range(3))
def test_reshard_writes_what_fairscale_0_3_7_at_three_saves(tmp_path, r):
    ckptshard.reshard(str(DATA), str(tmp_path / "r3"), 3, progress=False)
    ours = _load(tmp_path / "r3" / f"checkpoint_last-shard{r}.pt")
    theirs = _load(DATA / "ws3" / f"checkpoint_last-shard{r}.pt")
    assert set(ours["model"]) == set(theirs["model"])
    for k, v in theirs["model"].items():
        assert torch.equal(ours["model"][k], v), k
    assert ours["fsdp_metadata"] == theirs["fsdp_metadata"]  # 0.3's shape: is_flat, param_names, num_padded
    assert "params" not in ours["fsdp_metadata"]["param_metadata"][0]


def test_optimizer_state_survives_a_reshard_round_trip(tmp_path):
    ckptshard.consolidate(str(DATA), str(tmp_path / "a.pt"), optimizer=True, progress=False)
    ckptshard.reshard(str(DATA), str(tmp_path / "r3"), 3, progress=False)
    ckptshard.consolidate(str(tmp_path / "r3"), str(tmp_path / "b.pt"), optimizer=True, progress=False)
    a, b = _load(tmp_path / "a.optim.pt"), _load(tmp_path / "b.optim.pt")
    assert a["param_groups"] == b["param_groups"] and set(a["state"]) == set(b["state"])
    for i, entry in a["state"].items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(b["state"][i][k]), torch.as_tensor(v)), (i, k)

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


TIED = DATA / "tied"  # 0.3.7 shards of a model whose tied.2.weight is tied.0.weight (see the script)


def test_a_tie_0_3_does_not_record_is_named_in_a_note(tmp_path):
    res = ckptshard.consolidate(str(TIED), str(tmp_path / "full.pt"), progress=False)
    assert len(res.notes) == 1 and "do not record shared parameters" in res.notes[0]
    assert "perhaps tied.2.weight;" in res.notes[0] and "--like" in res.notes[0]
    live = _load(TIED / "full_state_dict.pt")
    assert set(live) - set(_load(tmp_path / "full.pt")) == {"tied.2.weight"}


def test_like_restores_the_tie_as_the_live_state_dict_has_it(tmp_path):
    res = ckptshard.consolidate(str(TIED), str(tmp_path / "full.pt"), like=str(TIED / "like.pt"), progress=False)
    assert res.notes == ["restored from --like: tied.2.weight (tied to tied.0.weight)"]
    got, want = _load(tmp_path / "full.pt"), _load(TIED / "full_state_dict.pt")
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got["tied.2.weight"].data_ptr() == got["tied.0.weight"].data_ptr()  # one tensor, as in the model
    assert ckptshard.verify(str(tmp_path / "full.pt")) == []


def test_like_of_another_model_or_without_ties_is_one_line(tmp_path):
    from safetensors.torch import save_file

    like = _load(TIED / "like.pt")
    other = {k: v for k, v in like.items() if k != "scale.bias"}
    torch.save(other, tmp_path / "other.pt")
    save_file({k: v.clone() for k, v in like.items()}, tmp_path / "like.safetensors")  # stores no ties
    cases = {
        "other.pt": "has no 'scale.bias'",
        "like.safetensors": "does not tie it to a tensor",
    }
    for name, said in cases.items():
        with pytest.raises(ckptshard.CheckpointError, match=said) as e:
            ckptshard.consolidate(str(TIED), str(tmp_path / "out.pt"), like=str(tmp_path / name), progress=False)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(ckptshard.CheckpointError, match="fairscale 0.3 shards, not these"):
        ckptshard.consolidate(str(DATA.parent / "golden" / "in"), str(tmp_path / "o.pt"), like=str(TIED / "like.pt"))

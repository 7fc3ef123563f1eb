"""Frozen parameters: an optimizer over the trainable parameters only (a frozen trunk, linear evaluation).

FSDP then numbers fewer optimizer entries than flat parameters, and the
checkpoint does not say which were frozen. fairscale's own
``gather_full_optim_state_dict`` takes entry k for instance k and fails (or,
where sizes happen to agree, mislabels the state), so it is no oracle here.
The oracles are real FSDP training resumed from the resharded files (the
verify-resume scenario "frozen trunk", in test_verify_resume.py), the live
``state_dict()``, and two independent plans agreeing: reshard M->N against
consolidate --optimizer then shard --optimizer to N.
"""

import shutil

import pytest
import torch
from conftest import load_ref, src_of

from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard, shard

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

FAIRSEQ = "checkpoint_last-shard{}.pt"


def _osd(folder, rank):
    return torch.load(folder / FAIRSEQ.format(rank), weights_only=True)["last_optimizer_state"]


def test_consolidated_optimizer_names_only_the_trainable_parameters(frozen_fixture, tmp_path):
    out = tmp_path / "full.pt"
    consolidate(src_of(frozen_fixture, "fairseq"), str(out), optimizer=True, progress=False)
    full = load_ref(frozen_fixture, "full_state_dict.pt")
    loaded = torch.load(out, weights_only=True)
    assert {k: torch.equal(v, full[k]) for k, v in loaded.items()} == dict.fromkeys(full, True)
    optim = torch.load(tmp_path / "full.optim.pt", weights_only=True)
    # Global ids follow the live model's parameters (tied ones once); the trunk's have no entry.
    params = [n for n, p in _named_params(full) if not n.startswith("trunk.embed_out.weight")]
    trainable = [i for i, n in enumerate(params) if n.startswith("heads.")]
    assert sorted(optim["state"]) == trainable
    assert {g for g, lid in optim["param_id_map"].items() if lid is not None} == set(trainable)
    for g in trainable:  # moments in the parameter's shape (prototypes: 1-D, fairscale's unflattened rule)
        assert optim["state"][g]["exp_avg"].numel() == full[params[g]].numel()


def _named_params(full):
    return [
        (k, v)
        for k, v in full.items()
        if not (k.endswith("running_mean") or k.endswith("running_var") or k.endswith("num_batches_tracked"))
    ]


def test_reshard_equals_consolidate_then_shard(frozen_fixture, tmp_path):
    src = src_of(frozen_fixture, "fairseq")
    reshard(src, str(tmp_path / "rs"), 3, progress=False)
    consolidate(src, str(tmp_path / "full.pt"), optimizer=True, progress=False)
    shard(
        str(tmp_path / "full.pt"),
        src,
        str(tmp_path / "sh"),
        3,
        optimizer=str(tmp_path / "full.optim.pt"),
        progress=False,
    )
    for r in range(3):
        a, b = _osd(tmp_path / "rs", r), _osd(tmp_path / "sh", r)
        assert a["param_groups"][0]["params"] == b["param_groups"][0]["params"] == [0, 1, 2]
        assert sorted(a["state"]) == sorted(b["state"]) == [0, 1, 2]
        for pid, entry in a["state"].items():
            for k, v in entry.items():
                if k != "step":  # a 0-dim tensor here, a float from the full format (as fairscale's)
                    assert torch.equal(v, b["state"][pid][k]), (r, pid, k)


def _drop_entry(folder, flat_index, world_size=2):
    """Remove optimizer entry ``flat_index`` from every rank and renumber: as if that instance were frozen."""
    for r in range(world_size):
        path = folder / FAIRSEQ.format(r)
        obj = torch.load(path, weights_only=True)
        osd = obj["last_optimizer_state"]
        state = osd["state"]
        osd["state"] = {(k if k < flat_index else k - 1): v for k, v in state.items() if k != flat_index}
        osd["param_groups"][0]["params"] = list(range(len(osd["param_groups"][0]["params"]) - 1))
        torch.save(obj, path)


def test_equal_sized_candidates_reshard_but_do_not_consolidate(next_step_fixture, tmp_path):
    # trunk, trunk.blocks.0 and trunk.blocks.1 hold 180 elements each: dropping blocks.0's entry leaves
    # an entry that fits any of them. Resharding needs only the size; consolidating needs the name.
    src = tmp_path / "src"
    shutil.copytree(src_of(next_step_fixture, "fairseq"), src)
    _drop_entry(src, 2)
    with pytest.raises(
        CheckpointError, match="fits several of them .*trunk.blocks.0.flat_param_0.*cannot tell which parameter"
    ):
        consolidate(str(src), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    reshard(str(src), str(tmp_path / "rs"), 3, progress=False)
    assert len(_osd(tmp_path / "rs", 0)["state"]) == len(_osd(src, 0)["state"])


def test_state_that_fits_no_choice_of_parameters_is_refused(next_step_fixture, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(src_of(next_step_fixture, "fairseq"), src)
    _drop_entry(src, 2)
    for r in range(2):  # the last entry now has a size no flat parameter has
        path = src / FAIRSEQ.format(r)
        obj = torch.load(path, weights_only=True)
        last = max(obj["last_optimizer_state"]["state"])
        obj["last_optimizer_state"]["state"][last]["exp_avg"] = torch.zeros(7777)
        obj["last_optimizer_state"]["state"][last]["exp_avg_sq"] = torch.zeros(7777)
        torch.save(obj, path)
    with pytest.raises(CheckpointError, match="no in-order choice of them per group has the sizes of its state"):
        reshard(str(src), str(tmp_path / "rs"), 3, progress=False)
    assert not (tmp_path / "rs").exists()


def test_no_optimizer_reshards_the_weights_alone(frozen_fixture, tmp_path):
    reshard(src_of(frozen_fixture, "fairseq"), str(tmp_path / "rs"), 3, progress=False, optimizer=False)
    obj = torch.load(tmp_path / "rs" / FAIRSEQ.format(0), weights_only=True)
    assert "last_optimizer_state" not in obj and obj["model"] and obj["cfg"]


def test_dcp_round_trip_equals_reshard(frozen_fixture, tmp_path):
    from ckptshard.execute.convert import convert

    src = src_of(frozen_fixture, "fairseq")
    convert(src, str(tmp_path / "ckpt.dcp"), "dcp", progress=False)
    convert(str(tmp_path / "ckpt.dcp"), str(tmp_path / "back"), "fairscale", like=src, world_size=3, progress=False)
    reshard(src, str(tmp_path / "rs"), 3, progress=False)
    for r in range(3):
        a = torch.load(tmp_path / "back" / FAIRSEQ.format(r), weights_only=True)
        b = torch.load(tmp_path / "rs" / FAIRSEQ.format(r), weights_only=True)
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
        oa, ob = a["last_optimizer_state"], b["last_optimizer_state"]
        assert oa["param_groups"][0]["params"] == [0, 1, 2] and oa["state"].keys() == ob["state"].keys()
        for pid, entry in ob["state"].items():
            for k, v in entry.items():
                assert torch.equal(torch.as_tensor(oa["state"][pid][k]), v), (r, pid, k)


def test_inspect_counts_the_frozen_flat_parameters(frozen_fixture, next_step_fixture):
    from ckptshard.execute.inspect import format_summary, inspect_checkpoint

    summary = inspect_checkpoint(src_of(frozen_fixture, "fairseq"))
    frozen = summary["optimizer"]
    assert frozen["entries"] == 3 and frozen["flat_params_not_in_optimizer"] == 4
    assert "4 flat parameters not in it (frozen)" in format_summary(summary)
    whole = inspect_checkpoint(src_of(next_step_fixture, "fairseq"))["optimizer"]
    assert whole["flat_params_not_in_optimizer"] == 0

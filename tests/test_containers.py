"""Containers other than fairseq/metaseq/VISSL: found by their FSDP metadata, wherever it sits.

The shards are the real FSDP fixture's, re-saved under other keys (as a
user's own training loop would save them); every result must equal what the
same data gives in the fairseq container, which the other tests hold to live
fairscale.
"""

import os

import pytest
import safetensors.torch
import torch
from conftest import src_of

from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.inspect import inspect_checkpoint
from ckptshard.execute.reshard import reshard
from ckptshard.read.source import open_checkpoint

WS = 3


def _fairseq(fixtures, rank):
    return torch.load(fixtures[WS] / "fairseq" / f"checkpoint_last-shard{rank}.pt", weights_only=True)


def _vissl(fixtures, rank):
    return torch.load(fixtures[WS] / "vissl" / f"model_phase2_shard{rank}.torch", weights_only=True)


def docs_style(f, v):
    """fairscale's own docs: weights and metadata side by side, no optimizer."""
    return {"weights": f["model"], "meta": f["fsdp_metadata"]}


def nested(f, v):
    """A training loop's own names, nested, with the optimizer one level down."""
    return {
        "run": {"net": f["model"], "net_fsdp": f["fsdp_metadata"]},
        "opt": {"adam": f["last_optimizer_state"]},
        "step": 3,
    }


def two_roots(f, v):
    """Two FSDP roots side by side (trunk and head, as VISSL wraps them), under a user's names."""
    base = v["classy_state_dict"]["base_model"]
    return {
        "trunk": base["model"]["trunk"],
        "trunk_meta": base["meta"]["trunk"],
        "heads": base["model"]["heads"][0],
        "heads_meta": base["meta"]["heads"][0],
        "optimizer": v["classy_state_dict"]["optimizer"]["optim"],
    }


LAYOUTS = {"docs_style": docs_style, "nested": nested, "two_roots": two_roots}


def write_layout(fixtures, tmp_path, name, file_name="ckpt-shard{}.pt"):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    for r in range(WS):
        torch.save(LAYOUTS[name](_fairseq(fixtures, r), _vissl(fixtures, r)), folder / file_name.format(r))
    return folder


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_generic_container_consolidates_like_fairseq(fixtures, tmp_path, name):
    src = write_layout(fixtures, tmp_path, name)
    consolidate(str(src), str(tmp_path / "got.safetensors"), progress=False)
    consolidate(src_of(fixtures[WS], "fairseq"), str(tmp_path / "want.safetensors"), progress=False)
    got = safetensors.torch.load_file(tmp_path / "got.safetensors")
    want = safetensors.torch.load_file(tmp_path / "want.safetensors")
    if name == "two_roots":  # each root's names take its key as prefix: "heads." where VISSL has "heads.0."
        want = {k.replace("heads.0.", "heads.", 1): v for k, v in want.items()}
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_detected_paths(fixtures, tmp_path):
    c = open_checkpoint(str(write_layout(fixtures, tmp_path, "nested"))).container
    assert c.kind == "plain"
    assert [(p.weights, p.metadata) for p in c.parts] == [(("run", "net"), ("run", "net_fsdp"))]
    assert c.optimizer == ("opt", "adam")
    two = open_checkpoint(str(write_layout(fixtures, tmp_path, "two_roots"))).container
    assert [(p.label, p.prefix, p.metadata) for p in two.parts] == [
        ("trunk", "trunk.", ("trunk_meta",)),
        ("heads", "heads.", ("heads_meta",)),
    ]
    assert two.optimizer == ("optimizer",)
    assert open_checkpoint(str(write_layout(fixtures, tmp_path, "docs_style"))).container.optimizer is None


def _assert_tensor_dicts_equal(got, want, what):
    assert list(got) == list(want), what
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (what, k)


def _assert_optim_equal(got, want, what):
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for pid, s in want["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(got["state"][pid][k]), torch.as_tensor(v)), (what, pid, k)


def resharded_pairs(fixtures, tmp_path, layout, container, want_name):
    """Rank by rank at world size 2: (the generic layout resharded, the same data resharded in ``container``)."""
    reshard(str(write_layout(fixtures, tmp_path, layout)), str(tmp_path / "got"), 2, progress=False)
    reshard(src_of(fixtures[WS], container), str(tmp_path / "want"), 2, progress=False)
    for r in range(2):
        yield (
            r,
            (
                torch.load(tmp_path / "got" / f"ckpt-shard{r}.pt", weights_only=True),
                torch.load(tmp_path / "want" / want_name.format(r), weights_only=True),
            ),
        )


def test_nested_container_reshards_like_fairseq(fixtures, tmp_path):
    for r, (got, want) in resharded_pairs(fixtures, tmp_path, "nested", "fairseq", "checkpoint_last-shard{}.pt"):
        assert got.keys() == {"run", "opt", "step"} and got["step"] == 3
        _assert_tensor_dicts_equal(got["run"]["net"], want["model"], r)
        assert got["run"]["net_fsdp"] == want["fsdp_metadata"]
        _assert_optim_equal(got["opt"]["adam"], want["last_optimizer_state"], r)


def test_two_roots_reshard_like_vissl(fixtures, tmp_path):
    for r, (got, want) in resharded_pairs(fixtures, tmp_path, "two_roots", "vissl", "model_phase2_shard{}.torch"):
        base = want["classy_state_dict"]["base_model"]
        _assert_tensor_dicts_equal(got["trunk"], base["model"]["trunk"], r)
        _assert_tensor_dicts_equal(got["heads"], base["model"]["heads"][0], r)
        assert got["trunk_meta"] == base["meta"]["trunk"] and got["heads_meta"] == base["meta"]["heads"][0]
        _assert_optim_equal(got["optimizer"], want["classy_state_dict"]["optimizer"]["optim"], r)


def test_two_roots_reshard_round_trip(fixtures, tmp_path):
    """3 -> 2 -> consolidate equals consolidating the source: both roots, every tensor."""
    src = write_layout(fixtures, tmp_path, "two_roots")
    reshard(str(src), str(tmp_path / "two"), 2, progress=False)
    consolidate(str(tmp_path / "two"), str(tmp_path / "a.safetensors"), progress=False)
    consolidate(str(src), str(tmp_path / "b.safetensors"), progress=False)
    a, b = (safetensors.torch.load_file(tmp_path / n) for n in ("a.safetensors", "b.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_inspect_names_generic_paths(fixtures, tmp_path):
    s = inspect_checkpoint(str(write_layout(fixtures, tmp_path, "nested")))
    assert s["container"] == {"kind": "plain", "parts": ["model"], "optimizer_path": "opt.adam"}


def _save_all(tmp_path, make):
    folder = tmp_path / "bad"
    folder.mkdir(exist_ok=True)
    for r in range(WS):
        torch.save(make(r), folder / f"x-shard{r}.pt")
    return str(folder)


def test_refuses_ambiguous_state_dicts(fixtures, tmp_path):
    def twins(r):
        f = _fairseq(fixtures, r)
        return {"meta": f["fsdp_metadata"], "a": f["model"], "b": dict(f["model"])}

    with pytest.raises(CheckpointError, match=r"fits several state dicts \(a, b\)"):
        open_checkpoint(_save_all(tmp_path, twins))


def test_refuses_metadata_without_its_tensors(fixtures, tmp_path):
    def orphan(r):
        f = _fairseq(fixtures, r)
        return {"meta": f["fsdp_metadata"], "weights": {"other": torch.zeros(1)}}

    with pytest.raises(CheckpointError, match="no dict of tensors holds its flat parameters"):
        open_checkpoint(_save_all(tmp_path, orphan))


def test_refuses_two_unnamed_optimizers(fixtures, tmp_path):
    def two_opts(r):
        f = _fairseq(fixtures, r)
        o = f["last_optimizer_state"]
        return {"w": f["model"], "m": f["fsdp_metadata"], "g_opt": o, "d_opt": o}

    with pytest.raises(CheckpointError, match="several optimizer states"):
        open_checkpoint(_save_all(tmp_path, two_opts))


@pytest.mark.parametrize("file_name", ["model_rank{}.pt", "rank-{}.pt", "ckpt_shard_{}.pt"])
def test_rank_file_names(fixtures, tmp_path, file_name):
    """A training loop's own per-rank names: "rank" counts where no name says "shard"."""
    src = write_layout(fixtures, tmp_path, "docs_style", file_name)
    want = [file_name.format(r) for r in range(WS)]
    for given in (src, src / file_name.format(1)):
        assert [os.path.basename(p) for p in open_checkpoint(str(given)).files.paths] == want, given
    if "rank" in file_name:  # another rank-named group beside it: the folder is ambiguous, one named file is not
        (src / "notes_rank0.txt").write_text("not a shard")
        with pytest.raises(CheckpointError, match="holds several checkpoints"):
            open_checkpoint(str(src))
        assert [os.path.basename(p) for p in open_checkpoint(str(src / want[0])).files.paths] == want
        (src / "notes_rank0.txt").unlink()
    reshard(str(src), str(tmp_path / "out"), 2, progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix == ".pt") == [
        file_name.format(r) for r in range(2)
    ]


def test_shard_names_win_over_rank_names(fixtures, tmp_path):
    src = write_layout(fixtures, tmp_path, "docs_style")  # ckpt-shard{r}.pt
    torch.save({"unrelated": 1}, src / "log_rank0.pt")
    assert len(open_checkpoint(str(src)).files.paths) == WS


def test_two_roots_container_output_holds_each_roots_full_weights(fixtures, tmp_path):
    """--container puts each root's full state dict where its shards were, and drops every metadata."""
    src = write_layout(fixtures, tmp_path, "two_roots")
    consolidate(str(src), str(tmp_path / "c.pt"), container=True, optimizer=True, progress=False)
    consolidate(src_of(fixtures[WS], "vissl"), str(tmp_path / "v.pt"), container=True, optimizer=True, progress=False)
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    want = torch.load(tmp_path / "v.pt", weights_only=True)
    assert set(got) == {"trunk", "heads", "optimizer"}  # no metadata left
    base = want["classy_state_dict"]["base_model"]["model"]
    _assert_tensor_dicts_equal(got["trunk"], base["trunk"], "trunk")
    _assert_tensor_dicts_equal(
        got["heads"], {k[2:]: v for k, v in base["heads"].items() if k.startswith("0.")}, "heads"
    )
    _assert_optim_equal(got["optimizer"], want["classy_state_dict"]["optimizer"]["optim"], "optim")

"""A second real fairscale model (ckptshard.testing.transformer): 0-dim parameter, empty instance, AdamW amsgrad.

Trained at world size 3; consolidate, reshard to 2 and 5, shard and the DCP
round trip are checked against live FSDP. One known fairscale bug shows
here: ``get_shard_from_optim_state_dict`` treats a 0-dim parameter's
moments as per-rank scalars and replaces the whole flat parameter's moments
with them. There the live model decides: ckptshard's shard, loaded into
FSDP at N and gathered again, gives back the original optimizer state.
"""

import hashlib
import pathlib

import pytest
import torch
from conftest import _once
from safetensors.torch import load_file
from test_reshard import assert_optim_equal, assert_tensors_equal

from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.convert import convert
from ckptshard.execute.reshard import reshard, shard
from ckptshard.testing import transformer

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

SOURCE_WS = 3
TARGETS = (2, 5)
VARIANTS = ("flat", "unflat", "groups", "ckptwrap")
SHARD = "checkpoint_last-shard{}.pt"


@pytest.fixture(scope="module")
def lm(cache_root, tmp_path_factory):
    """Source shards (cached), ckptshard's outputs from them, and what live FSDP at each target makes of those."""
    code = hashlib.sha256(pathlib.Path(transformer.__file__).read_bytes()).hexdigest()[:8]  # its own cache key
    src_root = _once(
        cache_root / f"tinylm-ws{SOURCE_WS}-{code}",
        lambda d: transformer.build_transformer_fixture(d, list(VARIANTS), SOURCE_WS),
    )
    work = tmp_path_factory.mktemp("tinylm")
    out = {"src_root": src_root, "work": work}
    for v in VARIANTS:
        src = str(src_root / v / "src")
        (work / v).mkdir()
        consolidate(src, str(work / v / "full.pt"), optimizer=True, progress=False)
        for n in TARGETS:
            reshard(src, str(work / v / f"r{n}"), n, progress=False)
    for n in TARGETS:
        jobs = [
            {
                "variant": v,
                "ref": str(src_root / v / "ref.pt"),
                "resharded": str(work / v / f"r{n}"),
                "src": str(src_root / v / "src"),
                "full": str(work / v / "full.pt"),
                "full_optim": str(work / v / "full.optim.pt"),
                "out": str(work / v / f"check{n}"),
            }
            for v in VARIANTS
        ]
        transformer.check_at_world_size(jobs, n)
    return out


def ref(lm, v):
    return torch.load(lm["src_root"] / v / "ref.pt", weights_only=True)


def shard_file(folder: pathlib.Path, r: int):
    return torch.load(folder / SHARD.format(r), weights_only=True)


def check(lm, v, n, r):
    return torch.load(lm["work"] / v / f"check{n}" / f"rank{r}.pt", weights_only=True)


def test_fixture_has_what_it_claims(lm):
    meta = shard_file(lm["src_root"] / "flat" / "src", 0)["fsdp_metadata"]["param_metadata"]
    root = meta[0]["params"]["flat_param_0"]
    assert root["names"][0] == "temperature" and list(root["shapes"][0]) == []
    assert any(not e["params"] for e in meta), "an FSDP instance without parameters"
    assert meta[0]["shared_param_info"], "tied embeddings"
    unflat = shard_file(lm["src_root"] / "unflat" / "src", 0)
    assert any(
        len(e["params"]) > 1 and "flat_param_0" not in e["params"] for e in unflat["fsdp_metadata"]["param_metadata"]
    )
    # The root unflattened: the tie is stored under both names, in no metadata.
    assert "out.weight" in unflat["model"] and "temperature" in unflat["model"]
    assert not any(
        "out.weight" in e["params"] or e["shared_param_info"] for e in unflat["fsdp_metadata"]["param_metadata"]
    )
    osd = shard_file(lm["src_root"] / "flat" / "src", 0)["last_optimizer_state"]
    assert set(osd["state"][0]) >= {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    # groups: two param groups, and optimizer entry 0 is not the first flat parameter (sizes differ).
    grouped = shard_file(lm["src_root"] / "groups" / "src", 0)
    assert [g["params"] for g in grouped["last_optimizer_state"]["param_groups"]] == [[0, 1], [2, 3, 4]]
    assert grouped["last_optimizer_state"]["state"][0]["exp_avg"].numel() != grouped["model"]["flat_param_0"].numel()
    # ckptwrap: the metadata names torch's checkpoint wrapper (an FSDP path, parameters, buffers); no stored key does.
    wrapped = shard_file(lm["src_root"] / "ckptwrap" / "src", 0)
    md = wrapped["fsdp_metadata"]
    hidden = "_checkpoint_wrapped_module"
    assert any(e["fsdp_path"].endswith(hidden) for e in md["param_metadata"])
    assert any(n.startswith(hidden) for e in md["param_metadata"] for p in e["params"].values() for n in p["names"])
    assert any(hidden in b for b in md["buffer_names"])
    assert not any(hidden in k for k in wrapped["model"]) and not any(hidden in k for k in ref(lm, "ckptwrap")["full"])


@pytest.mark.parametrize("v", VARIANTS)
def test_consolidated_equals_live_state_dict(lm, v, tmp_path):
    want = dict(sorted(ref(lm, v)["full"].items()))
    got = torch.load(lm["work"] / v / "full.pt", weights_only=True)
    assert_tensors_equal(dict(sorted(got.items())), want, ".pt")
    consolidate(str(lm["src_root"] / v / "src"), str(tmp_path / "full.safetensors"), progress=False)
    assert_tensors_equal(dict(sorted(load_file(tmp_path / "full.safetensors").items())), want, ".safetensors")


def test_consolidated_optimizer_equals_gather_full_optim_state_dict(lm):
    got = torch.load(lm["work"] / "flat" / "full.optim.pt", weights_only=True)
    want = ref(lm, "flat")["full_optim"]
    assert got["state"][0]["exp_avg"].shape == ()  # the 0-dim parameter's moments, in its shape
    assert_optim_equal(got, want, "full optim")
    assert got["param_id_map"] == want["param_id_map"]


@pytest.mark.parametrize("v", VARIANTS)
def test_consolidated_optimizer_equals_the_live_moments(lm, v):
    # Per parameter, each moment equals the one FSDP gathered as if it were the weights (ref["moments"]);
    # this needs none of fairscale's optimizer utilities, which support neither unflat nor groups.
    from ckptshard.read.source import open_checkpoint

    got = torch.load(lm["work"] / v / "full.optim.pt", weights_only=True)
    want = ref(lm, v)["moments"]
    ckpt = open_checkpoint(str(lm["src_root"] / v / "src"))
    names = ckpt.layout.param_names()
    assert sorted(got["state"]) == list(range(len(names)))
    for gid, name in enumerate(names):
        for k in transformer.MOMENTS:
            assert torch.equal(got["state"][gid][k].reshape(-1), want[k][name].reshape(-1)), (gid, name, k)
    # Each param group lists its parameters' global ids; param_id_map takes them to optimizer ids.
    src_groups = shard_file(lm["src_root"] / v / "src", 0)["last_optimizer_state"]["param_groups"]
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in src_groups]
    if v == "groups":
        ids = [sorted({got["param_id_map"][x] for x in g["params"]}) for g in got["param_groups"]]
        assert ids == [g["params"] for g in src_groups]
        res = consolidate(
            str(lm["src_root"] / v / "src"), str(lm["work"] / v / "again.pt"), optimizer=True, progress=False
        )
        assert [n for n in res.notes if "2 param groups" in n and "get_shard_from_optim_state_dict" in n]


@pytest.mark.parametrize("v", VARIANTS)
@pytest.mark.parametrize("n", TARGETS)
def test_resharded_weights_equal_fsdp_at_target(lm, v, n):
    for r in range(n):
        got, want = shard_file(lm["work"] / v / f"r{n}", r), check(lm, v, n, r)
        assert_tensors_equal(got["model"], want["local"], f"rank {r}")
        assert got["fsdp_metadata"] == want["meta"]
        assert got["extra_state"] == {"epoch": 1}


@pytest.mark.parametrize("v", VARIANTS)
@pytest.mark.parametrize("n", TARGETS)
def test_fsdp_at_target_loads_resharded_to_the_same_full_state(lm, v, n):
    got = check(lm, v, n, 0)["regathered"]
    assert_tensors_equal(dict(sorted(got.items())), dict(sorted(ref(lm, v)["full"].items())), "after load")


@pytest.mark.parametrize("v", VARIANTS)
@pytest.mark.parametrize("n", TARGETS)
def test_resharded_optimizer_equals_moments_sharded_by_fsdp_at_target(lm, v, n):
    # Entry i is the i-th of root.parameters() at N; each moment, sharded by FSDP at N as if it were
    # the weights. With the root unflattened its own parameters interleave with the children's.
    for r in range(n):
        ours = shard_file(lm["work"] / v / f"r{n}", r)["last_optimizer_state"]["state"]
        want = check(lm, v, n, r)["moments"]
        assert sorted(ours) == sorted(want["exp_avg"]), r
        for k, entries in want.items():
            for i, t in entries.items():
                assert ours[i][k].shape == t.shape and torch.equal(ours[i][k], t), (r, i, k)


@pytest.mark.parametrize("n", TARGETS)
def test_resharded_optimizer_gathers_back_to_the_original(lm, n):
    # The live model is the oracle: FSDP at N loads our shards and gathers the original full state.
    assert_optim_equal(check(lm, "flat", n, 0)["regathered_optim"], ref(lm, "flat")["full_optim"], f"regathered at {n}")


@pytest.mark.parametrize("n", TARGETS)
def test_fairscale_get_shard_loses_the_0dim_instance_state_and_we_do_not(lm, n):
    for r in range(n):
        mine = shard_file(lm["work"] / "flat" / f"r{n}", r)
        ours, local = mine["last_optimizer_state"], mine["model"]
        theirs = check(lm, "flat", n, r)["optim"]
        for pid, st in theirs["state"].items():
            for k, t in st.items():
                if not torch.is_tensor(t) or k == "step":
                    continue
                if pid == 0:  # fairscale: the temperature's 0-dim moment, not the flat param's shard
                    assert t.numel() == 1 and ours["state"][0][k].shape == local["flat_param_0"].shape, (r, k)
                else:
                    assert torch.equal(ours["state"][pid][k], t), (r, pid, k)


@pytest.mark.parametrize("v", VARIANTS)
@pytest.mark.parametrize("n", TARGETS)
def test_shard_and_dcp_round_trip_equal_reshard(lm, v, n, tmp_path):
    src, work = str(lm["src_root"] / v / "src"), lm["work"] / v
    shard(str(work / "full.pt"), src, str(tmp_path / "s"), n, optimizer=str(work / "full.optim.pt"), progress=False)
    convert(src, str(tmp_path / "c.dcp"), "dcp", progress=False)
    convert(str(tmp_path / "c.dcp"), str(tmp_path / "d"), "fairscale", like=src, world_size=n, progress=False)
    for out in ("s", "d"):
        for r in range(n):
            got, want = shard_file(tmp_path / out, r), shard_file(work / f"r{n}", r)
            assert_tensors_equal(got["model"], want["model"], f"{out} rank {r}")
            assert_optim_equal(got["last_optimizer_state"], want["last_optimizer_state"], f"{out} rank {r}")


@pytest.mark.parametrize("v", VARIANTS)
@pytest.mark.parametrize("n", TARGETS)
def test_load_checkpoint_gives_the_live_full_state_both_ways(lm, v, n):
    want = dict(sorted(ref(lm, v)["full"].items()))
    rec = check(lm, v, n, 0)
    for how in ("full", "local"):
        path, got = rec[f"loaded_{how}"]
        assert path == how
        assert_tensors_equal(dict(sorted(got.items())), want, how)


@pytest.mark.parametrize("v", VARIANTS)
@pytest.mark.parametrize("n", TARGETS)
def test_load_checkpoint_full_path_loads_the_resharded_optimizer_state(lm, v, n):
    for r in range(n):
        rec = check(lm, v, n, r)
        assert rec["loaded_path"] == "full"
        want = shard_file(lm["work"] / v / f"r{n}", r)["last_optimizer_state"]
        assert_optim_equal(rec["loaded_optim"], want, f"rank {r}")


@pytest.mark.parametrize("v", VARIANTS)
def test_load_checkpoint_into_the_unwrapped_model(lm, v):
    from ckptshard.fsdp.loading import load_checkpoint

    want = dict(sorted(ref(lm, v)["full"].items()))
    for src in (lm["src_root"] / v / "src", lm["work"] / v / "full.pt"):
        torch.manual_seed(7)
        plain = transformer.TinyLM()
        if v == "ckptwrap":  # the user's model keeps its checkpoint wrappers, not FSDP
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            plain.layers[0] = checkpoint_wrapper(plain.layers[0])
            plain.norm = checkpoint_wrapper(plain.norm)
        report = load_checkpoint(plain, str(src))
        assert report.path == "full" and not report.skipped
        assert_tensors_equal(dict(sorted(plain.state_dict().items())), want, str(src))
        assert plain.out.weight is plain.embed.weight  # the tie survives the load


def test_optimizer_without_per_parameter_state(lm, tmp_path):
    # SGD without momentum saves param_groups and an empty state; DCP then stores no 'state' at all.
    src = tmp_path / "src"
    src.mkdir()
    for r in range(SOURCE_WS):
        d = shard_file(lm["src_root"] / "flat" / "src", r)
        d["last_optimizer_state"]["state"] = {}
        torch.save(d, src / SHARD.format(r))
    want_groups = shard_file(src, 0)["last_optimizer_state"]["param_groups"]
    reshard(str(src), str(tmp_path / "r"), 2, progress=False)
    consolidate(str(src), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    shard(
        str(tmp_path / "full.pt"),
        str(src),
        str(tmp_path / "s"),
        2,
        optimizer=str(tmp_path / "full.optim.pt"),
        progress=False,
    )
    convert(str(src), str(tmp_path / "c.dcp"), "dcp", progress=False)
    convert(str(tmp_path / "c.dcp"), str(tmp_path / "d"), "fairscale", like=str(src), world_size=2, progress=False)
    for out in ("r", "s", "d"):
        for r in range(2):
            got = shard_file(tmp_path / out, r)["last_optimizer_state"]
            assert got["state"] == {} and got["param_groups"] == want_groups, (out, r)


def test_fsdp2_loads_the_dcp_of_several_param_groups(lm, tmp_path):
    # torch's own FSDP2 builds its optimizer with the groups the DCP lists, loads it with
    # set_optimizer_state_dict, and gathers every parameter's moments as the live fairscale run had them.
    convert(str(lm["src_root"] / "groups" / "src"), str(tmp_path / "g.dcp"), "dcp", progress=False)
    transformer.optimizer_loaded_in_fsdp2(str(tmp_path / "g.dcp"), str(tmp_path / "full.pt"), 2)
    got = torch.load(tmp_path / "full.pt", weights_only=False)
    moments = ref(lm, "groups")["moments"]
    src_groups = shard_file(lm["src_root"] / "groups" / "src", 0)["last_optimizer_state"]["param_groups"]
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in src_groups] == [2e-2, 1e-2]
    assert sorted(n for g in got["param_groups"] for n in g["params"]) == sorted(got["state"])
    assert len(got["state"]) == len(dict(transformer.TinyLM().named_parameters()))
    for name, st in got["state"].items():
        for k in transformer.MOMENTS:
            assert torch.equal(st[k].reshape(-1), moments[k][name].reshape(-1)), (name, k)


def test_wrapper_names_in_stored_keys_are_refused_clearly(lm, tmp_path):
    # Before torch 1.12 checkpoint_wrapper had no state-dict hooks: its name was in the stored keys too.
    from ckptshard.errors import CheckpointError

    for r in range(SOURCE_WS):
        d = shard_file(lm["src_root"] / "ckptwrap" / "src", r)
        d["model"] = {k.replace("layers.1.", "layers.1._checkpoint_wrapped_module."): v for k, v in d["model"].items()}
        torch.save(d, tmp_path / SHARD.format(r))
    with pytest.raises(CheckpointError, match="wrapper name that state dicts hide since torch 1.12"):
        consolidate(str(tmp_path), str(tmp_path / "full.pt"), progress=False)
    assert not (tmp_path / "full.pt").exists()

"""reshard against real fairscale FSDP at the target world size."""

import pytest
import torch
from conftest import (
    CONTAINERS,
    SOURCE_WORLD_SIZES,
    TARGET_WORLD_SIZES,
    load_ref,
    src_of,
)
from fairscale.nn import FullyShardedDataParallel as FSDP

from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

PAIRS = [(m, n) for m in SOURCE_WORLD_SIZES for n in TARGET_WORLD_SIZES]


def rank_file(folder, container, rank):
    name = {
        "fairseq": "checkpoint_last-shard{}.pt",
        "metaseq": "checkpoint_last-model_part-0-shard{}.pt",
        "vissl": "model_phase2_shard{}.torch",
    }[container]
    return torch.load(folder / name.format(rank), weights_only=True)


def parts_of(obj, container):
    """[(weights, metadata)] per part, as the oracle records them."""
    if container == "vissl":
        base = obj["classy_state_dict"]["base_model"]
        return [(base["model"]["trunk"], base["meta"]["trunk"]), (base["model"]["heads"][0], base["meta"]["heads"][0])]
    meta_key = "fsdp_metadata" if container == "fairseq" else "shard_metadata"
    return [(obj["model"], obj[meta_key])]


def optim_of(obj, container):
    return obj["classy_state_dict"]["optimizer"]["optim"] if container == "vissl" else obj["last_optimizer_state"]


def assert_tensors_equal(got, want, what):
    assert list(got) == list(want), (what, list(got), list(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (what, k)
        assert torch.equal(got[k], want[k]), (what, k)


def assert_optim_equal(got, want, what, flat_ok=False):
    """ckptshard keeps ``step`` as the source stored it (a tensor); fairscale turns it into a float.

    ``flat_ok``: at world size 1 fairscale's get_shard_from_optim_state_dict
    gives an unflattened parameter's state 1-D, while a real world-size-1 run
    stores it in the parameter's shape (as ckptshard does): same values.
    """
    assert got["param_groups"] == want["param_groups"], what
    assert got["state"].keys() == want["state"].keys(), what
    for pid, s in want["state"].items():
        assert got["state"][pid].keys() == s.keys(), (what, pid)
        for k, v in s.items():
            g = got["state"][pid][k]
            if torch.is_tensor(v) and v.dim() > 0:
                if flat_ok and g.shape != v.shape:
                    g = g.reshape(v.shape)
                assert g.dtype == v.dtype and torch.equal(g, v), (what, pid, k)
            else:
                assert float(g) == float(v), (what, pid, k)


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("m,n", PAIRS)
def test_resharded_equals_fsdp_at_target_world_size(fixtures, resharded, oracles, container, m, n):
    out = resharded[(m, container, n)]
    for r in range(n):
        oracle = torch.load(oracles[(m, n)] / f"rank{r}.pt", weights_only=True)
        want_parts = (
            [(oracle["trunk"], oracle["trunk_meta"]), (oracle["head"], oracle["head_meta"])]
            if container == "vissl"
            else [(oracle["local"], oracle["meta"])]
        )
        ours = rank_file(out, container, r)
        source_parts = parts_of(rank_file(fixtures[m] / container, container, r), container) if m == n else None
        for i, ((gw, gm), (ww, wm)) in enumerate(zip(parts_of(ours, container), want_parts)):
            if source_parts:
                # Same world size: an exact copy, so each rank keeps its own BatchNorm
                # statistics; the oracle, loaded from the consolidated state, has rank 0's.
                ww = {k: source_parts[i][0][k] if k in wm["buffer_names"] else v for k, v in ww.items()}
            assert_tensors_equal(gw, ww, f"rank {r}")
            assert gm == wm
        if oracle["optim"] is not None:  # None from a world-size-1 source: fairscale cannot gather there
            assert_optim_equal(optim_of(ours, container), oracle["optim"], f"rank {r}", flat_ok=n == 1)


def test_world_size_1_run_keeps_unflattened_optimizer_state_in_param_shape(fixtures, resharded):
    own = optim_of(rank_file(fixtures[1] / "fairseq", "fairseq", 0), "fairseq")["state"]
    ours = optim_of(rank_file(resharded[(2, "fairseq", 1)], "fairseq", 0), "fairseq")["state"]
    last = max(own)  # heads.0.prototypes1.weight, unflattened
    assert own[last]["exp_avg"].shape == ours[last]["exp_avg"].shape == (6, 8)


@pytest.mark.parametrize("m,n", PAIRS)
def test_fsdp_at_target_world_size_loads_resharded_output_strictly(fixtures, oracles, m, n):
    # The oracle processes loaded our files with load_local_state_dict(strict=True) and
    # optimizer.load_state_dict; the model's full state afterwards must be the original.
    after = torch.load(oracles[(m, n)] / "candidate_full.pt", weights_only=True)["state_dict"]
    assert_tensors_equal(
        dict(sorted(after.items())), dict(sorted(load_ref(fixtures[m], "full_state_dict.pt").items())), "after load"
    )
    for r in range(n):
        loaded = torch.load(oracles[(m, n)] / f"candidate_optim{r}.pt", weights_only=True)["optim"]
        oracle = torch.load(oracles[(m, n)] / f"rank{r}.pt", weights_only=True)["optim"]
        if oracle is not None:
            assert_optim_equal(loaded, oracle, f"loaded rank {r}", flat_ok=n == 1)


@pytest.mark.parametrize("n", TARGET_WORLD_SIZES)
@pytest.mark.parametrize("container", CONTAINERS)
def test_world_size_1_source_reshards(resharded, fixtures, container, n, tmp_path):
    # fairscale cannot gather optimizer state at world size 1, so here the check is
    # that 1 -> n -> consolidate gives the live weights back.
    out = tmp_path / "full.pt"
    folder = resharded[(1, container, n)]
    consolidate(str(folder / "model_phase2.torch") if container == "vissl" else str(folder), str(out), progress=False)
    got, want = torch.load(out, weights_only=True), load_ref(fixtures[1], "full_state_dict.pt")
    assert_tensors_equal(dict(sorted(got.items())), dict(sorted(want.items())), "1->n")


@pytest.mark.parametrize("m,n", [p for p in PAIRS if p[1] > 1])  # its helper asserts at world size 1
def test_fairscale_offline_consolidates_our_output(resharded, fixtures, m, n):
    folder = resharded[(m, "fairseq", n)]
    shards = [rank_file(folder, "fairseq", r) for r in range(n)]
    full = FSDP.consolidate_shard_weights(
        [s["model"] for s in shards], [s["fsdp_metadata"] for s in shards], strict=False
    )
    want = load_ref(fixtures[m], "full_state_dict.pt")
    want.pop("trunk.embed_out.weight")  # fairscale #815: its helper drops this nested tie
    assert_tensors_equal(dict(sorted(full.items())), dict(sorted(want.items())), "fairscale offline")


@pytest.mark.parametrize("container", CONTAINERS)
def test_same_world_size_is_an_exact_copy(fixtures, container, tmp_path):
    src = src_of(fixtures[3], container)
    reshard(src, str(tmp_path / "same"), 3, progress=False)
    for r in range(3):
        a, b = rank_file(fixtures[3] / container, container, r), rank_file(tmp_path / "same", container, r)
        for (aw, am), (bw, bm) in zip(parts_of(a, container), parts_of(b, container)):
            assert_tensors_equal(bw, aw, f"rank {r}")
            assert am == bm
        assert_optim_equal(optim_of(b, container), optim_of(a, container), f"rank {r}")
        assert {k: v for k, v in a.items() if k not in ("model", "classy_state_dict", "last_optimizer_state")} == {
            k: v for k, v in b.items() if k not in ("model", "classy_state_dict", "last_optimizer_state")
        }


@pytest.mark.parametrize("container", CONTAINERS)
def test_chain_equals_direct(fixtures, container, tmp_path):
    # 4 -> 3 -> 1 -> 5 must equal 4 -> 5, byte for byte.
    src = src_of(fixtures[4], container)
    vissl = container == "vissl"
    cur = src
    for i, n in enumerate((3, 1, 5)):
        dst = tmp_path / f"step{i}"
        reshard(cur, str(dst), n, progress=False)
        cur = str(dst / "model_phase2.torch") if vissl else str(dst)
    reshard(src, str(tmp_path / "direct"), 5, progress=False)
    files = [f for f in (tmp_path / "direct").iterdir() if f.name != "ckptshard-manifest.json"]  # it names its source
    assert len(files) == 5 + vissl
    for f in files:
        assert (tmp_path / "step2" / f.name).read_bytes() == f.read_bytes(), f.name


def test_non_model_keys_carried(fixtures, tmp_path):
    reshard(str(fixtures[2] / "fairseq"), str(tmp_path / "o"), 5, progress=False)
    src, out = rank_file(fixtures[2] / "fairseq", "fairseq", 0), rank_file(tmp_path / "o", "fairseq", 4)
    for k in ("cfg", "extra_state", "optimizer_history", "task_state", "args"):
        assert out[k] == src[k]
    assert out["last_optimizer_state"]["loss_scale"] == 128.0


def test_vissl_shard_list_rewritten(fixtures, tmp_path):
    reshard(src_of(fixtures[2], "vissl"), str(tmp_path / "v"), 3, progress=False)
    lst = torch.load(tmp_path / "v" / "model_phase2.torch", weights_only=True)
    assert lst == {"type": "shard_list", "shards": [f"model_phase2_shard{r}.torch" for r in range(3)]}

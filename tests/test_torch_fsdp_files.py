"""torch FSDP per-rank files (verl's layout) against real FSDP2 and FSDP1 runs on gloo.

The oracles are torch's own: ``get_model_state_dict``/``get_optimizer_state_dict``
(full) of the training run for consolidate, and the files FSDP2 at N itself
saves after ``set_model_state_dict``/``set_optimizer_state_dict`` of that full
state for reshard. All comparisons are ``torch.equal``.
"""

import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.tensor
from conftest import _once

import ckptshard
from ckptshard.errors import CheckpointError
from ckptshard.formats.dtensor_pickle import DTensorWriter
from ckptshard.formats.torch_pickle import Unsupported
from ckptshard.testing import torch_fsdp_runs

SOURCES = (1, 2, 3, 4)
PAIRS = ((3, 2), (2, 4), (1, 3), (4, 1))


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


CODE = hashlib.sha256(pathlib.Path(torch_fsdp_runs.__file__).read_bytes()).hexdigest()[:8]  # fixtures' cache key


@pytest.fixture(scope="module")
def runs(cache_root):
    return {
        w: _once(cache_root / f"fsdp2-ws{w}-{CODE}", lambda d, w=w: torch_fsdp_runs.build_fsdp2_run(d, w))
        for w in SOURCES
    }


@pytest.fixture(scope="module")
def torch_files(runs, cache_root):
    """(M, N) -> torch's own files at N of run M's full state."""
    return {
        (m, n): _once(
            cache_root / f"fsdp2-torch-{m}to{n}-{CODE}",
            lambda d, m=m, n=n: torch_fsdp_runs.torch_at(str(runs[m] / "ref"), d, n),
        )
        for m, n in PAIRS
    }


@pytest.fixture(scope="module")
def resharded(runs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp2")
    out = {}
    for m, n in PAIRS:
        out[(m, n)] = tmp / f"{m}to{n}"
        # At 1 and 4 ranks TiedLM's placements fit verl's rule too (4 divides no first dimension): torch's named
        placement = "dim0" if m in (1, 4) else None
        ckptshard.reshard(str(runs[m]), str(out[(m, n)]), n, progress=False, placement=placement)
    return out


_assert_equal = torch_fsdp_runs.assert_same_state


@pytest.mark.parametrize("w", SOURCES)
def test_consolidate_is_torchs_full_state_dict(runs, w, tmp_path):
    ckptshard.consolidate(str(runs[w]), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    _assert_equal(_load(tmp_path / "full.pt"), _load(runs[w] / "ref" / "full_model.pt"), "model")
    _assert_equal(_load(tmp_path / "full.optim.pt"), _load(runs[w] / "ref" / "full_optim.pt"), "optim")


def test_consolidate_to_sharded_safetensors_and_bf16(runs, tmp_path):
    from safetensors.torch import load_file

    res = ckptshard.consolidate(str(runs[3]), str(tmp_path / "hf"), max_shard_size=400, dtype="bf16", progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(tmp_path / "hf" / f))
    want = _load(runs[3] / "ref" / "full_model.pt")
    # verl's huggingface/config.json beside the files: a model folder, the tied head left out as save_pretrained does
    assert "head.weight: the same tensor as embed.weight" in " ".join(res.notes)
    assert set(got) == set(want) - {"head.weight"} and len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    want.pop("head.weight")
    for k, v in want.items():
        assert torch.equal(got[k], v.to(torch.bfloat16) if v.is_floating_point() else v), k


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}to{p[1]}")
def test_reshard_writes_what_fsdp2_at_n_saves(runs, resharded, torch_files, pair):
    m, n = pair
    ours, theirs = resharded[pair], torch_files[pair]
    for r in range(n):
        for kind in ("model", "optim"):
            name = f"{kind}_world_size_{n}_rank_{r}.pt"
            _assert_equal(_load(ours / name), _load(theirs / name), f"{name}")
    assert json.loads((ours / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": n}
    assert (ours / "huggingface" / "config.json").read_bytes() == (runs[m] / "huggingface" / "config.json").read_bytes()
    for r in range(n):  # carried byte for byte, never unpickled (it holds numpy's RNG state)
        src = runs[m] / f"extra_state_world_size_{m}_rank_{r % m}.pt"
        assert (ours / f"extra_state_world_size_{n}_rank_{r}.pt").read_bytes() == src.read_bytes()
    assert not [p for p in ours.iterdir() if "world_size_" in p.name and f"world_size_{n}_" not in p.name]
    assert ckptshard.verify(str(ours)) == []


@pytest.mark.slow
def test_resume_from_reshard_matches_resume_from_torchs_files(resharded, torch_files, tmp_path):
    torch_fsdp_runs.step_from(str(resharded[(3, 2)]), str(tmp_path / "ours.pt"), 2)
    torch_fsdp_runs.step_from(str(torch_files[(3, 2)]), str(tmp_path / "theirs.pt"), 2)
    _assert_equal(_load(tmp_path / "ours.pt"), _load(tmp_path / "theirs.pt"), "after one step")


def test_chained_reshards_equal_one(runs, tmp_path):
    ckptshard.reshard(str(runs[3]), str(tmp_path / "a2"), 2, progress=False)
    ckptshard.reshard(str(tmp_path / "a2"), str(tmp_path / "a4"), 4, progress=False)
    ckptshard.reshard(str(runs[3]), str(tmp_path / "b4"), 4, progress=False)
    for r in range(4):
        for kind in ("model", "optim"):
            name = f"{kind}_world_size_4_rank_{r}.pt"
            _assert_equal(_load(tmp_path / "a4" / name), _load(tmp_path / "b4" / name), name)


@pytest.fixture(scope="module")
def hsdp_run(cache_root):
    """FSDP2 on a 2 x 2 mesh (HSDP: 2 replicas of 2 shards, verl's fsdp_size=2 at 4 ranks)."""
    return _once(cache_root / f"fsdp2-hsdp-2x2-{CODE}", lambda d: torch_fsdp_runs.build_fsdp2_run(d, 4, replicas=2))


@pytest.mark.slow
def test_hsdp_files_consolidate_and_convert_to_the_full_state(hsdp_run, tmp_path):
    """Replica 0's shards are the checkpoint: consolidated they are torch's full model and optimizer state;
    the DCP loads into FSDP2 at 2 (one dimension) with both."""
    assert ckptshard.inspect_checkpoint(str(hsdp_run))["hsdp"] == [2, 2]
    ckptshard.consolidate(str(hsdp_run), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    want_model, want_optim = _load(hsdp_run / "ref" / "full_model.pt"), _load(hsdp_run / "ref" / "full_optim.pt")
    _assert_equal(_load(tmp_path / "full.pt"), want_model, "model")
    _assert_equal(_load(tmp_path / "full.optim.pt"), want_optim, "optim")
    ckptshard.convert(str(hsdp_run), str(tmp_path / "dcp"), "dcp", progress=False)
    torch_fsdp_runs.load_dcp(str(tmp_path / "dcp"), str(tmp_path / "loaded.pt"), 2)
    loaded = _load(tmp_path / "loaded.pt")
    _assert_equal(loaded["model"], want_model, "dcp model")
    _assert_equal(loaded["optim"], want_optim, "dcp optim")


def test_hsdp_files_that_are_not_one_mesh_are_refused(hsdp_run, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hsdp_run, src)
    shutil.copy(src / "model_world_size_4_rank_0.pt", src / "model_world_size_4_rank_2.pt")  # (0, 0) twice
    with pytest.raises(CheckpointError, match=r"are not one 2 x 2 mesh of 4 ranks"):
        ckptshard.consolidate(str(src), str(tmp_path / "full.pt"), progress=False)
    assert not (tmp_path / "full.pt").exists()


def _same_files(got, want, world):
    for r in range(world):
        for kind in ("model", "optim"):
            name = f"{kind}_world_size_{world}_rank_{r}.pt"
            torch_fsdp_runs.assert_same_state(
                torch.load(got / name, weights_only=False), torch.load(want / name, weights_only=False), name
            )


@pytest.mark.parametrize(
    "world, group, replicas, names",
    [
        (6, None, 3, None),  # the source's group of 2 kept: 3 replicas
        (3, 3, 1, ("fsdp",)),  # one shard group: plain FSDP2, its mesh named as verl names it
    ],
)
@pytest.mark.slow
def test_hsdp_files_reshard_to_what_fsdp2_saves_on_that_mesh(
    hsdp_run, tmp_path, monkeypatch, world, group, replicas, names
):
    """HSDP 2 x 2 resharded equals, file for file (every DeviceMesh field, every optimizer tensor), what FSDP2
    on the new mesh saves after loading the full state; one more step resumed from each with verl's calls is
    equal. torch pickles only an empty DTensor of the 2-D mesh: no file is laid out by torch."""
    import ckptshard.write.torch_file as torch_file

    monkeypatch.setattr(torch_file, "_torch_skeleton", lambda *a: pytest.fail("a file laid out by torch"))
    ckptshard.reshard(str(hsdp_run), str(tmp_path / "ours"), world, progress=False, shard_group=group)
    torch_fsdp_runs.torch_at(str(hsdp_run / "ref"), str(tmp_path / "torch"), world, replicas, names)
    _same_files(tmp_path / "ours", tmp_path / "torch", world)
    if world == 3:
        torch_fsdp_runs.step_from(str(tmp_path / "ours"), str(tmp_path / "a.pt"), world, replicas, names)
        torch_fsdp_runs.step_from(str(tmp_path / "torch"), str(tmp_path / "b.pt"), world, replicas, names)
        _assert_equal(_load(tmp_path / "a.pt"), _load(tmp_path / "b.pt"), "step")
    config = json.loads((tmp_path / "ours" / "fsdp_config.json").read_text())
    assert config["world_size"] == world


@pytest.mark.slow
def test_fsdp2_files_reshard_to_hsdp_and_back(runs, hsdp_run, tmp_path):
    """FSDP2 at 3 to HSDP 2 x 2 (--shard-group 2, the mesh named as the training code names it) equals FSDP2's
    own HSDP files; and back to one dimension, named as a 1-D verl mesh, equals FSDP2's at 3 on that mesh.
    A chain through HSDP equals the direct reshard."""
    ckptshard.reshard(
        str(runs[3]), str(tmp_path / "h"), 4, progress=False, shard_group=2, mesh_dim_names=["ddp", "fsdp"]
    )
    torch_fsdp_runs.torch_at(str(runs[3] / "ref"), str(tmp_path / "th"), 4, replicas=2)
    _same_files(tmp_path / "h", tmp_path / "th", 4)
    ckptshard.reshard(str(tmp_path / "h"), str(tmp_path / "back"), 3, progress=False, shard_group=3)
    ckptshard.reshard(str(runs[3]), str(tmp_path / "direct"), 3, progress=False, mesh_dim_names=["fsdp"])
    torch_fsdp_runs.torch_at(str(runs[3] / "ref"), str(tmp_path / "t3"), 3, names=("fsdp",))
    _same_files(tmp_path / "back", tmp_path / "t3", 3)
    _same_files(tmp_path / "direct", tmp_path / "t3", 3)


@pytest.mark.parametrize(
    "world, kw, match",
    [
        (3, {}, r"sharded over groups of 2 ranks, and 3 ranks are not a multiple of 2: pass --shard-group"),
        (6, {"shard_group": 4}, r"--shard-group 4 does not divide --world-size 6"),
        (4, {"mesh_dim_names": ["fsdp"]}, r"--mesh-dim-names fsdp: the mesh at 4 ranks has 2 dimension"),
    ],
)
def test_hsdp_reshard_refusals(hsdp_run, tmp_path, world, kw, match):
    with pytest.raises(CheckpointError, match=match):
        ckptshard.reshard(str(hsdp_run), str(tmp_path / "out"), world, progress=False, **kw)
    assert not (tmp_path / "out").exists()


def test_plain_per_rank_files_without_verl_names(runs, tmp_path):
    """A training loop's own torch.save(model.state_dict()) per rank: found by rank names, read the same."""
    for r in range(3):
        shutil.copy(runs[3] / f"model_world_size_3_rank_{r}.pt", tmp_path / f"weights_rank{r}.pt")
    ckptshard.consolidate(str(tmp_path), str(tmp_path / "full.safetensors"), progress=False)
    from safetensors.torch import load_file

    got, want = load_file(tmp_path / "full.safetensors"), _load(runs[3] / "ref" / "full_model.pt")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _copy(run, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(run, dst)
    shutil.rmtree(dst / "ref")
    return dst


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "model_world_size_3_rank_1.pt").unlink(), "rank 1 is missing"),
        (
            lambda d: shutil.copy(d / "model_world_size_3_rank_0.pt", d / "model_world_size_4_rank_0.pt"),
            "several world sizes",
        ),
        (
            lambda d: shutil.copy(d / "model_world_size_3_rank_0.pt", d / "model_world_size_3_rank_2.pt"),
            "of mesh rank 0, not of rank 2",
        ),
        (lambda d: (d / "optim_world_size_3_rank_2.pt").unlink(), r"optim_world_size_3_rank_\*\.pt: rank 2 is missing"),
    ],
    ids=["missing-rank", "mixed-world-sizes", "rank-file-twice", "missing-optim-rank"],
)
def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, damage, message):
    src = _copy(runs[3], tmp_path)
    damage(src)
    for call in (
        lambda: ckptshard.consolidate(str(src), str(tmp_path / "out.pt"), progress=False),
        lambda: ckptshard.reshard(str(src), str(tmp_path / "out"), 2, progress=False),
    ):
        with pytest.raises(CheckpointError, match=message) as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("m, n", [(3, 2), (1, 4)])
@pytest.mark.slow
def test_convert_to_dcp_loads_into_fsdp2_at_any_world_size(runs, m, n, tmp_path):
    ckptshard.convert(str(runs[m]), str(tmp_path / "dcp"), "dcp", progress=False)
    torch_fsdp_runs.load_dcp(str(tmp_path / "dcp"), str(tmp_path / "full.pt"), n)
    full = _load(tmp_path / "full.pt")
    _assert_equal(full["model"], _load(runs[m] / "ref" / "full_model.pt"), "model")
    _assert_equal(full["optim"], _load(runs[m] / "ref" / "full_optim.pt"), "optim")


def test_inspect_names_every_tensor_once_and_the_tie(runs):
    s = ckptshard.inspect_checkpoint(str(runs[2]))
    assert s["format"] == "fsdp2" and s["kind"] == "fsdp2" and s["world_size"] == 2 and s["layout"] == "verl"
    ref = _load(runs[2] / "ref" / "full_model.pt")
    assert [t["name"] for t in s["tensors"]] == list(ref)
    by_name = {t["name"]: t for t in s["tensors"]}
    assert by_name["head.weight"]["placement"] == "Shard(0), tied to embed.weight"
    assert by_name["position_scale"]["placement"].startswith("plain")
    assert s["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]


@pytest.fixture(scope="module")
def fsdp1_runs(cache_root):
    return {w: _fsdp1_run(cache_root, w, False) for w in (2, 3)}


@pytest.mark.parametrize("w", (2, 3))
def test_fsdp1_sharded_state_dict_consolidates_to_its_full_state_dict(fsdp1_runs, w, tmp_path):
    ckptshard.consolidate(str(fsdp1_runs[w]), str(tmp_path / "full.pt"), progress=False)
    _assert_equal(_load(tmp_path / "full.pt"), _load(fsdp1_runs[w] / "ref" / "full_model.pt"), "model")
    assert ckptshard.inspect_checkpoint(str(fsdp1_runs[w]))["kind"] == "fsdp1"


def test_fsdp1_files_are_not_resharded_to_hsdp(fsdp1_runs, tmp_path):
    with pytest.raises(CheckpointError, match=r"FSDP1 files; --shard-group below the world size \(HSDP\) is FSDP2"):
        ckptshard.reshard(str(fsdp1_runs[2]), str(tmp_path / "out"), 4, progress=False, shard_group=2)
    assert not (tmp_path / "out").exists()


def test_fsdp1_weights_convert_to_a_dcp_fsdp2_loads(fsdp1_runs, tmp_path):
    ckptshard.convert(str(fsdp1_runs[3]), str(tmp_path / "dcp"), "dcp", optimizer=False, progress=False)
    import torch.distributed.checkpoint as dcp

    want = _load(fsdp1_runs[3] / "ref" / "full_model.pt")
    got = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
    _assert_equal(got["model"], want, "model")


@pytest.mark.parametrize("w, bf16", [(2, False), (3, False), (3, True), (4, True)], ids=str)
def test_fsdp1_raw_optimizer_files_consolidate_to_torchs_full_optimizer_state(cache_root, w, bf16, tmp_path):
    """verl's FSDP1 optimizer files: ``optimizer.state_dict()`` with use_orig_params, each rank a 1-D slice of
    each moment (none where it holds no element; under bf16 compute each parameter aligned to 8 elements)."""
    src = _once(
        cache_root / f"fsdp1-ws{w}-bf16{int(bf16)}-{CODE}", lambda d: torch_fsdp_runs.build_fsdp1_run(d, w, bf16)
    )
    ranks = [_load(src / f"optim_world_size_{w}_rank_{r}.pt") for r in range(w)]
    if w >= 3:  # the case the slices are for: some rank holds no element of some parameter
        assert any(len(o["state"]) < len(o["param_groups"][0]["params"]) for o in ranks)
    ckptshard.consolidate(str(src), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    _assert_equal(_load(tmp_path / "full.pt"), _load(src / "ref" / "full_model.pt"), "model")
    _assert_equal(_load(tmp_path / "full.optim.pt"), _load(src / "ref" / "full_optim.pt"), "optim")
    s = ckptshard.inspect_checkpoint(str(src))
    assert s["optimizer"]["entries"] == 15 and s["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    # How the run was wrapped, told from the slices: each block and the root; 16 bytes of the compute dtype.
    assert s["optimizer"]["fsdp1_units"] == f"root + blocks.* (3 units), aligned to {8 if bf16 else 4} elements"


@pytest.mark.slow
def test_fsdp1_optimizer_converts_to_a_dcp_fsdp2_loads_at_another_world_size(fsdp1_runs, tmp_path):
    ckptshard.convert(str(fsdp1_runs[3]), str(tmp_path / "dcp"), "dcp", progress=False)
    torch_fsdp_runs.load_dcp(str(tmp_path / "dcp"), str(tmp_path / "full.pt"), 2)
    full = _load(tmp_path / "full.pt")
    _assert_equal(full["model"], _load(fsdp1_runs[3] / "ref" / "full_model.pt"), "model")
    want = _load(fsdp1_runs[3] / "ref" / "full_optim.pt")
    assert list(full["optim"]["state"]) != list(want["state"])  # FSDP2 orders by parameter, FSDP1 by name
    full["optim"]["state"] = dict(sorted(full["optim"]["state"].items()))
    _assert_equal(full["optim"], want, "optim")


@pytest.fixture(scope="module")
def flat_params_run(cache_root):
    """FSDP1 without use_orig_params: the optimizer holds one flat parameter per unit."""
    return _once(cache_root / f"fsdp1-flat-ws3-{CODE}", lambda d: torch_fsdp_runs.build_fsdp1_run(d, 3, False, False))


def test_fsdp1_optimizer_files_that_do_not_add_up_are_refused(fsdp1_runs, flat_params_run, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fsdp1_runs[3], src)
    shutil.copy(src / "optim_world_size_3_rank_0.pt", src / "optim_world_size_3_rank_1.pt")
    for folder, message in (
        (src, "slices hold .* elements over the ranks"),
        (flat_params_run, "FSDP1 without use_orig_params keeps one flat parameter per FSDP unit"),
    ):
        with pytest.raises(CheckpointError, match=message):
            ckptshard.consolidate(str(folder), str(tmp_path / "a.pt"), optimizer=True, progress=False)
        assert not (tmp_path / "a.pt").exists() and not (tmp_path / "a.optim.pt").exists()
    ckptshard.consolidate(str(flat_params_run), str(tmp_path / "w.pt"), progress=False)  # the weights alone
    _assert_equal(_load(tmp_path / "w.pt"), _load(flat_params_run / "ref" / "full_model.pt"), "model")


def _local_with_optim(run, folder):
    """The run's LOCAL_STATE_DICT model files beside its raw optimizer files (``optimizer.state_dict()`` is
    the same whatever state dict type the model is saved under)."""
    shutil.copytree(run / "local", folder)
    for f in run.glob("optim_world_size_*.pt"):
        shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize("w, bf16, orig", [(2, False, True), (3, False, True), (3, True, True), (3, False, False)])
def test_fsdp1_local_state_dict_consolidates_with_like(cache_root, flat_params_run, w, bf16, orig, tmp_path):
    """LOCAL_STATE_DICT: each unit's flat parameter (and, under use_orig_params, each parameter's 1-D slice on
    the rank); --like, the model's full state dict, says what they hold. Without use_orig_params the
    parameters are cut from the flat parameters, the tied output layer found once in the root's, and so
    are the optimizer's moments, one flat tensor per unit and rank."""
    from safetensors.torch import save_file

    src = _fsdp1_run(cache_root, w, bf16) if orig else flat_params_run
    want = _load(src / "ref" / "full_model.pt")
    if orig:  # the slices need only names and shapes: the model's safetensors will do (names sorted)
        like = tmp_path / "like.safetensors"
        save_file({k: v.clone() for k, v in want.items()}, like)
    else:  # cutting flat parameters needs the model's order, which torch.save keeps
        like = tmp_path / "like.pt"
        torch.save(want, like)
    local = _local_with_optim(src, tmp_path / "local")
    ckptshard.consolidate(str(local), str(tmp_path / "full.pt"), like=str(like), optimizer=True, progress=False)
    _assert_equal(_load(tmp_path / "full.pt"), want, "model")
    _assert_equal(_load(tmp_path / "full.optim.pt"), _load(src / "ref" / "full_optim.pt"), "optim")


@pytest.mark.slow
def test_fsdp1_local_state_dict_converts_with_like_to_a_dcp(flat_params_run, tmp_path):
    """Without use_orig_params, model and optimizer: FSDP2 at 2 loads the DCP to the full state."""
    like = flat_params_run / "ref" / "full_model.pt"
    out = tmp_path / "dcp"
    local = _local_with_optim(flat_params_run, tmp_path / "local")
    ckptshard.convert(str(local), str(out), "dcp", like=str(like), progress=False)
    torch_fsdp_runs.load_dcp(str(out), str(tmp_path / "full.pt"), 2)
    full = _load(tmp_path / "full.pt")
    _assert_equal(full["model"], _load(like), "model")
    want = _load(flat_params_run / "ref" / "full_optim.pt")
    got = full["optim"]["state"]  # FSDP2's order of names and of each one's keys aside
    full["optim"]["state"] = {k: {m: got[k][m] for m in want["state"][k]} for k in want["state"]}
    _assert_equal(full["optim"], want, "optim")
    with pytest.raises(CheckpointError, match="--like with --to dcp is for FSDP1 LOCAL_STATE_DICT files"):
        ckptshard.convert(str(flat_params_run), str(tmp_path / "d2"), "dcp", like=str(like), progress=False)


def test_fsdp1_local_state_dict_needs_the_same_model_as_like(flat_params_run, runs, tmp_path):
    local = str(flat_params_run / "local")
    with pytest.raises(CheckpointError, match="LOCAL_STATE_DICT .*_flat_param.*pass --like"):
        ckptshard.consolidate(local, str(tmp_path / "a.pt"), progress=False)
    other = {k: v for k, v in _load(flat_params_run / "ref" / "full_model.pt").items() if k != "gate"}
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="has 86 elements in its flat parameter, and the parameters --like"):
        ckptshard.consolidate(local, str(tmp_path / "a.pt"), like=str(tmp_path / "other.pt"), progress=False)
    with pytest.raises(CheckpointError, match="--like is for FSDP1 LOCAL_STATE_DICT files"):
        ckptshard.consolidate(str(runs[2]), str(tmp_path / "a.pt"), like=str(tmp_path / "other.pt"), progress=False)
    from safetensors.torch import save_file

    save_file({k: v.clone() for k, v in other.items()}, tmp_path / "sorted.safetensors")
    with pytest.raises(CheckpointError, match="a safetensors --like lists names sorted"):
        ckptshard.consolidate(local, str(tmp_path / "a.pt"), like=str(tmp_path / "sorted.safetensors"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt", "sorted.safetensors"]


def _fsdp1_run(cache_root, w, bf16):
    return _once(
        cache_root / f"fsdp1-ws{w}-bf16{int(bf16)}-{CODE}", lambda d: torch_fsdp_runs.build_fsdp1_run(d, w, bf16)
    )


def _same_fsdp1_files(a, b, n):
    """Folders ``a`` and ``b`` hold the same FSDP1 files at ``n``: raw optimizer state equal, tensor for tensor,
    and the model files (ShardedTensors) equal under a process group of ``n``."""
    for r in range(n):
        name = f"optim_world_size_{n}_rank_{r}.pt"
        _assert_equal(_load(a / name), _load(b / name), name)
    torch_fsdp_runs.fsdp1_same_models(str(a), str(b), n)


@pytest.mark.parametrize("m, bf16, n", [(3, False, 2), (2, False, 3), (3, True, 4)], ids=str)
@pytest.mark.slow
def test_fsdp1_reshard_is_what_fsdp1_at_n_saves(cache_root, m, bf16, n, tmp_path):
    """The units and the alignment are told from the source's slices (each block and the root; 4 elements,
    8 under bf16 compute); FSDP1 at N, loaded with the full state, is the oracle."""
    src = _fsdp1_run(cache_root, m, bf16)
    ckptshard.reshard(str(src), str(tmp_path / "ours"), n, progress=False)
    torch_fsdp_runs.fsdp1_torch_at(str(src / "ref"), str(tmp_path / "torch"), n, bf16)
    _same_fsdp1_files(tmp_path / "ours", tmp_path / "torch", n)
    with open(tmp_path / "ours" / "fsdp_config.json") as f:
        assert json.load(f)["world_size"] == n
    if (m, n) == (3, 2):  # resumed as verl resumes: one more step equals one from torch's own files
        torch_fsdp_runs.fsdp1_step_from(str(tmp_path / "ours"), str(tmp_path / "ours.pt"), n)
        torch_fsdp_runs.fsdp1_step_from(str(tmp_path / "torch"), str(tmp_path / "theirs.pt"), n)
        _assert_equal(_load(tmp_path / "ours.pt"), _load(tmp_path / "theirs.pt"), "after one step")


NO_TORCH = (
    "import sys, ckptshard; ckptshard.reshard(sys.argv[1], sys.argv[2], 4, like=(sys.argv[3:] or [None])[0], "
    "progress=False); print('torch' in sys.modules)"
)


def test_fsdp1_reshard_imports_no_torch_and_equals_torchs_own_pickling(cache_root, tmp_path, monkeypatch):
    """The ShardedTensors are the source's own pickles rewritten (3 -> 4 leaves the 2-element parameter's last
    ranks no shard); torch's pickling of the same plan, taken where the rewrite does not know a pickle,
    gives the same files."""
    src = _fsdp1_run(cache_root, 3, False)
    run = [sys.executable, "-c", NO_TORCH, str(src), str(tmp_path / "fast")]
    out = subprocess.run(run, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stderr

    def refuse(self, fill):
        raise Unsupported("test: let torch pickle it")

    monkeypatch.setattr(DTensorWriter, "__call__", refuse)
    ckptshard.reshard(str(src), str(tmp_path / "torch"), 4, progress=False)
    _same_fsdp1_files(tmp_path / "fast", tmp_path / "torch", 4)


def test_fsdp1_model_files_alone_reshard_without_telling_units(cache_root, tmp_path):
    """No optimizer files: nothing to cut by units, the model files alone at N."""
    src = tmp_path / "src"
    shutil.copytree(_fsdp1_run(cache_root, 2, False), src, ignore=shutil.ignore_patterns("optim_*"))
    ckptshard.reshard(str(src), str(tmp_path / "ours"), 3, progress=False)
    assert not list((tmp_path / "ours").glob("optim_*"))
    torch_fsdp_runs.fsdp1_torch_at(str(src / "ref"), str(tmp_path / "torch"), 3)
    torch_fsdp_runs.fsdp1_same_models(str(tmp_path / "ours"), str(tmp_path / "torch"), 3)


def test_fsdp1_reshard_chain_equals_one_reshard(cache_root, tmp_path):
    src = _fsdp1_run(cache_root, 3, False)
    ckptshard.reshard(str(src), str(tmp_path / "two"), 2, progress=False)
    ckptshard.reshard(str(tmp_path / "two"), str(tmp_path / "chain"), 4, progress=False)
    ckptshard.reshard(str(src), str(tmp_path / "direct"), 4, progress=False)
    _same_fsdp1_files(tmp_path / "chain", tmp_path / "direct", 4)


def test_fsdp1_reshard_refuses_what_it_would_guess(cache_root, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(_fsdp1_run(cache_root, 3, False), src)
    a, b = src / "optim_world_size_3_rank_0.pt", src / "optim_world_size_3_rank_1.pt"
    a.rename(tmp_path / "tmp.pt")
    b.rename(a)
    (tmp_path / "tmp.pt").rename(b)  # ranks 0 and 1 swapped: the slices fit no flat layout
    with pytest.raises(CheckpointError, match="fit no grouping of the parameters into FSDP units"):
        ckptshard.reshard(str(src), str(tmp_path / "r"), 2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.fixture(scope="module")
def no_shard_run(cache_root):
    """FSDP1 at world size 1: it runs NO_SHARD and saves plain tensors, each moment in its parameter's shape."""
    return _fsdp1_run(cache_root, 1, False)


@pytest.mark.slow
def test_fsdp1_at_world_size_1_consolidates_to_its_full_state(no_shard_run, tmp_path):
    ckptshard.consolidate(str(no_shard_run), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    _assert_equal(_load(tmp_path / "full.pt"), _load(no_shard_run / "ref" / "full_model.pt"), "model")
    _assert_equal(_load(tmp_path / "full.optim.pt"), _load(no_shard_run / "ref" / "full_optim.pt"), "optim")
    s = ckptshard.inspect_checkpoint(str(no_shard_run))
    assert s["kind"] == "fsdp1" and s["world_size"] == 1
    placed = {t["name"]: t["placement"] for t in s["tensors"]}
    # Which plain tensors are parameters, the optimizer's moments tell: the buffer and the tie's second name are
    # not among its 15; the tie's second name is a parameter all the same.
    assert placed["position_scale"].startswith("plain") and placed["head.weight"].startswith("whole")
    ckptshard.convert(str(no_shard_run), str(tmp_path / "dcp"), "dcp", progress=False)
    torch_fsdp_runs.load_dcp(str(tmp_path / "dcp"), str(tmp_path / "at2.pt"), 2)
    at2 = _load(tmp_path / "at2.pt")
    _assert_equal(at2["model"], _load(no_shard_run / "ref" / "full_model.pt"), "model")
    at2["optim"]["state"] = dict(sorted(at2["optim"]["state"].items()))  # FSDP2 orders by parameter, FSDP1 by name
    _assert_equal(at2["optim"], _load(no_shard_run / "ref" / "full_optim.pt"), "optim")


def test_fsdp1_at_world_size_1_with_a_buffer_shaped_like_a_parameter(no_shard_run, tmp_path):
    """A buffer beside parameters of its shape: which entries the moments are is not told. The weights still
    consolidate; the optimizer and reshard are refused, and nothing is written."""
    src = tmp_path / "src"
    shutil.copytree(no_shard_run, src)
    path = src / "model_world_size_1_rank_0.pt"
    sd = _load(path)
    items = list(sd.items())
    at = [k for k, _ in items].index("blocks.0.down.bias") + 1
    torch.save(dict(items[:at] + [("blocks.0.running", torch.ones(6))] + items[at:]), path)
    ckptshard.consolidate(str(src), str(tmp_path / "w.pt"), progress=False)
    assert list(_load(tmp_path / "w.pt")) == list(sd)[:at] + ["blocks.0.running"] + list(sd)[at:]
    with pytest.raises(CheckpointError, match="by order and shape in more than one way"):
        ckptshard.consolidate(str(src), str(tmp_path / "o.pt"), optimizer=True, progress=False)
    with pytest.raises(CheckpointError, match="by order and shape in more than one way"):
        ckptshard.reshard(str(src), str(tmp_path / "r"), 2, optimizer=False, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "w.pt", "w.pt.manifest.json"]


@pytest.mark.slow
def test_reshard_to_world_size_1_is_what_fsdp1_at_1_saves(cache_root, tmp_path):
    src = _fsdp1_run(cache_root, 3, False)
    ckptshard.reshard(str(src), str(tmp_path / "ours"), 1, progress=False)
    torch_fsdp_runs.fsdp1_torch_at(str(src / "ref"), str(tmp_path / "torch"), 1)
    _same_fsdp1_files(tmp_path / "ours", tmp_path / "torch", 1)
    torch_fsdp_runs.fsdp1_step_from(str(tmp_path / "ours"), str(tmp_path / "ours.pt"), 1)
    torch_fsdp_runs.fsdp1_step_from(str(tmp_path / "torch"), str(tmp_path / "theirs.pt"), 1)
    _assert_equal(_load(tmp_path / "ours.pt"), _load(tmp_path / "theirs.pt"), "after one step")


def test_reshard_from_world_size_1(no_shard_run, tmp_path):
    """The model files at 3 are FSDP1 at 3's; the optimizer's units cannot be told from one rank (refused), nor
    the parameters from the model files alone (refused)."""
    with pytest.raises(CheckpointError, match="at world size 1 the slices show no grouping"):
        ckptshard.reshard(str(no_shard_run), str(tmp_path / "refused"), 3, progress=False)
    ckptshard.reshard(str(no_shard_run), str(tmp_path / "ours"), 3, optimizer=False, progress=False)
    torch_fsdp_runs.fsdp1_torch_at(str(no_shard_run / "ref"), str(tmp_path / "torch"), 3)
    torch_fsdp_runs.fsdp1_same_models(str(tmp_path / "ours"), str(tmp_path / "torch"), 3)
    alone = tmp_path / "alone"
    shutil.copytree(no_shard_run, alone, ignore=shutil.ignore_patterns("optim_*"))
    with pytest.raises(CheckpointError, match="saves parameters and buffers alike as plain tensors"):
        ckptshard.reshard(str(alone), str(tmp_path / "refused"), 3, optimizer=False, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "ours", "torch"]


@pytest.mark.parametrize(
    "m, bf16, orig, n",
    [
        (3, False, True, 2),
        (2, False, True, 3),
        (3, True, True, 4),
        (3, False, False, 2),
        (3, False, False, 4),
        (2, False, True, 1),
    ],
)
@pytest.mark.slow
def test_fsdp1_local_state_dict_reshards_to_what_fsdp1_at_n_saves(
    cache_root, flat_params_run, m, bf16, orig, n, tmp_path
):
    """LOCAL_STATE_DICT at M -> N with --like: every unit's flat parameter (padding included) and, under
    use_orig_params, each parameter's slice, as FSDP1 at N holds them after loading the full state."""
    src = _fsdp1_run(cache_root, m, bf16) if orig else flat_params_run
    like = str(src / "ref" / "full_model.pt")
    local = _local_with_optim(src, tmp_path / "local")
    ckptshard.reshard(str(local), str(tmp_path / "ours"), n, like=like, progress=False)
    torch_fsdp_runs.fsdp1_local_at(str(src / "ref"), str(tmp_path / "torch"), n, bf16, orig)
    torch_fsdp_runs.fsdp1_same_models(str(tmp_path / "ours"), str(tmp_path / "torch"), n)
    for r in range(n):  # the raw optimizer state FSDP1 at N holds after loading the full one
        name = f"optim_world_size_{n}_rank_{r}.pt"
        got, want = _load(tmp_path / "ours" / name), _load(tmp_path / "torch" / name)
        if not orig:  # loading flat parameters' state, FSDP1 orders each entry's keys as a set: at random
            assert {p: set(e) for p, e in got["state"].items()} == {p: set(e) for p, e in want["state"].items()}
            want["state"] = {pid: {k: entry[k] for k in got["state"][pid]} for pid, entry in want["state"].items()}
        _assert_equal(got, want, name)
    assert ckptshard.verify(str(tmp_path / "ours")) == []  # without --like: the manifest and the pieces
    assert ckptshard.inspect_checkpoint(str(tmp_path / "ours"))["local_state_dict"] == (n > 1)
    at_n = like if n > 1 else None  # at one rank (NO_SHARD) the files hold the plain tensors
    ckptshard.consolidate(str(tmp_path / "ours"), str(tmp_path / "full.pt"), like=at_n, progress=False)
    _assert_equal(_load(tmp_path / "full.pt"), _load(src / "ref" / "full_model.pt"), "model")


def test_fsdp1_local_state_dict_reshard_imports_no_torch(cache_root, tmp_path):
    """The flat parameters' ShardedTensors (local shards that require grad) and the optimizer files are
    written without torch too; test_fsdp1_local_state_dict_reshards_to_what_fsdp1_at_n_saves checks them."""
    run = _fsdp1_run(cache_root, 3, False)
    local = _local_with_optim(run, tmp_path / "local")
    args = [str(local), str(tmp_path / "out"), str(run / "ref" / "full_model.pt")]
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stderr
    assert len(list((tmp_path / "out").glob("optim_world_size_4_rank_*.pt"))) == 4


def test_fsdp1_local_state_dict_optimizer_of_other_files_is_refused(cache_root, flat_params_run, tmp_path):
    like = str(flat_params_run / "ref" / "full_model.pt")
    local = _local_with_optim(flat_params_run, tmp_path / "local")
    with pytest.raises(CheckpointError, match="keeps flat parameters without use_orig_params"):
        ckptshard.reshard(str(local), str(tmp_path / "one"), 1, like=like, progress=False)
    for f in _fsdp1_run(cache_root, 3, False).glob("optim_world_size_*.pt"):  # use_orig_params: per parameter
        shutil.copy(f, local / f.name)
    with pytest.raises(CheckpointError, match="the optimizer holds 15 parameters and the files 3 flat parameters"):
        ckptshard.consolidate(str(local), str(tmp_path / "full.pt"), like=like, optimizer=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]


def test_fsdp1_local_state_dict_reshard_needs_like_and_the_same_model(cache_root, runs, tmp_path):
    src = _fsdp1_run(cache_root, 3, False) / "local"
    with pytest.raises(CheckpointError, match="pass --like FULL"):
        ckptshard.reshard(str(src), str(tmp_path / "a"), 2, progress=False)
    with pytest.raises(CheckpointError, match="--like is for FSDP1 LOCAL_STATE_DICT files"):
        ckptshard.reshard(str(runs[2]), str(tmp_path / "b"), 3, like=str(src.parent / "ref" / "full_model.pt"))
    other = tmp_path / "other.pt"
    full = _load(src.parent / "ref" / "full_model.pt")
    torch.save({**full, "blocks.0.up.bias": torch.zeros(8)}, other)  # one element more
    with pytest.raises(CheckpointError, match="is stored as .0., --like has .8.: not the same model"):
        ckptshard.reshard(str(src), str(tmp_path / "c"), 2, like=str(other), progress=False)
    first = "blocks.0.down.weight"  # the same tensors in another order: the flat layout no longer fits
    torch.save({first: full[first], **{k: v for k, v in full.items() if k != first}}, other)
    with pytest.raises(CheckpointError, match="fit no 2-, 4- or 8-element alignment"):
        ckptshard.reshard(str(src), str(tmp_path / "c"), 2, like=str(other), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pt"]


def test_fsdp1_and_fsdp2_files_mixed_are_refused(fsdp1_runs, runs, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(fsdp1_runs[2], mixed)
    shutil.copy(runs[2] / "model_world_size_2_rank_1.pt", mixed / "model_world_size_2_rank_1.pt")
    with pytest.raises(CheckpointError, match="FSDP1 .ShardedTensor. and FSDP2 .DTensor. files mixed"):
        ckptshard.consolidate(str(mixed), str(tmp_path / "m.pt"), progress=False)


@pytest.mark.slow
def test_bf16_mixed_precision_run_stores_fp32_and_reshards_like_torch(cache_root, torch_files, runs, tmp_path):
    """verl trains FSDP2 with bf16 compute over fp32 shards: the files hold fp32, read and re-cut the same way."""
    src = _once(cache_root / f"fsdp2-bf16-ws3-{CODE}", lambda d: torch_fsdp_runs.build_fsdp2_run(d, 3, bf16=True))
    ckptshard.consolidate(str(src), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    _assert_equal(_load(tmp_path / "full.pt"), _load(src / "ref" / "full_model.pt"), "model")
    _assert_equal(_load(tmp_path / "full.optim.pt"), _load(src / "ref" / "full_optim.pt"), "optim")
    assert all(v.dtype == torch.float32 for v in _load(tmp_path / "full.pt").values() if v.is_floating_point())
    ckptshard.reshard(str(src), str(tmp_path / "r2"), 2, progress=False)
    torch_fsdp_runs.torch_at(str(src / "ref"), str(tmp_path / "t2"), 2)
    for r in range(2):
        for kind in ("model", "optim"):
            name = f"{kind}_world_size_2_rank_{r}.pt"
            _assert_equal(_load(tmp_path / "r2" / name), _load(tmp_path / "t2" / name), name)


WARM_RESHARD = """
import sys, ckptshard
ckptshard.reshard(sys.argv[1], sys.argv[2], 4, progress=False, shard_group=2, mesh_dim_names=["ddp", "fsdp"])
print("torch imported" if "torch" in sys.modules else "torch not imported")
"""


def _reshard_to_hsdp(src, out, env):
    done = subprocess.run(
        [sys.executable, "-c", WARM_RESHARD, str(src), str(out)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.pt"))}


@pytest.mark.slow
def test_hsdp_mesh_templates_kept_between_runs(runs, tmp_path):
    """The DTensor pickles torch makes for an HSDP mesh are kept: a second run imports no torch and writes
    the same bytes, equal to FSDP2's own files; an entry that does not read back is made again; with the
    cache off nothing is kept."""
    import os

    cache = tmp_path / "cache"
    env = dict(os.environ, CKPTSHARD_CACHE_DIR=str(cache))
    assert _reshard_to_hsdp(runs[3], tmp_path / "cold", env) == "torch imported"
    kept = sorted(cache.glob("mesh-templates/*.pt"))
    assert len(kept) >= 4  # one per rank at least
    assert _reshard_to_hsdp(runs[3], tmp_path / "warm", env) == "torch not imported"
    torch_fsdp_runs.torch_at(str(runs[3] / "ref"), str(tmp_path / "torch"), 4, replicas=2)
    _same_files(tmp_path / "warm", tmp_path / "torch", 4)
    assert _digests(tmp_path / "warm") == _digests(tmp_path / "cold")

    kept[0].write_bytes(kept[0].read_bytes()[:-7] + b"garbage")  # damaged: its digest no longer matches
    (cache / "mesh-templates" / (kept[1].stem + ".json")).write_text("{not json")
    assert _reshard_to_hsdp(runs[3], tmp_path / "remade", env) == "torch imported"
    assert _digests(tmp_path / "remade") == _digests(tmp_path / "cold")
    assert _reshard_to_hsdp(runs[3], tmp_path / "again", env) == "torch not imported"

    off = tmp_path / "off-cache"
    _reshard_to_hsdp(runs[3], tmp_path / "off", dict(env, CKPTSHARD_CACHE_DIR=str(off), CKPTSHARD_NO_CACHE="1"))
    assert not off.exists()
    assert _digests(tmp_path / "off") == _digests(tmp_path / "cold")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    _reshard_to_hsdp(runs[3], tmp_path / "blocked", dict(env, CKPTSHARD_CACHE_DIR=str(blocked)))
    assert _digests(tmp_path / "blocked") == _digests(tmp_path / "cold")

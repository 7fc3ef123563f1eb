"""convert --to dcp and back, against real torch FSDP2 and torch's own DCP tools."""

import hashlib
import os
import pickle
import subprocess
import sys

import pytest
import torch
from conftest import FSDP2_WORLD_SIZES, load_ref, src_of

from ckptshard.errors import CheckpointError
from ckptshard.execute.convert import convert
from ckptshard.read.dcp import read_metadata
from ckptshard.read.source import open_checkpoint

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)


def _names_by_gid(src):
    """fairscale's full optimizer format numbers parameters in flat order: gid -> logical name."""
    ckpt = open_checkpoint(src)
    return [p.prefix + i.logical_name(m.name) for p, i, fp in ckpt.layout.flat_params() for m in fp.members]


def _assert_state_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("ws", FSDP2_WORLD_SIZES)
def test_fsdp2_loads_weights_exactly(fsdp2_runs, fixtures, ws):
    got = torch.load(fsdp2_runs["loaded"][("mixed3", ws)], weights_only=False)
    _assert_state_equal(got["model"], load_ref(fixtures[3], "full_state_dict.pt"))


def test_fsdp2_loads_vissl_container(fsdp2_runs, fixtures):
    got = torch.load(fsdp2_runs["loaded"][("vissl2", 2)], weights_only=False)
    _assert_state_equal(got["model"], load_ref(fixtures[2], "full_state_dict.pt"))


@pytest.mark.parametrize("ws", FSDP2_WORLD_SIZES)
def test_fsdp2_loads_optimizer_exactly(fsdp2_runs, fixtures, ws):
    got = torch.load(fsdp2_runs["loaded"][("mixed3", ws)], weights_only=False)["optim"]
    ref = torch.load(fixtures[3] / "ref" / "full_optim.pt", weights_only=False)
    names = _names_by_gid(src_of(fixtures[3], "fairseq"))
    assert set(got["state"]) == set(names)
    for gid, name in enumerate(names):
        mine, theirs = got["state"][name], ref["state"][gid]
        assert set(mine) == set(theirs), name
        assert float(mine["step"]) == float(theirs["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[k], theirs[k].reshape(mine[k].shape)), (name, k)
    (group,) = got["param_groups"]
    want = {k: v for k, v in ref["param_groups"][0].items() if k != "params"}
    assert {k: group[k] for k in want} == want


@pytest.mark.parametrize("ws", FSDP2_WORLD_SIZES)
def test_fsdp2_step_after_loading_matches_fairscale(fsdp2_runs, next_step_fixture, ws):
    got = torch.load(fsdp2_runs["loaded"][("next", ws)], weights_only=False)
    ref = torch.load(next_step_fixture / "ref" / "next_step.pt", weights_only=False)
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    after, want = got["after"], ref["full_state_dict"]
    assert set(after) == set(want)
    for k, w in want.items():
        if w.is_floating_point():
            scale = w.abs().max().item() or 1.0
            assert (after[k] - w).abs().max().item() <= 1e-5 * scale, k
        else:
            assert torch.equal(after[k], w), k
    # The step moved the weights: the comparison above is not of the loaded state with itself.
    before = torch.load(fsdp2_runs["loaded"][("next", ws)], weights_only=False)["model"]
    assert not torch.equal(before["trunk.blocks.0.fc.weight"], after["trunk.blocks.0.fc.weight"])


def test_tensors_spanning_shards_become_several_chunks(fsdp2_runs, fixtures):
    md = read_metadata(str(fsdp2_runs["dcp"]["mixed3"]))
    fc = md.state_dict_metadata["model.trunk.blocks.0.fc.weight"]
    assert len(fc.chunks) > 1 and all(list(c.sizes) != list(fc.size) for c in fc.chunks)
    assert sum(c.sizes.numel() for c in fc.chunks) == fc.size.numel()
    # one data file per source shard: nothing gathered into one place
    assert sorted(f for f in os.listdir(fsdp2_runs["dcp"]["mixed3"]) if f.endswith(".distcp")) == [
        f"__{i}_0.distcp" for i in range(3)
    ]


def _assert_tree_equal(a, b, path=""):
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("which", ["ours", "torch"])
def test_dcp_to_torch_equals_dcp_to_torch_save(fsdp2_runs, tmp_path, which):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = str(fsdp2_runs["dcp"]["mixed3"] if which == "ours" else fsdp2_runs["saved"])
    dcp_to_torch_save(folder, str(tmp_path / "theirs.pt"))
    convert(folder, str(tmp_path / "ours.pt"), "torch", progress=False)
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=False)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)  # stock torch, safe loading
    _assert_tree_equal(ours, theirs)


def test_dcp_to_safetensors_selects_the_model(fsdp2_runs, fixtures, tmp_path):
    from safetensors.torch import load_file

    folder = str(fsdp2_runs["dcp"]["mixed3"])
    out = tmp_path / "m.safetensors"
    convert(folder, str(out), "safetensors", select=["model."], strip_prefix=["model."], progress=False)
    _assert_state_equal(load_file(out), load_ref(fixtures[3], "full_state_dict.pt"))
    with pytest.raises(CheckpointError, match="not tensors.*--select"):
        convert(folder, str(tmp_path / "all.safetensors"), "safetensors", progress=False)
    assert not (tmp_path / "all.safetensors").exists()


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("which", ["ours", "torch"])
def test_dcp_to_fairscale_equals_reshard(fsdp2_runs, fixtures, resharded, tmp_path, n, which):
    """fairscale(3) -> DCP [-> FSDP2 at 2 -> dcp.save] -> fairscale(n) holds what reshard 3 -> n writes."""
    folder = str(fsdp2_runs["dcp"]["mixed3"] if which == "ours" else fsdp2_runs["saved"])
    out = tmp_path / "fs"
    like = src_of(fixtures[3], "fairseq")
    convert(folder, str(out), "fairscale", like=like, world_size=n, progress=False)
    want_dir = resharded[(3, "fairseq", n)]
    names = sorted(f for f in os.listdir(want_dir) if f.endswith(".pt"))
    assert sorted(f for f in os.listdir(out) if f.endswith(".pt")) == names
    for name in names:
        got = torch.load(out / name, weights_only=True)
        want = torch.load(want_dir / name, weights_only=True)
        _assert_state_equal(got["model"], want["model"])
        assert got["fsdp_metadata"] == want["fsdp_metadata"]
        go, wo = got["last_optimizer_state"], want["last_optimizer_state"]
        assert go["param_groups"] == wo["param_groups"] and go["loss_scale"] == wo["loss_scale"]
        assert set(go["state"]) == set(wo["state"])
        for pid in wo["state"]:
            for k, v in wo["state"][pid].items():
                g = go["state"][pid][k]
                if k == "step" and which == "torch":
                    # The fixture's step is a Python float (gather_full_optim_state_dict made it one before
                    # the save); torch's Adam turned it back into a tensor before FSDP2 re-saved it.
                    assert float(g) == float(v)
                elif isinstance(v, torch.Tensor):
                    assert torch.equal(g, v), (name, pid, k)
                else:
                    assert type(g) is type(v) and g == v, (name, pid, k)


def test_dtype_casts_weights_not_optimizer(fixtures, tmp_path):
    from ckptshard.read.dcp import open_dcp

    out = tmp_path / "bf16.dcp"
    convert(src_of(fixtures[2], "fairseq"), str(out), "dcp", dtype="bf16", progress=False)
    md = read_metadata(str(out))
    assert md.state_dict_metadata["model.trunk.embed_in.weight"].properties.dtype == torch.bfloat16
    assert md.state_dict_metadata["model.trunk.stem_bn.num_batches_tracked"].properties.dtype == torch.int64
    assert md.state_dict_metadata["optim.state.trunk.embed_in.weight.exp_avg"].properties.dtype == torch.float32
    ref = load_ref(fixtures[2], "full_state_dict.pt")
    from ckptshard.read.tensor_data import materialize

    model = materialize(open_dcp(str(out)).tree["model"])
    assert torch.equal(model["trunk.embed_in.weight"], ref["trunk.embed_in.weight"].to(torch.bfloat16))


def _md5s(folder):
    return {f: hashlib.md5((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))}


def test_same_input_gives_byte_identical_dcp(fixtures, tmp_path):
    for name in ("a", "b"):
        convert(src_of(fixtures[3], "vissl"), str(tmp_path / name), "dcp", progress=False)
    assert _md5s(tmp_path / "a") == _md5s(tmp_path / "b")


def test_no_optimizer_and_rename(fixtures, tmp_path):
    out = tmp_path / "trunk.dcp"
    convert(src_of(fixtures[2], "fairseq"), str(out), "dcp", select=["trunk."], strip_prefix=["trunk."], progress=False)
    md = read_metadata(str(out))
    model = sorted(k for k in md.state_dict_metadata if k.startswith("model."))
    assert model and all(not k.startswith("model.trunk.") and not k.startswith("model.heads") for k in model)
    assert "optim.state.embed_in.weight.exp_avg" in md.state_dict_metadata
    assert not any(k.startswith("optim.state.heads") for k in md.state_dict_metadata)
    out2 = tmp_path / "noopt.dcp"
    convert(src_of(fixtures[2], "fairseq"), str(out2), "dcp", optimizer=False, progress=False)
    assert not any(k.startswith("optim.") for k in read_metadata(str(out2)).state_dict_metadata)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ckptshard.cli", *args], capture_output=True, text=True)


def test_bad_dcp_inputs_fail_cleanly(fsdp2_runs, fixtures, tmp_path):
    import shutil

    broken = tmp_path / "broken.dcp"
    shutil.copytree(fsdp2_runs["dcp"]["mixed3"], broken)
    os.remove(broken / "__1_0.distcp")
    res = _cli("convert", str(broken), "--to", "torch", "-o", str(tmp_path / "x.pt"))
    assert res.returncode == 2 and "__1_0.distcp is missing" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.pt").exists()

    evil = tmp_path / "evil.dcp"
    shutil.copytree(fsdp2_runs["dcp"]["mixed3"], evil)
    with open(evil / ".metadata", "wb") as f:
        pickle.dump(os.system, f)  # a global that would run code
    res = _cli("convert", str(evil), "--to", "torch", "-o", str(tmp_path / "y.pt"))
    assert res.returncode == 2 and "refused to unpickle posix.system" in res.stderr

    res = _cli("convert", str(fsdp2_runs["dcp"]["mixed3"]), "--to", "fairscale", "-n", "2", "-o", str(tmp_path / "z"))
    assert res.returncode == 2 and "--like" in res.stderr and not (tmp_path / "z").exists()

    res = _cli("convert", str(fsdp2_runs["dcp"]["mixed3"]), "--to", "safetensors", "-o", str(tmp_path / "w.pt"))
    assert res.returncode == 2 and "--to safetensors" in res.stderr


def test_verify_checks_a_dcp_output(fixtures, tmp_path):
    out = tmp_path / "v.dcp"
    convert(src_of(fixtures[2], "fairseq"), str(out), "dcp", progress=False)
    assert _cli("verify", str(out)).returncode == 0
    data = bytearray((out / "__1_0.distcp").read_bytes())
    data[-100] ^= 1
    (out / "__1_0.distcp").write_bytes(bytes(data))
    res = _cli("verify", str(out))
    assert res.returncode == 2 and "__1_0.distcp" in res.stderr


def _per_rank_expert_copy(fixtures, tmp_path):
    """World size 2 with trunk.gate held whole by each rank, each its own values (an MoE expert)."""
    src = tmp_path / "moe"
    src.mkdir()
    for r in range(2):
        obj = torch.load(fixtures[2] / "fairseq" / f"checkpoint_last-shard{r}.pt", weights_only=False)
        (entry,) = [e for e in obj["fsdp_metadata"]["param_metadata"] if e["fsdp_path"] == "trunk.gate"]
        entry["no_broadcast_optim_state"] = True
        entry["params"]["flat_param_0"]["padding"] = 0
        obj["model"]["trunk.gate.flat_param_0"] = torch.linspace(0, 1, 3) + r  # each rank its own expert
        torch.save(obj, src / f"checkpoint_last-shard{r}.pt")
    return src


def test_per_rank_experts_consolidate_from_rank_0_with_a_note(fixtures, tmp_path):
    """As fairscale's consolidate_shard_weights: rank 0's copy, and the user is told the others are not in it."""
    from ckptshard.execute.consolidate import consolidate

    src = _per_rank_expert_copy(fixtures, tmp_path)
    res = consolidate(str(src), str(tmp_path / "full.pt"), progress=False)
    got = torch.load(tmp_path / "full.pt", weights_only=True)
    assert torch.equal(got["trunk.gate.scale"], torch.linspace(0, 1, 3))
    (note,) = res.notes
    assert "trunk.gate" in note and "rank 0's copy" in note
    clean = consolidate(src_of(fixtures[2], "fairseq"), str(tmp_path / "clean.pt"), progress=False)
    assert clean.notes == []


def test_per_rank_experts_are_refused_not_dropped(fixtures, tmp_path):
    """An instance each rank holds whole (no_broadcast_optim_state) has no single DCP value."""
    src = _per_rank_expert_copy(fixtures, tmp_path)
    with pytest.raises(CheckpointError, match="trunk.gate: each rank holds its own"):
        convert(str(src), str(tmp_path / "out.dcp"), "dcp", progress=False)
    assert not (tmp_path / "out.dcp").exists()


@pytest.mark.parametrize("which", ["ws1", "half"])
def test_other_fixtures_round_trip_through_torchs_reader(fixtures, half_fixture, tmp_path, which):
    """World size 1 (unflattened params in their own shape) and a pure-fp16 trunk with SGD momentum."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = fixtures[1] if which == "ws1" else half_fixture
    out = tmp_path / "x.dcp"
    convert(src_of(folder, "fairseq"), str(out), "dcp", progress=False)
    dcp_to_torch_save(str(out), str(tmp_path / "x.pt"))
    got = torch.load(tmp_path / "x.pt", weights_only=False)
    _assert_state_equal(got["model"], load_ref(folder, "full_state_dict.pt"))
    if which == "half":
        ref = torch.load(folder / "ref" / "full_optim.pt", weights_only=False)
        names = _names_by_gid(src_of(folder, "fairseq"))
        for gid, name in enumerate(names):
            mine = got["optim"]["state"][name]["momentum_buffer"]
            assert torch.equal(mine, ref["state"][gid]["momentum_buffer"].reshape(mine.shape)), name


def test_dcp_without_optimizer_state_needs_no_optimizer_for_fairscale(fixtures, tmp_path):
    weights_only = tmp_path / "w.dcp"
    convert(src_of(fixtures[2], "fairseq"), str(weights_only), "dcp", optimizer=False, progress=False)
    with pytest.raises(CheckpointError, match="--no-optimizer"):
        convert(
            str(weights_only),
            str(tmp_path / "fs"),
            "fairscale",
            like=src_of(fixtures[2], "fairseq"),
            world_size=2,
            progress=False,
        )
    convert(
        str(weights_only),
        str(tmp_path / "fs"),
        "fairscale",
        like=src_of(fixtures[2], "fairseq"),
        world_size=2,
        optimizer=False,
        progress=False,
    )
    shard0 = torch.load(tmp_path / "fs" / "checkpoint_last-shard0.pt", weights_only=True)
    assert "last_optimizer_state" not in shard0
    assert torch.equal(
        shard0["model"]["trunk.flat_param_0"],
        torch.load(fixtures[2] / "fairseq" / "checkpoint_last-shard0.pt", weights_only=False)["model"][
            "trunk.flat_param_0"
        ],
    )


def test_jobs_write_the_same_bytes(fixtures, tmp_path):
    convert(src_of(fixtures[3], "metaseq"), str(tmp_path / "one"), "dcp", progress=False)
    convert(src_of(fixtures[3], "metaseq"), str(tmp_path / "two"), "dcp", jobs=2, progress=False)
    assert _md5s(tmp_path / "one") == _md5s(tmp_path / "two")


def test_cli_round_trip(fixtures, tmp_path):
    from safetensors.torch import load_file

    src = src_of(fixtures[2], "vissl")
    res = _cli("convert", src, "--to", "dcp", "-o", str(tmp_path / "c.dcp"), "-q")
    assert res.returncode == 0 and "34 tensors" in res.stdout, res.stderr
    res = _cli(
        "convert",
        str(tmp_path / "c.dcp"),
        "--to",
        "safetensors",
        "-o",
        str(tmp_path / "t.safetensors"),
        "--select",
        "model.trunk.",
        "--strip-prefix",
        "model.trunk.",
        "--dtype",
        "fp16",
        "-q",
    )
    assert res.returncode == 0, res.stderr
    got = load_file(tmp_path / "t.safetensors")
    ref = load_ref(fixtures[2], "full_state_dict.pt")
    assert set(got) == {k[len("trunk.") :] for k in ref if k.startswith("trunk.")}
    assert torch.equal(got["blocks.0.fc.weight"], ref["trunk.blocks.0.fc.weight"].half())
    assert got["stem_bn.num_batches_tracked"].dtype == torch.int64
    assert _cli("verify", str(tmp_path / "t.safetensors")).returncode == 0


def test_no_optimizer_leaves_the_optimizer_out_of_a_torch_output(fsdp2_runs, tmp_path):
    convert(str(fsdp2_runs["dcp"]["mixed3"]), str(tmp_path / "m.pt"), "torch", optimizer=False, progress=False)
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert sorted(got) == ["extra", "model"]


def test_column_sharded_dtensors_read_like_torch_reads_them(fsdp2_runs, tmp_path):
    """Boxes that are not contiguous (Shard(1) of a matrix: one run per row) read back exactly."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = str(fsdp2_runs["dtensors"])
    md = read_metadata(folder)
    assert len(md.state_dict_metadata["model.cols"].chunks) == 3
    assert all(c.sizes[0] == 5 for c in md.state_dict_metadata["model.cols"].chunks)  # column boxes
    full = torch.load(folder + ".full.pt", weights_only=True)
    dcp_to_torch_save(folder, str(tmp_path / "theirs.pt"))
    convert(folder, str(tmp_path / "ours.pt"), "torch", progress=False)
    _assert_tree_equal(
        torch.load(tmp_path / "ours.pt", weights_only=True), torch.load(tmp_path / "theirs.pt", weights_only=False)
    )
    convert(folder, str(tmp_path / "m.safetensors"), "safetensors", strip_prefix=["model."], progress=False)
    got = load_file(tmp_path / "m.safetensors")
    for k in ("cols", "rows", "mid"):
        assert torch.equal(got[k], full[k]), k
    assert torch.equal(got["plain"], full["cols"].double())


def test_inspect_reads_a_dcp_folder_from_its_metadata(fsdp2_runs):
    import json

    res = _cli("inspect", str(fsdp2_runs["saved"]), "--json")  # written by torch's own dcp.save
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    by_name = {t["name"]: t for t in s["tensors"]}
    fc = by_name["model.trunk.blocks.0.fc.weight"]
    assert fc["shape"] == [12, 12] and fc["dtype"] == "float32" and fc["chunks"] == 2  # FSDP2 at 2 ranks: Shard(0)
    assert "optim.param_groups.0.lr" in s["values"]
    text = _cli("inspect", str(fsdp2_runs["dcp"]["mixed3"])).stdout
    assert "torch.distributed.checkpoint (DCP)" in text and "model.trunk.gate.scale  float32  (3,)" in text


def test_every_frame_passes_zip_crc_checks(fixtures, tmp_path):
    """Each DCP item is a torch.save frame; the tensor ones are filled in place, so their CRCs are ours to set."""
    import io
    import zipfile

    convert(src_of(fixtures[3], "fairseq"), str(tmp_path / "d"), "dcp", progress=False)
    md = read_metadata(str(tmp_path / "d"))
    frames = 0
    for info in md.storage_data.values():
        with open(tmp_path / "d" / info.relative_path, "rb") as f:
            f.seek(info.offset)
            frame = f.read(info.length)
        with zipfile.ZipFile(io.BytesIO(frame)) as z:
            data = [i for i in z.infolist() if "/data/" in i.filename and i.file_size]
            frames += bool(data and all(i.CRC for i in data))
            assert z.testzip() is None, info
    assert frames > 20  # tensor chunks, with their CRCs set

"""The whole tool on the torch that runs it: CI runs this module on the oldest and the newest torch too.

Every feature of the table in README's "Tested with" is one test here, on a
real fp32 fairscale run made with the torch under test (fp16 compute on the
CPU is newer than torch 2.0, so the fp16 fixtures of the other modules are
not used). Golden files in ``tests/data/golden`` (made by
``scripts/make_golden.py``) guard the other direction: what ckptshard
writes must stay byte for byte what every torch in the range has read.
"""

import hashlib
import json
import os
import pathlib
import shutil

import pytest
import torch

import ckptshard
from ckptshard.fsdp.launch import run_world

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

GOLDEN = pathlib.Path(__file__).parent / "data" / "golden"


def _equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def run(next_step_fixture):
    """A real fp32 fairscale run at world size 2, made with this torch: (fairseq shards, live state_dict())."""
    return str(next_step_fixture / "fairseq"), _load(next_step_fixture / "ref" / "full_state_dict.pt")


@pytest.fixture(scope="module")
def resharded3(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("range") / "r3"
    ckptshard.reshard(run[0], str(out), 3, progress=False)
    return out


def test_consolidate(run, tmp_path):
    ckptshard.consolidate(run[0], str(tmp_path / "full.pt"), progress=False)
    _equal(_load(tmp_path / "full.pt"), run[1])


def test_consolidate_with_the_torch_reader(run, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    ckptshard.consolidate(run[0], str(tmp_path / "full.pt"), progress=False)
    _equal(_load(tmp_path / "full.pt"), run[1])


def test_consolidate_trusting_pickles(run, tmp_path):
    with pytest.warns(UserWarning, match="trust-pickles"):
        ckptshard.consolidate(run[0], str(tmp_path / "full.pt"), trust_pickles=True, progress=False)
    _equal(_load(tmp_path / "full.pt"), run[1])


def test_reshard(run, resharded3, tmp_path):
    assert sorted(p.name for p in resharded3.glob("*.pt")) == [f"checkpoint_last-shard{r}.pt" for r in range(3)]
    for p in resharded3.glob("*.pt"):
        assert "model" in _load(p)  # this torch reads each shard weights-only
    ckptshard.consolidate(str(resharded3), str(tmp_path / "full.pt"), progress=False)
    _equal(_load(tmp_path / "full.pt"), run[1])


def test_verify(run, resharded3, tmp_path):
    assert ckptshard.verify(str(resharded3)) == []
    bad = tmp_path / "bad"
    shutil.copytree(resharded3, bad)
    with open(bad / "checkpoint_last-shard1.pt", "r+b") as f:
        f.seek(-200, os.SEEK_END)
        f.write(b"\xff" * 8)
    assert ckptshard.verify(str(bad)), "a changed byte must be reported"


def test_shard(run, resharded3, tmp_path):
    full = tmp_path / "full.pt"
    torch.save(run[1], full)  # saved by this torch
    ckptshard.shard(str(full), run[0], str(tmp_path / "s3"), 3, progress=False)
    for r in range(3):
        ours, theirs = (
            _load(tmp_path / "s3" / f"checkpoint_last-shard{r}.pt"),
            _load(resharded3 / f"checkpoint_last-shard{r}.pt"),
        )
        _equal(ours["model"], theirs["model"])


def _dcp_load(folder, like):
    """``folder`` loaded by this torch's DCP, without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata

    if not hasattr(metadata, "_MEM_FORMAT_ENCODING"):
        pytest.skip("torch 2.0's DCP names its metadata classes otherwise: it cannot read today's DCP format")

    sd = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    reader = dcp.FileSystemReader(str(folder))
    if hasattr(dcp, "load"):  # torch 2.2+
        dcp.load(sd, storage_reader=reader)
    else:
        dcp.load_state_dict(sd, reader, no_dist=True)
    return sd["model"]


def test_convert_to_dcp_loads_with_this_torchs_dcp(run, tmp_path):
    ckptshard.convert(run[0], str(tmp_path / "dcp"), "dcp", progress=False)
    _equal(_dcp_load(tmp_path / "dcp", run[1]), run[1])


def _load_worker(rank, world_size, src, full_path, out):
    from ckptshard.fsdp.loading import load_checkpoint
    from ckptshard.testing.fixtures import make_optimizer, wrap_fixture_model
    from ckptshard.testing.model import VisslLikeModel

    root = wrap_fixture_model(VisslLikeModel(), "fp32")
    optim = make_optimizer(root.parameters(), "fp32")
    load_checkpoint(root, src, optim)
    wrapped = root.state_dict()
    plain = VisslLikeModel()
    load_checkpoint(plain, src)
    if rank == 0:
        torch.save({"wrapped": wrapped, "plain": plain.state_dict(), "steps": len(optim.state_dict()["state"])}, out)


def test_load_checkpoint_wrapped_and_plain(run, resharded3, tmp_path):
    run_world(_load_worker, 2, str(resharded3), None, str(tmp_path / "res.pt"))
    res = _load(tmp_path / "res.pt")
    _equal(res["wrapped"], run[1])
    _equal(res["plain"], run[1])
    assert res["steps"] > 0, "the optimizer state was loaded"


def test_verify_resume_2_to_3(tmp_path):
    from ckptshard.harness.verify_resume import reshard_scenario

    (result,) = ckptshard.verify_resume(scenarios=[reshard_scenario("2->3")], steps=4, ckpt_step=2, work=str(tmp_path))
    assert result.ok, result


# Golden files: ckptshard's outputs of one committed real fairscale checkpoint.


def _digest(folder):
    """Each file's sha256; a manifest's with the source's paths (which name the folder it was run in) left out."""

    def content(p):
        if not p.name.endswith("manifest.json"):
            return p.read_bytes()
        manifest = json.loads(p.read_text())
        manifest["source"]["files"] = [os.path.basename(f) for f in manifest["source"]["files"]]
        return json.dumps(manifest, sort_keys=True).encode()

    return {
        str(p.relative_to(folder)): hashlib.sha256(content(p)).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_golden_outputs_read_by_this_torch():
    ref = _load(GOLDEN / "ref" / "full_state_dict.pt")
    _equal(_load(GOLDEN / "out" / "consolidated.pt"), ref)
    for r in range(3):
        shard = _load(GOLDEN / "out" / "resharded-3" / f"checkpoint_last-shard{r}.pt")
        assert shard["model"] and "last_optimizer_state" in shard


def test_golden_dcp_read_by_this_torch():
    ref = _load(GOLDEN / "ref" / "full_state_dict.pt")
    _equal(_dcp_load(GOLDEN / "out" / "dcp", ref), ref)


def test_golden_outputs_have_not_drifted(tmp_path):
    """Today's writer gives the committed bytes; if a change is deliberate, rerun scripts/make_golden.py."""
    from ckptshard.testing.golden import write_outputs

    write_outputs(GOLDEN / "in", tmp_path)
    assert _digest(tmp_path) == _digest(GOLDEN / "out")


def test_fsdp2_files_consolidate_with_this_torch(tmp_path):
    """Per-rank FSDP2 files (a real world-size-2 run, committed) are read without torch: any torch in the range."""
    src = GOLDEN / "fsdp2"
    ckptshard.consolidate(str(src), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    _equal(_load(tmp_path / "full.pt"), _load(src / "full_model.pt"))
    got, want = _load(tmp_path / "full.optim.pt"), _load(src / "full_optim.pt")
    assert got["param_groups"] == want["param_groups"]
    for name, entry in want["state"].items():
        _equal(got["state"][name], entry)


def test_fsdp2_files_reshard_with_this_torch(tmp_path):
    """2 -> 3 of committed FSDP2 files (torch 2.13's pickles), written without torch whatever torch is
    installed: consolidating the output gives the full model and optimizer back. A torch that reads the
    source's DTensors also loads each rank's piece, equal to ``torch.chunk`` of the whole, the moments too."""
    src = GOLDEN / "fsdp2"
    ckptshard.reshard(str(src), str(tmp_path / "r3"), 3, progress=False)
    full, optim = _load(src / "full_model.pt"), _load(src / "full_optim.pt")
    ckptshard.consolidate(str(tmp_path / "r3"), str(tmp_path / "back.pt"), optimizer=True, progress=False)
    _equal(_load(tmp_path / "back.pt"), full)
    back = _load(tmp_path / "back.optim.pt")
    for name, entry in optim["state"].items():
        _equal(back["state"][name], entry)
    try:
        torch.load(src / "model_world_size_2_rank_0.pt", weights_only=False)
    except (ImportError, AttributeError):
        return  # this torch cannot read the source's DTensors either: no DTensor, or another release's classes
    names = list(optim["state"])  # FSDP2's full optimizer state: by name, in parameter order
    for r in range(3):
        model = torch.load(tmp_path / "r3" / f"model_world_size_3_rank_{r}.pt", weights_only=False)
        osd = torch.load(tmp_path / "r3" / f"optim_world_size_3_rank_{r}.pt", weights_only=False)
        mesh = next(v for v in model.values() if hasattr(v, "device_mesh")).device_mesh
        assert vars(mesh)["_rank"] == r and vars(mesh)["_flatten_rank_map"] == (0, 1, 2)
        pieces = [(name, v.to_local(), full[name]) for name, v in model.items() if hasattr(v, "to_local")]
        for pid, entry in osd["state"].items():
            pieces += [(k, v.to_local(), optim["state"][names[pid]][k]) for k, v in entry.items() if v.dim()]
        assert len(pieces) > len(model)
        for name, local, whole in pieces:
            chunks = torch.chunk(whole, 3)
            want = chunks[r] if r < len(chunks) else whole[:0]
            assert torch.equal(local, want), (r, name)


def _need_device_mesh(runs) -> None:
    """Skip on a torch without DTensor or ``init_device_mesh`` (before 2.2), which these runs use; FSDP1 on
    the CPU runs from there too (2.4 and newer tested)."""
    try:
        runs.dtensor_api()
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__}: no DTensor or init_device_mesh")


NO_TORCH = "import sys, ckptshard; ckptshard.reshard(*sys.argv[1:3], 3, progress=False); print('torch' in sys.modules)"


def test_dtensors_saved_by_this_torch_reshard_without_it_to_what_it_saves(tmp_path):
    """DTensors saved by this torch at 2 (its DeviceMesh's fields, which change between releases) reshard to 3
    without importing torch, into what this torch saves at 3: every field of every mesh, ``_hash`` aside."""
    import subprocess
    import sys

    from ckptshard.testing import torch_fsdp_runs

    _need_device_mesh(torch_fsdp_runs)

    torch_fsdp_runs.save_dtensors(str(tmp_path / "at2"), 2)
    torch_fsdp_runs.save_dtensors(str(tmp_path / "at3"), 3)
    run = [sys.executable, "-c", NO_TORCH, str(tmp_path / "at2"), str(tmp_path / "out")]
    out = subprocess.run(run, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stderr  # the rewrite knows this torch's mesh: no torch import
    for r in range(3):
        name = f"model_world_size_3_rank_{r}.pt"
        got = torch.load(tmp_path / "out" / name, weights_only=False)
        torch_fsdp_runs.assert_same_state(got, torch.load(tmp_path / "at3" / name, weights_only=False), name)


def test_hsdp_dtensors_of_this_torch_reshard_to_what_it_saves(tmp_path):
    """DTensors on HSDP's 2-D mesh saved by this torch at 2 x 2 reshard to 3 x 2 (torch pickles 2-D meshes,
    over a fake process group: torch 2.5 and newer) into what this torch saves at 3 x 2, every mesh field."""
    from ckptshard.testing import torch_fsdp_runs

    _need_device_mesh(torch_fsdp_runs)
    try:
        from torch.distributed.tensor import DTensor  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError:
        pytest.skip(f"torch {torch.__version__}: writing a 2-D mesh needs torch 2.5 (the fake process group)")
    torch_fsdp_runs.save_dtensors(str(tmp_path / "at4"), 4, replicas=2)
    torch_fsdp_runs.save_dtensors(str(tmp_path / "at6"), 6, replicas=3)
    ckptshard.reshard(str(tmp_path / "at4"), str(tmp_path / "out"), 6, progress=False)
    for r in range(6):
        name = f"model_world_size_6_rank_{r}.pt"
        got = torch.load(tmp_path / "out" / name, weights_only=False)
        torch_fsdp_runs.assert_same_state(got, torch.load(tmp_path / "at6" / name, weights_only=False), name)


def test_fsdp1_files_of_this_torch_reshard_without_it_to_what_it_saves(tmp_path):
    """A real FSDP1 run at 2 with this torch (SHARDED_STATE_DICT, raw optimizer state, as verl saves them)
    reshards to 3 without importing torch, into what FSDP1 at 3 of this torch saves after loading the full
    state: ShardedTensor metadata, sharding spec and local shards, every optimizer tensor."""
    import subprocess
    import sys

    from ckptshard.testing import torch_fsdp_runs

    _need_device_mesh(torch_fsdp_runs)

    torch_fsdp_runs.build_fsdp1_run(str(tmp_path / "at2"), 2)
    torch_fsdp_runs.fsdp1_torch_at(str(tmp_path / "at2" / "ref"), str(tmp_path / "at3"), 3)
    run = [sys.executable, "-c", NO_TORCH, str(tmp_path / "at2"), str(tmp_path / "out")]
    out = subprocess.run(run, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"], out.stderr  # the rewrite knows this torch's ShardedTensor
    torch_fsdp_runs.fsdp1_same_models(str(tmp_path / "out"), str(tmp_path / "at3"), 3)
    for r in range(3):
        name = f"optim_world_size_3_rank_{r}.pt"
        got, want = (torch.load(tmp_path / d / name, weights_only=True) for d in ("out", "at3"))
        torch_fsdp_runs.assert_same_state(got, want, name)

"""Checkpoints that real fairscale FSDP saved on a GPU (tests/data/gpu-saved), converted on this CPU machine.

scripts/make_gpu_fixtures.py made them on an H200: the fixture model trained
3 steps with its parameters, optimizer state and collectives on the GPU
(NCCL at 1 rank; gloo with CUDA tensors at 2 and 3 ranks), so every storage
is tagged ``cuda:0``, and ``ref/`` holds the live ``state_dict()`` and
``gather_full_optim_state_dict()`` of those runs. Consolidation must equal
them exactly; resharding must equal what FSDP at the target world size
(here, on the CPU) holds after loading the same weights.
"""

import pathlib
import zipfile

import pytest
import torch
from conftest import CONTAINERS
from safetensors.torch import load_file
from test_consolidate import assert_same
from test_reshard import assert_optim_equal, assert_tensors_equal, parts_of, rank_file

from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard
from ckptshard.testing.fixtures import source_path
from ckptshard.testing.oracle import build_oracles

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

DATA = pathlib.Path(__file__).parent / "data" / "gpu-saved"
RUNS = {  # folder: (variant, world size it was saved at, world size to reshard to)
    "nccl-ws1-mixed": ("mixed", 1, 2),
    "gloo-ws2-mixed": ("mixed", 2, 3),
    "gloo-ws3-fp32": ("fp32", 3, 2),
    "gloo-ws2-half": ("half", 2, 3),
}


def ref(run, name):
    return torch.load(DATA / run / "ref" / name, map_location="cpu", weights_only=True)


def test_every_storage_was_saved_on_the_gpu():
    """The point of these files: a GPU run's storages, not CPU ones re-tagged (only Adam's step stays on the CPU)."""
    for shard in DATA.glob("*/*/*shard*"):
        with zipfile.ZipFile(shard) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        assert pkl.count(b"cuda:0") >= 10 and pkl.count(b"cpu") <= 1, shard


@pytest.mark.parametrize("ext", [".pt", ".safetensors"])
@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("run", RUNS)
def test_consolidated_equals_the_live_gpu_state_dict(run, container, ext, tmp_path):
    out = str(tmp_path / f"full{ext}")
    consolidate(source_path(str(DATA / run), container), out, progress=False)
    got = torch.load(out, weights_only=True) if ext == ".pt" else load_file(out)
    assert_same(got, ref(run, "full_state_dict.pt"))


@pytest.mark.parametrize("run", [r for r in RUNS if RUNS[r][1] > 1])
def test_consolidated_optimizer_equals_gather_full_optim_state_dict(run, tmp_path):
    consolidate(source_path(str(DATA / run), "metaseq"), str(tmp_path / "w.pt"), optimizer=True, progress=False)
    ours = torch.load(tmp_path / "w.optim.pt", weights_only=True)
    theirs = ref(run, "full_optim.pt")
    assert ours["param_id_map"] == theirs["param_id_map"]
    assert ours["uncollected_local_ids"] == theirs["uncollected_local_ids"]
    assert_optim_equal(ours, theirs, run)


@pytest.fixture(scope="module")
def resharded_vs_fsdp(tmp_path_factory):
    """run -> (our reshard of the fairseq shards, real FSDP's view at the target world size)."""
    root = tmp_path_factory.mktemp("gpu-saved")
    out, by_n = {}, {}
    for run, (variant, _, n) in RUNS.items():
        ours = root / f"{run}-to{n}"
        reshard(source_path(str(DATA / run), "fairseq"), str(ours), n, progress=False)
        # The oracle loads on this CPU machine: give it CPU copies of the GPU run's references.
        torch.save(ref(run, "full_state_dict.pt"), root / f"{run}-full.pt")
        optim = DATA / run / "ref" / "full_optim.pt"
        if optim.exists():
            torch.save(ref(run, "full_optim.pt"), root / f"{run}-optim.pt")
        by_n.setdefault(n, []).append(
            {
                "full": str(root / f"{run}-full.pt"),
                "variant": variant,
                "full_optim": str(root / f"{run}-optim.pt") if optim.exists() else None,
                "out": str(root / f"{run}-oracle"),
                "candidate": str(ours),
            }
        )
        out[run] = (ours, root / f"{run}-oracle")
    for n, jobs in by_n.items():
        build_oracles(n, jobs)
    return out


@pytest.mark.parametrize("run", RUNS)
def test_resharded_equals_fsdp_at_the_target_world_size(run, resharded_vs_fsdp):
    ours, oracle_dir = resharded_vs_fsdp[run]
    for r in range(RUNS[run][2]):
        oracle = torch.load(oracle_dir / f"rank{r}.pt", weights_only=True)
        got = rank_file(ours, "fairseq", r)
        ((weights, meta),) = parts_of(got, "fairseq")
        assert_tensors_equal(weights, oracle["local"], (run, r))
        assert meta == oracle["meta"]
        if oracle["optim"] is not None:
            assert_optim_equal(got["last_optimizer_state"], oracle["optim"], (run, r))
    # And FSDP at N, loading our files strictly, holds the GPU run's weights.
    after = torch.load(oracle_dir / "candidate_full.pt", weights_only=True)["state_dict"]
    assert_same(after, ref(run, "full_state_dict.pt"))

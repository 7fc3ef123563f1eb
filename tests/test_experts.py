"""Per-rank FSDP instances (MoE experts) from a real fairscale run: consolidated from rank 0, said so, never
resharded."""

import hashlib
import pathlib

import pytest
import torch
from conftest import _once

from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.convert import convert
from ckptshard.execute.reshard import reshard
from ckptshard.testing import experts

WS = 3


@pytest.fixture(scope="module")
def moe(cache_root):
    code = hashlib.sha256(pathlib.Path(experts.__file__).read_bytes()).hexdigest()[:8]
    return _once(cache_root / f"experts-ws{WS}-{code}", lambda d: experts.build_experts_fixture(d, WS))


def test_fairscale_marks_the_expert_per_rank_and_ranks_differ(moe):
    shards = [torch.load(moe / "src" / f"checkpoint_last-shard{r}.pt", weights_only=True) for r in range(WS)]
    (entry,) = [e for e in shards[0]["fsdp_metadata"]["param_metadata"] if e["fsdp_path"] == "expert"]
    assert entry["no_broadcast_optim_state"] and entry["params"]["flat_param_0"]["padding"] == 0
    lives = [torch.load(moe / f"live{r}.pt", weights_only=True) for r in range(WS)]
    assert not torch.equal(lives[0]["expert.weight"], lives[1]["expert.weight"])
    assert torch.equal(lives[0]["shared.weight"], lives[1]["shared.weight"])


def test_consolidated_equals_rank_0s_live_state_dict_with_a_note(moe, tmp_path):
    res = consolidate(str(moe / "src"), str(tmp_path / "full.pt"), optimizer=True, progress=False)
    got, want = torch.load(tmp_path / "full.pt", weights_only=True), torch.load(moe / "live0.pt", weights_only=True)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    (note,) = res.notes
    assert "held whole by each rank" in note and "expert" in note and "ranks 1-2's copies are not in the output" in note


def test_reshard_and_dcp_refuse_rather_than_drop_other_ranks_experts(moe, tmp_path):
    with pytest.raises(CheckpointError, match="expert.flat_param_0: held whole by each rank"):
        reshard(str(moe / "src"), str(tmp_path / "r"), 2, progress=False)
    with pytest.raises(CheckpointError, match="expert: each rank holds its own"):
        convert(str(moe / "src"), str(tmp_path / "x.dcp"), "dcp", progress=False)
    assert not (tmp_path / "r").exists() and not (tmp_path / "x.dcp").exists()
    # The same world size is a copy: every rank keeps its own expert.
    reshard(str(moe / "src"), str(tmp_path / "same"), WS, progress=False)
    for r in range(WS):
        a = torch.load(tmp_path / "same" / f"checkpoint_last-shard{r}.pt", weights_only=True)["model"]
        b = torch.load(moe / "src" / f"checkpoint_last-shard{r}.pt", weights_only=True)["model"]
        assert all(torch.equal(a[k], b[k]) for k in b)

"""Loading before or after wrapping, strictness, partial loads, and the wrapping flow's resets."""

import copy

import pytest
import torch
import torch.distributed as dist

from ckptshard.fsdp.launch import run_world

pytestmark = pytest.mark.slow  # real multi-process FSDP runs each session (make test-fast skips them)

RESULTS = {}


def _fsdp_modules(m):
    from fairscale.nn import FullyShardedDataParallel as FSDP

    return [x for x in m.modules() if isinstance(x, FSDP)]


def _equal(a, b):
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _worker(rank, world_size, paths, out):
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ckptshard.errors import CheckpointError
    from ckptshard.fsdp.cpu_compat import cpu_fsdp_kwargs
    from ckptshard.fsdp.loading import load_checkpoint
    from ckptshard.fsdp.wrapping import reset_lazy_init_recursive, wrap_heads_and_model
    from ckptshard.testing.fixtures import make_optimizer, wrap_fixture_model
    from ckptshard.testing.model import SwAVHead, VisslLikeModel

    res = {}
    full3 = torch.load(paths["full3"], weights_only=True)

    # 1. sharded ws3 checkpoint into a wrapped model at ws2: resharded on the fly, weights + optimizer.
    root = wrap_fixture_model(VisslLikeModel(), "mixed")
    optim = make_optimizer(root.parameters(), "mixed")
    rep = load_checkpoint(root, paths["sharded3"], optim)
    res["after_wrap_path"] = rep.path
    res["no_root_left"] = all(m._is_root is None for m in _fsdp_modules(root))
    sd = root.state_dict()
    res["after_wrap_equal"] = _equal(sd, full3)
    oracle = root.get_shard_from_optim_state_dict(copy.deepcopy(torch.load(paths["optim3"], weights_only=True)))
    got = optim.state_dict()
    res["optim_equal"] = all(
        torch.equal(got["state"][i][k], v)
        for i, s in oracle["state"].items()
        for k, v in s.items()
        if torch.is_tensor(v) and v.dim() > 0
    )

    # 2. the same checkpoint into the plain, unwrapped model.
    plain = VisslLikeModel()
    load_checkpoint(plain, paths["sharded3"])
    res["plain_equal"] = _equal(plain.state_dict(), full3)

    # 3. only the head wrapped (trunk plain), from the consolidated file.
    m = VisslLikeModel()
    m.heads[0] = FSDP(m.heads[0], **cpu_fsdp_kwargs())
    load_checkpoint(m, paths["full3_file"])
    res["head_wrapped_no_root"] = all(x._is_root is None for x in _fsdp_modules(m))
    res["head_wrapped_equal"] = _equal(wrap_heads_and_model(m, init=None).state_dict(), full3)

    # 4. strictness: unexpected and missing keys are refused, naming them.
    bad = dict(full3, extra_thing=torch.zeros(1))
    bad.pop("trunk.gate.scale")
    torch.save(bad, paths["tmp"] + f"/bad{rank}.pt")
    try:
        load_checkpoint(VisslLikeModel(), paths["tmp"] + f"/bad{rank}.pt")
        res["strict"] = "loaded"
    except CheckpointError as e:
        res["strict"] = str(e)

    # 5. trunk only, into a wrapped model: trunk from the checkpoint, heads untouched.
    torch.manual_seed(5)
    root = wrap_fixture_model(VisslLikeModel(), "mixed")
    before = root.state_dict()
    rep = load_checkpoint(root, paths["sharded3"], only=["trunk"])
    after = root.state_dict()
    res["only_trunk"] = (
        all(torch.equal(after[k], full3[k]) for k in after if k.startswith("trunk."))
        and all(torch.equal(after[k], before[k]) for k in after if k.startswith("heads."))
        and all(k.startswith("heads.") for k in rep.skipped)
        and rep.skipped != []
    )

    # 6. more than one head is refused, naming the count; wrap_each_head opts in.
    two = VisslLikeModel()
    two.heads.append(SwAVHead())
    try:
        wrap_heads_and_model(two)
        res["two_heads"] = "wrapped"
    except ValueError as e:
        res["two_heads"] = str(e)
    wrapped = wrap_heads_and_model(two, wrap_each_head=True)
    res["each_head"] = len(list(_fsdp_modules(wrapped))) == 1 + 2 * 3  # root + 2 x (head + 2 prototypes)

    # 7. broadcast init: rank 0's head on every rank, whatever each rank's RNG did.
    torch.manual_seed(100 + rank)
    m = VisslLikeModel()
    root = wrap_heads_and_model(m, init="broadcast")
    res["proto_fp32_unflattened"] = all(
        not p.flatten_parameters and not p.mixed_precision for n, p in root.named_modules() if n.endswith("prototypes0")
    )
    w = root.state_dict()["heads.0.projection.0.weight"]
    gathered = [torch.zeros_like(w) for _ in range(world_size)]
    dist.all_gather(gathered, w)
    res["broadcast_same"] = all(torch.equal(gathered[0], g) for g in gathered)
    res["no_root_after_wrap_flow"] = all(x._is_root is None for x in _fsdp_modules(root))

    # 8. reset_lazy_init_recursive clears what a forward set.
    root(torch.randn(6, 12))
    res["root_set_by_forward"] = root._is_root is True
    res["reset_count"] = reset_lazy_init_recursive(root)
    res["all_clear"] = all(x._is_root is None for x in _fsdp_modules(root))
    if rank == 0:
        torch.save(res, out)


@pytest.fixture(scope="module")
def loaded(fixtures, tmp_path_factory):
    from ckptshard.execute.consolidate import consolidate

    tmp = tmp_path_factory.mktemp("loading")
    consolidate(str(fixtures[3] / "fairseq"), str(tmp / "full3.pt"), progress=False)
    paths = {
        "full3": str(fixtures[3] / "ref" / "full_state_dict.pt"),
        "optim3": str(fixtures[3] / "ref" / "full_optim.pt"),
        "sharded3": str(fixtures[3] / "fairseq"),
        "full3_file": str(tmp / "full3.pt"),
        "tmp": str(tmp),
    }
    run_world(_worker, 2, paths, str(tmp / "res.pt"))
    return torch.load(tmp / "res.pt", weights_only=True)


def test_sharded_into_wrapped_model_resharded_on_the_fly(loaded):
    assert loaded["after_wrap_path"] == "local"
    assert loaded["after_wrap_equal"] and loaded["optim_equal"]
    assert loaded["no_root_left"]


def test_same_weights_unwrapped_and_head_wrapped(loaded):
    assert loaded["plain_equal"] and loaded["head_wrapped_equal"] and loaded["head_wrapped_no_root"]


def test_strict_names_missing_and_unexpected(loaded):
    msg = loaded["strict"]
    assert "missing 1: trunk.gate.scale" in msg and "unexpected 1: extra_thing" in msg


def test_partial_load_by_name(loaded):
    assert loaded["only_trunk"]


def test_heads_count(loaded):
    assert "2 heads" in loaded["two_heads"] and loaded["each_head"]


def test_wrapping_flow_resets_and_broadcast_init(loaded):
    assert loaded["proto_fp32_unflattened"] and loaded["broadcast_same"] and loaded["no_root_after_wrap_flow"]
    assert loaded["root_set_by_forward"] and loaded["reset_count"] >= 1 and loaded["all_clear"]

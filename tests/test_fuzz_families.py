"""Seeded mutations of real torch FSDP2 per-rank files (verl's layout, made on gloo): optimizer files, model
files, DTensor and DeviceMesh records, fsdp_config.json. Each case either fails in one line with nothing written,
or, where the mutation changes nothing the output depends on, writes what the unmutated files give."""

import logging
import random
import shutil

import pytest
import torch
from conftest import _once
from test_torch_fsdp_files import CODE

import ckptshard
from ckptshard.errors import CheckpointError
from ckptshard.testing import torch_fsdp_runs

CASES = 60
WS = 3


@pytest.fixture(scope="module")
def fsdp2_run(cache_root):
    return _once(cache_root / f"fsdp2-ws3-{CODE}", lambda d: torch_fsdp_runs.build_fsdp2_run(d, WS))


@pytest.fixture(scope="module")
def reference(fsdp2_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    ckptshard.consolidate(str(fsdp2_run), str(out / "full.pt"), optimizer=True, progress=False)
    return torch.load(out / "full.pt", weights_only=True), torch.load(out / "full.optim.pt", weights_only=True)


def _load(path):
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    return torch.load(path, map_location="cpu", weights_only=False)


def _dtensors(tree):
    return [(k, v) for k, v in tree.items() if hasattr(v, "to_local")]


def mutate_optim(rng, osd):
    kind = rng.choice(["plain", "resize", "pop_key", "pop_pid", "float_step", "pop_group", "string", "dtype", "step"])
    pid = rng.choice(sorted(osd["state"]))
    entry = osd["state"][pid]
    moment = rng.choice([k for k in entry if k != "step"])
    if kind == "plain":
        entry[moment] = entry[moment].to_local().clone()
    elif kind == "resize":
        local = entry[moment]._local_tensor
        entry[moment]._local_tensor = torch.cat([local, torch.ones_like(local[:1])]) if local.numel() else local[:0]
        if not local.numel():
            entry[moment]._local_tensor = torch.ones(1, *local.shape[1:])
    elif kind == "pop_key":
        entry.pop(moment)
    elif kind == "pop_pid":
        osd["state"].pop(pid)
    elif kind == "float_step":
        entry["step"] = float(entry["step"]) + 1
    elif kind == "pop_group":
        osd["param_groups"].pop()
        if not osd["param_groups"]:
            osd["param_groups"] = [{"params": [], "lr": 0.1}]
    elif kind == "string":
        entry[moment] = "not a tensor"
    elif kind == "dtype":
        entry[moment]._local_tensor = entry[moment]._local_tensor.double()
    else:
        entry["step"] = entry["step"] + 3
    return f"optim:{kind}"


def mutate_model(rng, sd):
    kind = rng.choice(["plain", "resize", "pop", "dtype", "placement", "extra"])
    name, dt = rng.choice(_dtensors(sd))
    if kind == "plain":
        sd[name] = dt.to_local().clone()
    elif kind == "resize":
        local = dt._local_tensor
        dt._local_tensor = (
            torch.cat([local, torch.ones_like(local[:1])]) if local.numel() else torch.ones(1, *local.shape[1:])
        )
    elif kind == "pop":
        sd.pop(name)
    elif kind == "dtype":
        dt._local_tensor = dt._local_tensor.double()
    elif kind == "placement":
        from torch.distributed.tensor import Replicate

        dt._spec.placements = (Replicate(),)
    else:
        sd["stray.weight"] = torch.zeros(3)
    return f"model:{kind}"


def mutate_config(rng, path):
    kind = rng.choice(["garbage", "deep", "list", "empty"])
    text = {"garbage": "{not json", "deep": "[" * 5000 + "]" * 5000, "list": "[1, 2]", "empty": ""}[kind]
    path.write_text(text)
    return f"config:{kind}"


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("seed", range(CASES))
def test_mutated_fsdp2_files_fail_cleanly_or_write_what_the_files_hold(fsdp2_run, reference, tmp_path, seed):
    rng = random.Random(seed)
    src = tmp_path / "src"
    shutil.copytree(fsdp2_run, src, ignore=shutil.ignore_patterns("ref", ".done"))
    rank = rng.randrange(WS)
    target = rng.choice(["optim", "model", "optim", "model", "config"])
    if target == "config":
        what = mutate_config(rng, src / "fsdp_config.json")
    else:
        path = src / f"{target}_world_size_{WS}_rank_{rank}.pt"
        tree = _load(path)
        what = (mutate_optim if target == "optim" else mutate_model)(rng, tree)
        torch.save(tree, path)
    calls = {
        "consolidate": lambda out: ckptshard.consolidate(
            str(src), str(out / "full.pt"), optimizer=True, progress=False
        ),
        "reshard": lambda out: ckptshard.reshard(str(src), str(out / "re"), 2, progress=False),
        "convert": lambda out: ckptshard.convert(str(src), str(out / "c.dcp"), to="dcp", progress=False),
    }
    for name, call in calls.items():
        out = tmp_path / name
        out.mkdir()
        try:
            call(out)
        except CheckpointError as e:
            assert "\n" not in str(e), (what, name, str(e))
            assert list(out.iterdir()) == [], (what, name)
            continue
        # Accepted: only a mutation the output does not depend on (fsdp_config.json is carried by reshard
        # alone, and checked there), and the consolidated state is the reference's.
        assert what.startswith("config") and name != "reshard", (what, name, "accepted")
        if name == "consolidate":
            model, optim = torch.load(out / "full.pt", weights_only=True), reference[0]
            assert _same(model, optim), what

"""Session fixtures: real fairscale checkpoints, built once and cached.

Building them spawns gloo process groups (seconds each), so they are made
once per cache key (a hash of the fixture code and library versions) under
``$CKPTSHARD_FIXTURE_CACHE`` or the temp folder, and every test compares
offline against them.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from typing import Dict

import fairscale
import pytest
import torch

import ckptshard
from ckptshard.testing.fixtures import build_fixture, source_path

FIXTURE_WORLD_SIZES = (1, 2, 3, 4)
SOURCE_WORLD_SIZES = FIXTURE_WORLD_SIZES + (5,)  # reshard sources
TARGET_WORLD_SIZES = (1, 2, 3, 4, 5, 8)
CONTAINERS = ("fairseq", "metaseq", "vissl")

_FIXTURE_CODE = ["testing/fixtures.py", "testing/model.py", "testing/oracle.py", "fsdp/cpu_compat.py", "fsdp/launch.py"]


def _cache_root() -> pathlib.Path:
    h = hashlib.sha256()
    pkg = pathlib.Path(ckptshard.__file__).parent
    for rel in _FIXTURE_CODE:
        h.update((pkg / rel).read_bytes())
    h.update(f"{torch.__version__} {fairscale.__version__}".encode())
    base = os.environ.get("CKPTSHARD_FIXTURE_CACHE") or os.path.join(tempfile.gettempdir(), "ckptshard-fixtures")
    return pathlib.Path(base) / h.hexdigest()[:12]


def _once(folder: pathlib.Path, build) -> pathlib.Path:
    done = folder / ".done"
    if not done.exists():
        build(str(folder))
        done.write_text("ok\n")
    return folder


@pytest.fixture(scope="session", autouse=True)
def _own_template_cache(tmp_path_factory) -> None:
    """The torch DTensor pickles kept between runs (``write/template_cache``) go to this run's own folder,
    not the user's cache: each test run starts with none kept."""
    os.environ["CKPTSHARD_CACHE_DIR"] = str(tmp_path_factory.mktemp("ckptshard-cache"))
    os.environ.pop("CKPTSHARD_NO_CACHE", None)


@pytest.fixture(scope="session")
def cache_root() -> pathlib.Path:
    root = _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def fixtures(cache_root: pathlib.Path) -> Dict[int, pathlib.Path]:
    """World size -> folder of a real 3-step mixed-precision FSDP run (see ckptshard.testing.fixtures)."""
    return {
        w: _once(cache_root / f"mixed-ws{w}", lambda d, w=w: build_fixture(d, w, "mixed")) for w in SOURCE_WORLD_SIZES
    }


@pytest.fixture(scope="session")
def half_fixture(cache_root: pathlib.Path) -> pathlib.Path:
    """A run with a pure-fp16 trunk (fp16 shards and buffers), fp32 head and prototypes, at world size 3."""
    return _once(cache_root / "half-ws3", lambda d: build_fixture(d, 3, "half"))


@pytest.fixture(scope="session")
def frozen_fixture(cache_root: pathlib.Path) -> pathlib.Path:
    """fp32 at world size 2 with the trunk frozen: the optimizer holds the head's 3 of 7 flat parameters."""
    return _once(cache_root / "frozen-ws2", lambda d: build_fixture(d, 2, "frozen"))


def src_of(folder: pathlib.Path, container: str) -> str:
    return source_path(str(folder), container)


def load_ref(folder: pathlib.Path, name: str):
    return torch.load(folder / "ref" / name, weights_only=True)


@pytest.fixture(scope="session")
def resharded(fixtures, tmp_path_factory):
    """(M, container, N) -> folder of ckptshard's reshard of fixture M to N (made fresh each session)."""
    from ckptshard.execute.reshard import reshard

    root = tmp_path_factory.mktemp("resharded")
    out = {}
    for m in SOURCE_WORLD_SIZES:
        for c in CONTAINERS:
            for n in TARGET_WORLD_SIZES:
                dst = root / f"{c}-{m}to{n}"
                reshard(src_of(fixtures[m], c), str(dst), n, progress=False)
                out[(m, c, n)] = dst
    return out


@pytest.fixture(scope="session")
def oracles(fixtures, resharded, cache_root, tmp_path_factory):
    """(M, N) -> folder with real FSDP at world size N's view of fixture M (see ckptshard.testing.oracle).

    The pure-fairscale part is cached; the strict load of ckptshard's own
    output (``candidate``) runs every session, in the same processes.
    """
    from ckptshard.testing.oracle import build_oracles

    fresh = tmp_path_factory.mktemp("oracle")
    out = {}
    for n in TARGET_WORLD_SIZES:
        jobs = []
        for m in SOURCE_WORLD_SIZES:
            folder = fresh / f"{m}to{n}"
            optim = fixtures[m] / "ref" / "full_optim.pt"
            # fairscale cannot gather optimizer state at world size 1: weights-only oracle there.
            jobs.append(
                {
                    "full": str(fixtures[m] / "ref" / "full_state_dict.pt"),
                    "full_optim": str(optim) if optim.exists() else None,
                    "variant": "mixed",
                    "out": str(folder),
                    "candidate": str(resharded[(m, "fairseq", n)]),
                }
            )
            out[(m, n)] = folder
        build_oracles(n, jobs)
    return out


@pytest.fixture(scope="session")
def next_step_fixture(cache_root: pathlib.Path) -> pathlib.Path:
    """An fp32 run at world size 2 that also records one more step (ref/next_step.pt)."""
    return _once(cache_root / "fp32-ws2-next", lambda d: build_fixture(d, 2, "fp32", next_step=True))


FSDP2_WORLD_SIZES = (1, 2, 3)


@pytest.fixture(scope="session")
def fsdp2_runs(fixtures, next_step_fixture, tmp_path_factory):
    """Fixtures converted to DCP by ckptshard, loaded into torch FSDP2 at world sizes 1-3.

    Returns ``{"dcp": {name: folder}, "loaded": {(name, ws): result file}, "saved": folder}``;
    ``saved`` is the mixed-ws3 checkpoint as FSDP2 at world size 2 re-saved it with ``dcp.save``;
    ``dtensors`` a DCP torch wrote from DTensors sharded along dims 0 and 1 on 3 ranks.
    """
    from ckptshard.execute.convert import convert
    from ckptshard.testing.fixtures import STEPS
    from ckptshard.testing.fsdp2 import load_in_fsdp2, save_sharded_dcp

    root = tmp_path_factory.mktemp("fsdp2")
    sources = {
        "mixed3": src_of(fixtures[3], "fairseq"),
        "vissl2": src_of(fixtures[2], "vissl"),
        "next": src_of(next_step_fixture, "fairseq"),
    }
    dcps = {}
    for name, src in sources.items():
        dcps[name] = root / f"{name}.dcp"
        convert(src, str(dcps[name]), "dcp", progress=False)
    loaded = {}
    for ws in FSDP2_WORLD_SIZES:
        jobs = []
        for name in ("mixed3", "next") + (("vissl2",) if ws == 2 else ()):
            loaded[(name, ws)] = root / f"{name}-ws{ws}.pt"
            job = {
                "dcp": str(dcps[name]),
                "out": str(loaded[(name, ws)]),
                "next_step": STEPS if name == "next" else None,
            }
            if name == "mixed3" and ws == 2:
                job["save"] = str(root / "saved-by-fsdp2.dcp")
            jobs.append(job)
        load_in_fsdp2(ws, jobs)
    save_sharded_dcp(3, str(root / "dtensors.dcp"))
    return {"dcp": dcps, "loaded": loaded, "saved": root / "saved-by-fsdp2.dcp", "dtensors": root / "dtensors.dcp"}

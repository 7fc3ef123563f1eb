"""The source contract, run on one small real checkpoint of every family (as fsspec runs one test suite over
every backend): each opens as its kind, names its inputs, gives the live model's full state dict, and every
command either works on it or refuses in one line that names the family."""

import ast
import os
import pathlib
import shutil

import pytest
import torch
from conftest import _once, load_ref
from test_torch_fsdp_files import CODE

import ckptshard
from ckptshard.errors import CheckpointError, NotSupported
from ckptshard.read.tensor_data import read_fill
from ckptshard.testing import torch_fsdp_runs
from ckptshard.testing.synthetic import write_synthetic_parts

FAMILIES = ["fairscale", "model-parts", "fsdp2", "hsdp", "fsdp1", "fsdp1-local", "dcp", "full"]


@pytest.fixture(scope="module")
def checkpoints(fixtures, cache_root, tmp_path_factory):
    """kind -> (source path, open_source keywords, the live full state dict or None)."""
    tmp = tmp_path_factory.mktemp("sources")
    fsdp2 = _once(cache_root / f"fsdp2-ws3-{CODE}", lambda d: torch_fsdp_runs.build_fsdp2_run(d, 3))
    hsdp = _once(cache_root / f"fsdp2-hsdp-2x2-{CODE}", lambda d: torch_fsdp_runs.build_fsdp2_run(d, 4, replicas=2))
    fsdp1 = _once(cache_root / f"fsdp1-ws3-bf160-{CODE}", lambda d: torch_fsdp_runs.build_fsdp1_run(d, 3, False))
    flat = _once(cache_root / f"fsdp1-flat-ws3-{CODE}", lambda d: torch_fsdp_runs.build_fsdp1_run(d, 3, False, False))
    local = tmp / "fsdp1-local"
    shutil.copytree(flat / "local", local)
    parts = tmp / "parts"
    write_synthetic_parts(str(parts), 2, 2, 2, 8)
    ckptshard.convert(str(fsdp2), str(tmp / "c.dcp"), to="dcp", progress=False)
    ckptshard.consolidate(str(fsdp2), str(tmp / "full.safetensors"), progress=False)

    def ref(folder, name="full_model.pt"):
        return torch.load(folder / "ref" / name, weights_only=True)

    return {
        "fairscale": (fixtures[2] / "fairseq", {}, load_ref(fixtures[2], "full_state_dict.pt")),
        "model-parts": (parts, {}, None),
        "fsdp2": (fsdp2, {}, ref(fsdp2)),
        "hsdp": (hsdp, {}, ref(hsdp)),
        "fsdp1": (fsdp1, {}, ref(fsdp1)),
        "fsdp1-local": (local, {"like": flat / "ref" / "full_model.pt"}, ref(flat)),
        "dcp": (tmp / "c.dcp", {}, ref(fsdp2)),
        "full": (tmp / "full.safetensors", {"full": True}, ref(fsdp2)),
    }


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_family_opens_as_its_kind_with_its_inputs(checkpoints, kind):
    path, kw, _ = checkpoints[kind]
    source = ckptshard.open_source(pathlib.Path(path), **kw)  # os.PathLike, as anywhere a path is
    assert source.kind == kind and source.family
    assert source.inputs and all(os.path.isfile(p) for p in source.inputs)
    below = str(path) if os.path.isdir(path) else os.path.dirname(str(path))
    assert all(os.path.abspath(p).startswith(os.path.abspath(below)) for p in source.inputs), source.inputs
    assert source.describe()["files"] == [os.path.abspath(p) for p in source.inputs]


@pytest.mark.parametrize("kind", [k for k in FAMILIES if k != "model-parts"])
def test_full_weights_are_the_live_models_state_dict(checkpoints, kind):
    path, kw, live = checkpoints[kind]
    weights = ckptshard.open_source(path, **kw).full_weights()
    assert set(weights) == set(live), sorted(set(weights) ^ set(live))
    for name, fill in weights.items():
        assert torch.equal(read_fill(fill).to(live[name].dtype), live[name]), name


def test_model_parts_need_rules_for_one_full_state_dict(checkpoints):
    path, _, _ = checkpoints["model-parts"]
    with pytest.raises(NotSupported, match="metaseq model-parallel parts: give --mp-rules"):
        ckptshard.open_source(path).full_weights()


COMMANDS = {
    "inspect": lambda src, kw, out: ckptshard.inspect_checkpoint(src),
    "consolidate": lambda src, kw, out: ckptshard.consolidate(src, out / "full.safetensors", progress=False, **kw),
    "reshard": lambda src, kw, out: ckptshard.reshard(src, out / "re", 2, progress=False, **kw),
    "reshard-1": lambda src, kw, out: ckptshard.reshard(src, out / "re1", 1, progress=False, **kw),
    "convert-dcp": lambda src, kw, out: ckptshard.convert(src, out / "o.dcp", to="dcp", progress=False, **kw),
}
# What a family cannot do, by design (each refusal names the family).
REFUSED = {
    ("model-parts", "convert-dcp"),
    ("dcp", "reshard"),
    ("dcp", "reshard-1"),
    ("hsdp", "reshard-1"),  # 1 rank is no multiple of its shard group (2): refused, not guessed
    ("full", "reshard-1"),
    ("dcp", "convert-dcp"),
    ("full", "inspect"),
    ("full", "consolidate"),
    ("full", "reshard"),
    ("full", "convert-dcp"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_command_works_on_every_family_or_refuses_in_one_line(checkpoints, tmp_path, kind, command):
    path, kw, _ = checkpoints[kind]
    kw = {k: v for k, v in kw.items() if k == "like" and command != "inspect"}
    out = tmp_path / "out"
    out.mkdir()
    try:
        COMMANDS[command](path, kw, out)
    except CheckpointError as e:
        assert (kind, command) in REFUSED, f"{kind} {command}: {e}"
        assert "\n" not in str(e) and list(out.iterdir()) == []
        return
    assert (kind, command) not in REFUSED, f"{kind} {command}: accepted"
    for written in out.iterdir():  # verify works on every output ckptshard writes, whatever the family
        if not written.name.endswith(".manifest.json"):
            assert ckptshard.verify(written) == [], written


def test_a_folder_holding_two_checkpoints_is_refused_naming_both(checkpoints, tmp_path):
    src = tmp_path / "mixed"
    shutil.copytree(checkpoints["fsdp2"][0], src, ignore=shutil.ignore_patterns("ref", ".done"))
    for f in checkpoints["fairscale"][0].iterdir():
        shutil.copy(f, src / f.name)
    with pytest.raises(
        CheckpointError, match=r"more than one checkpoint: torch FSDP per-rank files .* and shard files"
    ):
        ckptshard.open_source(src)
    with pytest.raises(CheckpointError, match="more than one checkpoint"):
        ckptshard.reshard(src, tmp_path / "out", 2, progress=False)
    assert not (tmp_path / "out").exists()


def test_consolidate_of_a_dcp_folder_writes_the_models_full_state_dict(checkpoints, tmp_path):
    path, _, live = checkpoints["dcp"]
    res = ckptshard.consolidate(path, tmp_path / "full.pt", optimizer=True, progress=False)
    got = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(got) == set(live) and all(torch.equal(got[k], live[k]) for k in live)
    assert res.outputs == [str(tmp_path / "full.pt"), str(tmp_path / "full.optim.pt")]
    optim = torch.load(tmp_path / "full.optim.pt", weights_only=True)
    ref = torch.load(checkpoints["fsdp2"][0] / "ref" / "full_optim.pt", weights_only=True)
    assert set(optim["state"]) == set(ref["state"])


PROBES = {"find_verl", "find_torch_ranks", "open_torch_ranks", "open_torch_ranks_like", "find_model_parts", "is_dcp"}


def test_only_the_sources_layer_probes_families():
    """Which family a path is, is decided in ckptshard/sources/ alone: no command probes on its own."""
    package = pathlib.Path(ckptshard.__file__).parent
    calls = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith(("sources/", "read/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in PROBES:
                    calls.append(f"{rel}:{node.lineno} {name}")
    assert calls == []


NO_FAIRSCALE = """
import sys
sys.modules["fairscale"] = None  # any import of it fails, as where the optional extra is not installed
import ckptshard
src, fsdp2, out = sys.argv[1:]
for i, s in enumerate((src, fsdp2)):
    ckptshard.inspect_checkpoint(s)
    ckptshard.consolidate(s, f"{out}/{i}.safetensors", progress=False)
    ckptshard.reshard(s, f"{out}/{i}-re", 3, progress=False)
    ckptshard.convert(s, f"{out}/{i}.dcp", to="dcp", progress=False)
    assert ckptshard.verify(f"{out}/{i}-re") == []
print("ok")
"""


def test_the_converters_need_no_fairscale(checkpoints, tmp_path):
    """fairscale is an optional extra: reading and writing its checkpoints (and every other family's) imports
    none of it; only live fairscale models (load_checkpoint, the wrapping flow, verify-resume) need it."""
    import subprocess
    import sys

    args = [str(checkpoints["fairscale"][0]), str(checkpoints["fsdp2"][0]), str(tmp_path)]
    res = subprocess.run([sys.executable, "-c", NO_FAIRSCALE, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1", "fsdp1-local"])
def test_torch_rank_files_are_written_by_jobs_and_torchrun_ranks_byte_for_byte(checkpoints, tmp_path, kind):
    """One rank-file writer for every family: --jobs processes and torchrun ranks write what one process does."""
    import subprocess
    import sys

    from ckptshard.fsdp.launch import free_port

    path, kw, _ = checkpoints[kind]
    ckptshard.reshard(path, tmp_path / "one", 4, progress=False, jobs=1, **kw)
    ckptshard.reshard(path, tmp_path / "jobs", 4, progress=False, jobs=2, **kw)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    args = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cli = ["-m", "ckptshard.cli", "reshard", str(path), "-n", "4", "-o", str(tmp_path / "ranks"), "-q"]
    cli += [f"--like={kw['like']}"] if "like" in kw else []
    res = subprocess.run([torchrun, *args, *cli], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]

    def files(name):
        root = tmp_path / name
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    one = files("one")
    assert len([n for n in one if n.startswith("model_world_size_4_rank_")]) == 4
    for other in ("jobs", "ranks"):
        assert files(other) == one, other

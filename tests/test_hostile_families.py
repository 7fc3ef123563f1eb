"""Hostile and unlucky inputs of the torch FSDP and model-parts families, against real FSDP2 files made on gloo:
each is refused in one line with exit 2 and nothing written, or bounded before anything is sized by it."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import _once
from test_torch_fsdp_files import CODE

import ckptshard
from ckptshard.errors import CheckpointError
from ckptshard.layout.chunking import MAX_WORLD_SIZE
from ckptshard.testing import torch_fsdp_runs
from ckptshard.testing.synthetic import write_synthetic_parts


@pytest.fixture(scope="module")
def fsdp2_run(cache_root):
    return _once(cache_root / f"fsdp2-ws3-{CODE}", lambda d: torch_fsdp_runs.build_fsdp2_run(d, 3))


@pytest.fixture
def src(fsdp2_run, tmp_path):
    """A copy of a verl-layout FSDP2 checkpoint at world size 3, without the oracle's files."""
    dst = tmp_path / "src"
    shutil.copytree(fsdp2_run, dst, ignore=shutil.ignore_patterns("ref", ".done"))
    return dst


def cli(*args, timeout=120):
    cmd = [sys.executable, "-m", "ckptshard.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def one_line_error(res, needle):
    assert res.returncode == 2, (res.returncode, res.stderr)
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr
    assert "Traceback" not in res.stderr


def test_a_rank_named_twice_is_refused_naming_both_files(src, tmp_path):
    shutil.copy(src / "model_world_size_3_rank_1.pt", src / "model_world_size_3_rank_01.pt")
    res = cli("reshard", src, "-n", 2, "-o", tmp_path / "out")
    one_line_error(res, "rank 1 is named twice: model_world_size_3_rank_01.pt and model_world_size_3_rank_1.pt")
    assert not (tmp_path / "out").exists()


def test_a_world_size_of_a_trillion_in_a_file_name_is_refused_at_once(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / f"model_world_size_{10**12}_rank_0.pt").write_bytes(b"")
    began = time.monotonic()
    with pytest.raises(CheckpointError, match="rank 1 is missing"):
        ckptshard.consolidate(str(src), str(tmp_path / "out.pt"), progress=False)
    assert time.monotonic() - began < 10


def test_a_shard_name_claiming_a_trillionth_rank_is_refused_at_once(tmp_path):
    src = str(tmp_path / "src")
    write_synthetic_parts(src, 1, 2, 2, 8)
    shard = "checkpoint_last-model_part-0-shard{}.pt"
    os.rename(os.path.join(src, shard.format(1)), os.path.join(src, shard.format(10**12)))
    began = time.monotonic()
    with pytest.raises(CheckpointError, match="missing"):
        ckptshard.consolidate(src, str(tmp_path / "out.pt"), progress=False)
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("n", [0, MAX_WORLD_SIZE + 1, 10**12])
def test_a_target_world_size_out_of_bounds_is_one_line(src, tmp_path, n):
    began = time.monotonic()
    res = cli("reshard", src, "-n", n, "-o", tmp_path / "out")
    one_line_error(res, f"--world-size must be between 1 and {MAX_WORLD_SIZE:,}")
    assert time.monotonic() - began < 30 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-n", 2, "--model-parallel", 0, "--mp-rules", "metaseq"], "--model-parallel must be between 1"),
        (["-n", 10**12], "--world-size must be between 1"),
        (["-n", 2, "--mp-tolerance", "nan"], "--mp-tolerance must be a finite number"),
        (["-n", 2, "--mp-tolerance", "-1"], "--mp-tolerance must be a finite number"),
        (["-n", 2, "--mp-rule", "(.*)*Q$=0"], "a repeat inside a repeat"),
    ],
    ids=["model-parallel-0", "world-size-1e12", "tolerance-nan", "tolerance-negative", "exponential-regex"],
)
def test_model_parts_options_that_cannot_be_meant_are_one_line(tmp_path, args, needle):
    src = str(tmp_path / "src")
    write_synthetic_parts(src, 2, 2, 2, 8)
    res = cli("reshard", src, *args, "-o", tmp_path / "out", timeout=30)
    one_line_error(res, needle)
    assert not (tmp_path / "out").exists()


def test_a_differing_shared_tensor_is_not_accepted_by_a_nan_tolerance(tmp_path):
    src = str(tmp_path / "src")
    write_synthetic_parts(src, 2, 2, 2, 8, drift=1e-3)
    with pytest.raises(CheckpointError, match="--mp-tolerance must be a finite number"):
        ckptshard.consolidate(src, str(tmp_path / "o.pt"), mp_rules=["layers=0"], mp_tolerance=float("nan"))
    assert not (tmp_path / "o.pt").exists()


def test_an_output_inside_the_source_folder_is_refused(src):
    before = sorted(os.listdir(src))
    res = cli("reshard", src, "-n", 2, "-o", src / "resharded")
    one_line_error(res, "lies inside the input folder")
    assert sorted(os.listdir(src)) == before


def test_duplicate_mesh_dim_names_are_one_line(src, tmp_path):
    res = cli("reshard", src, "-n", 4, "--shard-group", 2, "--mesh-dim-names", "fsdp,fsdp", "-o", tmp_path / "out")
    one_line_error(res, "a device mesh's names must differ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
def test_a_carried_file_that_is_a_device_is_refused_before_any_byte(src, tmp_path, target):
    os.symlink(target, src / "huggingface" / "tokenizer.bin")
    res = cli("reshard", src, "-n", 2, "-o", tmp_path / "out", timeout=60)
    one_line_error(res, "is a character device")
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if p.startswith("out")]


def test_a_carried_folder_behind_a_link_is_refused(src, tmp_path):
    os.symlink(src / "huggingface", src / "hf-link")
    res = cli("reshard", src, "-n", 2, "-o", tmp_path / "out")
    one_line_error(res, "a link to a folder")


def _fifo(path):
    path.unlink()
    os.mkfifo(path)


def _deep(path):
    path.write_text("[" * 100_000 + "]" * 100_000)


def _zero(path):
    path.unlink()
    os.symlink("/dev/zero", path)


def _huge(path):
    path.write_text(json.dumps({"FSDP_version": 2, "world_size": 3, "pad": "x" * (2 << 20)}))


@pytest.mark.parametrize(
    "damage, needle",
    [(_fifo, "is a named pipe"), (_deep, "nested too deeply"), (_zero, "is a character device"), (_huge, "larger")],
    ids=["named-pipe", "nested-100000-deep", "link-to-dev-zero", "3-MiB"],
)
def test_a_hostile_fsdp_config_is_one_line(src, tmp_path, damage, needle):
    damage(src / "fsdp_config.json")
    res = cli("reshard", src, "-n", 2, "-o", tmp_path / "out", timeout=60)
    one_line_error(res, needle)
    assert not (tmp_path / "out").exists()


def test_a_carried_file_rewritten_while_the_output_is_written_stops_the_run(src, tmp_path, monkeypatch):
    from ckptshard.execute import reshard as reshard_module

    real = reshard_module._carry

    def rewrite_then_carry(carried, config, folder, world):
        (src / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 3, "changed": 1}))
        return real(carried, config, folder, world)

    monkeypatch.setattr(reshard_module, "_carry", rewrite_then_carry)
    with pytest.raises(CheckpointError, match="fsdp_config.json: changed while ckptshard was reading it"):
        ckptshard.reshard(str(src), str(tmp_path / "out"), 2, progress=False)
    assert not (tmp_path / "out").exists()


def test_overwrite_keeps_an_output_the_user_added_an_empty_folder_or_a_link_to(src, tmp_path):
    out = tmp_path / "out"
    ckptshard.reshard(str(src), str(out), 2, progress=False)
    (out / "notes").mkdir()
    res = cli("reshard", src, "-n", 4, "-o", out, "--overwrite")
    one_line_error(res, "holds files its manifest does not list (notes/)")
    assert (out / "notes").is_dir()
    (out / "notes").rmdir()
    os.symlink(tmp_path, out / "elsewhere")
    res = cli("reshard", src, "-n", 4, "-o", out, "--overwrite")
    one_line_error(res, "holds files its manifest does not list (elsewhere/)")
    assert (out / "elsewhere").is_symlink()
    (out / "elsewhere").unlink()
    assert cli("reshard", src, "-n", 4, "-o", out, "--overwrite", "-q").returncode == 0


def _edit_optim(path, edit):
    import torch

    osd = torch.load(path, map_location="cpu", weights_only=False)
    edit(osd)
    torch.save(osd, path)


def _step_plus_5(osd):
    pid = sorted(osd["state"])[0]
    osd["state"][pid]["step"] = osd["state"][pid]["step"] + 5


def _other_lr(osd):
    osd["param_groups"][0]["lr"] *= 2


def _renumbered(osd):
    osd["state"] = {pid + 100: v for pid, v in osd["state"].items()}
    for g in osd["param_groups"]:
        g["params"] = [pid + 100 for pid in g["params"]]


@pytest.mark.parametrize(
    "edit, needle",
    [
        (_step_plus_5, "optimizer files of different steps"),
        (_other_lr, "param_groups[0].lr is"),
        (_renumbered, "optimizer state of other parameters than rank 0's"),
    ],
    ids=["step-plus-5", "another-lr", "ids-renumbered"],
)
def test_one_ranks_optimizer_file_of_another_step_or_run_is_refused(src, tmp_path, edit, needle):
    _edit_optim(src / "optim_world_size_3_rank_1.pt", edit)
    for args in (
        ("consolidate", src, "-o", tmp_path / "out.pt", "--optimizer"),
        ("reshard", src, "-n", 2, "-o", tmp_path / "out"),
        ("convert", src, "--to", "dcp", "-o", tmp_path / "out.dcp"),
    ):
        one_line_error(cli(*args), needle)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_optimizer_state_renumbered_on_every_rank_is_refused_not_dropped(src, tmp_path):
    def state_only(osd):
        osd["state"] = {pid + 100: v for pid, v in osd["state"].items()}

    for r in range(3):
        _edit_optim(src / f"optim_world_size_3_rank_{r}.pt", state_only)
    one_line_error(cli("reshard", src, "-n", 2, "-o", tmp_path / "out"), "which no param_group lists")


@pytest.fixture(scope="module")
def hsdp_run(cache_root):
    return _once(cache_root / f"fsdp2-hsdp-2x2-{CODE}", lambda d: torch_fsdp_runs.build_fsdp2_run(d, 4, replicas=2))


def test_hsdp_replicas_whose_optimizer_files_disagree_are_refused(hsdp_run, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hsdp_run, src, ignore=shutil.ignore_patterns("ref", ".done"))
    _edit_optim(src / "optim_world_size_4_rank_3.pt", _step_plus_5)  # replica 1's second shard
    one_line_error(
        cli("consolidate", src, "-o", tmp_path / "o.pt", "--optimizer"), "optimizer files of different steps"
    )
    assert not (tmp_path / "o.pt").exists()


def test_optimizer_state_no_param_group_lists_is_refused(tmp_path):
    from ckptshard.read.rank_optimizers import check_optimizers_agree

    groups = [{"params": [0, 1], "lr": 0.1}]
    with pytest.raises(CheckpointError, match="state for parameter id 7, which no param_group lists"):
        check_optimizers_agree([{"state": {0: {}, 7: {}}, "param_groups": groups}], ["optim_rank_0.pt"])
    check_optimizers_agree([{"state": {0: {"step": 3.0}}, "param_groups": groups}] * 2, ["a", "b"])
    with pytest.raises(CheckpointError, match=r"state\[0\]\['step'\] is 4.0, a's is 3.0: optimizer files of"):
        check_optimizers_agree(
            [
                {"state": {0: {"step": 3.0}}, "param_groups": groups},
                {"state": {0: {"step": 4.0}}, "param_groups": groups},
            ],
            ["a", "b"],
        )


def _rewrite_pickle(path, old, new):
    """``path`` re-zipped with ``old`` replaced by ``new`` in its data.pkl (CRCs right, records stored)."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        records = [(i, zf.read(i.filename)) for i in zf.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for info, data in records:
            zf.writestr(info, data.replace(old, new) if info.filename.endswith("data.pkl") else data)


def test_a_dtensor_that_states_another_dtype_than_its_bytes_is_refused(src, tmp_path):
    _rewrite_pickle(src / "model_world_size_3_rank_1.pt", b"torch\nfloat32\n", b"torch\nfloat64\n")
    for args in (("reshard", src, "-n", 2, "-o", tmp_path / "out"), ("consolidate", src, "-o", tmp_path / "o.pt")):
        one_line_error(cli(*args), "a DTensor that says torch.float64 over a local tensor of torch.float32")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_torch_distributed_function_in_a_dtensor_pickle_is_refused_not_passed_on(src, tmp_path):
    marker = b"torch.distributed.distributed_c10d\nbarrier\n"
    _rewrite_pickle(src / "model_world_size_3_rank_1.pt", b"torch.distributed.tensor.placement_types\nShard\n", marker)
    for args in (("reshard", src, "-n", 2, "-o", tmp_path / "out"), ("inspect", src)):
        one_line_error(cli(*args), "torch.distributed.distributed_c10d.barrier")
    assert not (tmp_path / "out").exists()


def test_a_torch_distributed_class_made_by_a_call_is_refused(tmp_path):
    """torch pickles its distributed classes with NEWOBJ (enums aside): REDUCE on one would run its __init__
    on load, in ckptshard's output as much as in the input."""
    import pickle
    import zipfile

    from ckptshard.formats.torch_pickle import Unsupported
    from ckptshard.read.torch_file import read_torch_file

    def craft(module, name):
        body = pickle.GLOBAL + f"{module}\n{name}\n".encode() + pickle.MARK + pickle.BININT1 + b"\x02"
        return pickle.PROTO + b"\x02" + body + pickle.TUPLE + pickle.REDUCE + pickle.STOP

    path = tmp_path / "crafted.pt"
    for module, name, needle in [
        ("torch.distributed.device_mesh", "DeviceMesh", "DeviceMesh made by a call"),
        ("torch.distributed.elastic.multiprocessing", "start_processes", "global torch.distributed.elastic"),
    ]:
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("archive/data.pkl", craft(module, name))
            zf.writestr("archive/version", "3\n")
        with pytest.raises((Unsupported, CheckpointError), match=needle):
            read_torch_file(str(path))


SLOW_WORKERS = """
import signal, sys
sys.path.insert(0, sys.argv[1])
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, even in the background
import slow_worker
import ckptshard.execute.parallel as parallel
parallel._write_one = slow_worker.never_done
from ckptshard.cli import main
sys.argv = ["ckptshard", "reshard", sys.argv[2], "-n", "8", "-o", sys.argv[3], "--jobs", "2", "-q"]
main()
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_worker_processes_write_is_quiet_and_ends_them(fixtures, tmp_path, sig):
    import signal

    pids = tmp_path / "pids"
    pids.mkdir()
    tests = os.path.dirname(__file__)
    src, out = fixtures[4] / "fairseq", tmp_path / "out"
    cmd = [sys.executable, "-c", SLOW_WORKERS, tests, str(src), str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "SLOW_WORKER_PIDS": str(pids)})
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(pids.iterdir())) == 2
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode in (130, 143), (proc.returncode, err)
    assert "Traceback" not in err and "EOFError" not in err, err
    workers = [int(p.name) for p in pids.iterdir()]
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{w}") for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{w}") for w in workers)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".out")]


def test_hsdp_outputs_say_the_other_replicas_weights_were_not_compared(hsdp_run, tmp_path):
    res = ckptshard.consolidate(hsdp_run, tmp_path / "full.pt", progress=False)
    assert res.notes[0] == (
        "HSDP: the weights are replica 0's; the other 1 replica(s)' weights were not compared "
        "(their optimizer files were: steps and param groups agree)"
    )
    assert ckptshard.reshard(hsdp_run, tmp_path / "re", 4, progress=False).notes == res.notes[:1]


def test_model_parts_that_name_other_parameters_are_refused(tmp_path):
    import torch

    src = tmp_path / "src"
    write_synthetic_parts(str(src), 2, 2, 2, 8)
    for r in range(2):
        path = src / f"checkpoint_last-model_part-1-shard{r}.pt"
        obj = torch.load(path, weights_only=False)
        fp = next(iter(obj["shard_metadata"]["param_metadata"][0]["params"].values()))
        fp["names"] = ["renamed." + fp["names"][0], *fp["names"][1:]]
        torch.save(obj, path)
    for args in (("reshard", src, "-n", 3, "-o", tmp_path / "out"), ("consolidate", src, "-o", tmp_path / "o.pt")):
        one_line_error(cli(*args), "model part 1 holds other parameters than part 0 (e.g. renamed.")
    assert sorted(os.listdir(tmp_path)) == ["src"]

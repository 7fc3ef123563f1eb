"""Hostile and unlucky inputs: no silent wrong output, no user file lost, no traceback, no orphan.

Each test is named by the behaviour it checks; docs/errors.md says what the user sees.
"""

import argparse
import fcntl
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import zipfile

import pytest
import torch
from test_bad_input import copy_fixture, edit

from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard
from ckptshard.execute.verify import verify

SHARD = "checkpoint_last-shard{}.pt"


def cli(*args, env=None, timeout=120, cwd=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ckptshard.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )


def one_line_error(res, needle):
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    assert needle in res.stderr, res.stderr


def both_readers(monkeypatch):
    """Run a check with the torch-free reader, then with torch's."""
    yield
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    yield


def names_in(folder):
    return sorted(p.name for p in folder.iterdir())


# 1 -------------------------------------------------------------------------------------------------------


def _other_step_shard(fixtures, tmp_path, rank):
    """A shard of another save with the same layout: what a training job writes over the old one."""
    other = copy_fixture(fixtures, tmp_path, name="other")
    edit(
        other / SHARD.format(rank),
        lambda o: o["model"].update({k: v + 1 for k, v in o["model"].items() if "flat_param" in k}),
    )
    return other / SHARD.format(rank)


def test_source_overwritten_during_consolidate_fails_and_writes_nothing(fixtures, tmp_path, monkeypatch):
    import ckptshard.write.copier as fill

    src = copy_fixture(fixtures, tmp_path)
    newer = _other_step_shard(fixtures, tmp_path, 1)
    real, calls = fill.Copier._copy, []

    def training_job_saves(self, *a):  # the job replaces shard 1 after the pickles were read
        if not calls:
            shutil.copyfile(newer, src / SHARD.format(1))
        calls.append(1)
        return real(self, *a)

    monkeypatch.setattr(fill.Copier, "_copy", training_job_saves)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match="changed while ckptshard was reading it"):
        consolidate(str(src), str(out / "full.pt"), progress=False)
    assert calls and names_in(out) == []


def test_source_replaced_during_reshard_in_worker_processes_fails(fixtures, tmp_path, monkeypatch):
    import ckptshard.execute.reshard as reshard_mod

    src = copy_fixture(fixtures, tmp_path)
    newer = _other_step_shard(fixtures, tmp_path, 2)
    real = reshard_mod.write_torch_files

    def replaced_then_written(work, jobs, *a):  # os.replace: a new inode under the same name, as rsync does
        shutil.copyfile(newer, src / "incoming")
        os.replace(src / "incoming", src / SHARD.format(2))
        return real(work, 2, *a)

    monkeypatch.setattr(reshard_mod, "write_torch_files", replaced_then_written)
    with pytest.raises(CheckpointError, match="changed while ckptshard was reading it"):
        reshard(str(src), str(tmp_path / "re"), 4, progress=False, jobs=2)
    assert not (tmp_path / "re").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".re.")]


# 2, 3 ----------------------------------------------------------------------------------------------------


def test_overwrite_never_deletes_a_folder_of_user_files(fixtures, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')\n")
    (project / "notes.txt").write_text("notes\n")
    res = cli("reshard", fixtures[3] / "fairseq", "-n", 2, "-o", ".", "--overwrite", "-q", cwd=project)
    one_line_error(res, "replaces only what ckptshard wrote")
    assert names_in(project) == ["notes.txt", "train.py"]
    # A ckptshard output with a user's file added, and one holding the working directory: both kept.
    out = tmp_path / "re"
    reshard(str(fixtures[3] / "fairseq"), str(out), 2, progress=False)
    (out / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match=r"holds files its manifest does not list \(mine.txt\)"):
        reshard(str(fixtures[3] / "fairseq"), str(out), 4, progress=False, overwrite=True)
    (out / "mine.txt").unlink()
    res = cli("reshard", fixtures[3] / "fairseq", "-n", 4, "-o", out, "--overwrite", "-q", cwd=out)
    one_line_error(res, "holds the current folder")
    # Its own output, untouched: replaced.
    reshard(str(fixtures[3] / "fairseq"), str(out), 4, progress=False, overwrite=True)
    assert names_in(out) == sorted(["ckptshard-manifest.json"] + [SHARD.format(r) for r in range(4)])


def test_an_input_named_like_an_output_manifest_is_never_overwritten(fixtures, tmp_path):
    src = tmp_path / "model.pt.manifest.json"  # a world-size-1 checkpoint, oddly named
    shutil.copyfile(fixtures[1] / "fairseq" / SHARD.format(0), src)
    before = src.read_bytes()
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match="output would overwrite the input"):
            consolidate(str(src), str(tmp_path / "model.pt"), progress=False, overwrite=overwrite)
    assert src.read_bytes() == before and names_in(tmp_path) == ["model.pt.manifest.json"]
    # A user's file in a manifest's place (not an input) is not replaced either.
    (tmp_path / "other.pt.manifest.json").write_text("my notes")
    with pytest.raises(CheckpointError, match="not a ckptshard manifest"):
        consolidate(str(fixtures[2] / "fairseq"), str(tmp_path / "other.pt"), progress=False, overwrite=True)
    assert (tmp_path / "other.pt.manifest.json").read_text() == "my notes"


# 4 -------------------------------------------------------------------------------------------------------


def _trunk(obj):
    entry = next(e for e in obj["fsdp_metadata"]["param_metadata"] if e["fsdp_path"] == "trunk")
    return entry["params"]["flat_param_0"]


def _lie_about_padding(obj, rank):
    """Shrink trunk.stem_bn.bias by one element and move that element into the padding: 180 -> 179
    elements keep 60 per rank on 3 ranks, so every size and padding in the metadata still adds up."""
    info = _trunk(obj)
    i = info["names"].index("stem_bn.bias")
    info["shapes"][i] = torch.Size([11])
    info["numels"][i] = 11
    info["padding"] = 1 if rank == 2 else 0


def test_padding_that_holds_values_is_refused(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    for r in range(3):
        edit(src / SHARD.format(r), lambda o, r=r: _lie_about_padding(o, r))
    for run in (
        lambda: consolidate(str(src), str(tmp_path / "o.pt"), progress=False),
        lambda: reshard(str(src), str(tmp_path / "o"), 2, progress=False),
    ):
        with pytest.raises(CheckpointError, match="trunk.flat_param_0: its last 1 elements are padding"):
            run()
    assert names_in(tmp_path) == ["src"]


def test_a_parameter_listed_twice_is_refused(fixtures, tmp_path):
    def twice(o):
        info = _trunk(o)
        info["names"][2] = info["names"][1]  # stem_bn.bias -> stem_bn.weight: same shape, one tensor lost

    src = copy_fixture(fixtures, tmp_path)
    for r in range(3):
        edit(src / SHARD.format(r), twice)
    with pytest.raises(CheckpointError, match="'trunk.stem_bn.weight' is listed twice"):
        consolidate(str(src), str(tmp_path / "o.safetensors"), progress=False)


def _with_duplicate_record(path):
    """The same zip with a second record under the name of the first tensor's: each reader may pick either."""
    with zipfile.ZipFile(path) as zf:
        records = [(i, zf.read(i.filename)) for i in zf.infolist()]
    info, raw = next((i, b) for i, b in records if "/data/" in i.filename)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name, and writes it
        for i, b in records + [(info, bytes(len(raw)))]:
            zf.writestr(i, b)


def test_a_zip_with_two_records_of_one_name_is_refused_by_both_readers(fixtures, tmp_path, monkeypatch):
    src = copy_fixture(fixtures, tmp_path)
    _with_duplicate_record(src / SHARD.format(1))
    for _ in both_readers(monkeypatch):
        with pytest.raises(CheckpointError, match="the zip holds two records named"):
            consolidate(str(src), str(tmp_path / "o.pt"), progress=False)
    assert names_in(tmp_path) == ["src"]


@pytest.mark.parametrize(
    "lie, needle",
    [
        (lambda o: o["last_optimizer_state"]["param_groups"][0].update(lr=0.5), "param_groups differ from rank 0's"),
        (
            lambda o: o["last_optimizer_state"]["state"][3].update(
                step=o["last_optimizer_state"]["state"][3]["step"] + 1
            ),
            "state[3]['step'] is 4.0, rank 0's is 3.0",
        ),
        (
            lambda o: o["model"].update(
                {"trunk.stem_bn.running_mean": o["model"]["trunk.stem_bn.running_mean"].double()}
            ),
            "buffer 'trunk.stem_bn.running_mean' is torch.float64 [12], rank 0 has torch.float32 [12]",
        ),
        (
            lambda o: o["model"].update({"trunk.stem_bn.running_var": torch.ones(13)}),
            "buffer 'trunk.stem_bn.running_var' is torch.float32 [13]",
        ),
    ],
)
def test_replicated_values_that_differ_between_ranks_are_refused(fixtures, tmp_path, lie, needle):
    src = copy_fixture(fixtures, tmp_path)
    edit(src / SHARD.format(1), lie)
    for run in (
        lambda: consolidate(str(src), str(tmp_path / "o.pt"), progress=False, optimizer=True),
        lambda: reshard(str(src), str(tmp_path / "o"), 2, progress=False),
    ):
        with pytest.raises(CheckpointError) as e:
            run()
        assert needle in str(e.value), str(e.value)
    assert names_in(tmp_path) == ["src"]


# 5 -------------------------------------------------------------------------------------------------------


def test_verify_fails_a_manifest_that_leaves_files_out(fixtures, tmp_path):
    out = tmp_path / "re"
    reshard(str(fixtures[2] / "fairseq"), str(out), 3, progress=False)
    manifest = out / "ckptshard-manifest.json"
    m = json.loads(manifest.read_text())
    del m["files"][SHARD.format(2)]
    manifest.write_text(json.dumps(m))
    victim = out / SHARD.format(2)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert verify(str(out)) == [f"{SHARD.format(2)}: not listed in the manifest"]
    # A single-file output whose manifest describes another file.
    f = tmp_path / "f.safetensors"
    consolidate(str(fixtures[2] / "fairseq"), str(f), progress=False)
    mf = tmp_path / "f.safetensors.manifest.json"
    m = json.loads(mf.read_text())
    m["files"] = {"g.safetensors": m["files"]["f.safetensors"]}
    mf.write_text(json.dumps(m))
    shutil.copyfile(f, tmp_path / "g.safetensors")
    assert "f.safetensors: not listed in the manifest" in verify(str(f))


# 6 -------------------------------------------------------------------------------------------------------

DISK_FULL = """
import errno, os, sys, ckptshard.write.copier as fill
real, calls = fill.Copier._copy, []
def full(self, *a):
    calls.append(1)
    if len(calls) == 3:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(self, *a)
fill.Copier._copy = full
from ckptshard.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_disk_full_mid_write_is_one_line_and_leaves_nothing(fixtures, tmp_path, jobs):
    out = tmp_path / "out"
    out.mkdir()
    args = ["reshard", str(fixtures[3] / "fairseq"), "-n", "5", "-o", str(out / "re"), "-q", "--jobs", jobs]
    if jobs == "2":  # the workers are fresh processes: make the disk full there too
        (tmp_path / "sitecustomize.py").write_text(DISK_FULL.split("from ckptshard.cli")[0])
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = subprocess.run([sys.executable, "-c", DISK_FULL, *args], capture_output=True, text=True, env=env, timeout=120)
    one_line_error(res, "No space left on device: the disk filled up while writing; nothing was written")
    assert names_in(out) == []


def test_the_space_check_counts_what_the_files_really_take(fixtures, tmp_path, monkeypatch):
    import ckptshard.execute.reshard as reshard_mod

    asked = []
    real = reshard_mod.check_space
    monkeypatch.setattr(reshard_mod, "check_space", lambda dst, n: (asked.append(n), real(dst, n)))
    reshard(str(fixtures[3] / "fairseq"), str(tmp_path / "re"), 40, progress=False)
    written = sum(p.stat().st_size for p in (tmp_path / "re").iterdir())
    assert written <= asked[0] <= 3 * written, (written, asked)


# 7 -------------------------------------------------------------------------------------------------------


def test_concurrent_safe_loads_keep_the_extra_allow_list(tmp_path):
    from ckptshard.read.safe_load import load_lazy

    path = tmp_path / "with_args.pt"
    torch.save({"args": argparse.Namespace(lr=0.1), "w": torch.ones(3)}, path)
    errors = []

    def load_many():
        for _ in range(40):
            try:
                assert load_lazy(str(path))["args"].lr == 0.1
            except Exception as e:
                errors.append(repr(e))

    threads = [threading.Thread(target=load_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# 8, 9 ---------------------------------------------------------------------------------------------------


def test_a_compressed_record_is_refused_before_it_is_inflated(fixtures, tmp_path, monkeypatch):
    src = copy_fixture(fixtures, tmp_path)
    victim = src / SHARD.format(0)
    with zipfile.ZipFile(victim) as zf:
        records = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
    with zipfile.ZipFile(victim, "w") as zf:
        for name, raw in records:
            big = name.endswith("data.pkl")
            zf.writestr(
                name, raw + (b"\0" * (64 << 20) if big else b""), zipfile.ZIP_DEFLATED if big else zipfile.ZIP_STORED
            )
    assert victim.stat().st_size < 8 << 20  # 64 MiB of zeros packed small: a bomb in miniature
    for _ in both_readers(monkeypatch):
        with pytest.raises(CheckpointError, match="is compressed, which torch.save never does"):
            consolidate(str(src), str(tmp_path / "o.pt"), progress=False)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_an_input_that_is_not_a_regular_file_is_refused_at_once(fixtures, tmp_path, kind):
    src = copy_fixture(fixtures, tmp_path)
    victim = src / SHARD.format(1)
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", victim)
    else:
        victim.mkdir()
    needle = {"fifo": "is a named pipe", "dev-zero": "is a character device", "folder": "is a folder"}[kind]
    for args in (("consolidate", src, "-o", tmp_path / "o.pt"), ("inspect", src)):
        one_line_error(cli(*args, timeout=60), needle)
    res = cli("consolidate", victim, "-o", tmp_path / "o.pt", timeout=60)  # named directly
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert names_in(tmp_path) == ["src"]


# 10, 11 --------------------------------------------------------------------------------------------------


def test_rank_and_world_size_exported_by_a_job_script_do_not_make_a_torchrun_run(fixtures, tmp_path):
    env = {"RANK": "1", "WORLD_SIZE": "2"}  # as a SLURM script exports them, without torchrun
    res = cli("consolidate", fixtures[2] / "fairseq", "-o", tmp_path / "o.pt", "-q", env=env, timeout=60)
    assert res.returncode == 0 and "wrote" in res.stdout, res.stderr
    res = cli("reshard", fixtures[2] / "fairseq", "-n", 3, "-o", tmp_path / "re", "-q", env=env, timeout=60)
    assert res.returncode == 0 and "wrote 3 files" in res.stdout, res.stderr


def test_a_torchrun_rank_whose_peers_never_come_times_out_in_one_line(fixtures, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "lonely",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "CKPTSHARD_DIST_TIMEOUT": "3",
    }
    start = time.time()
    res = cli("reshard", fixtures[2] / "fairseq", "-n", 3, "-o", tmp_path / "re", "-q", env=env, timeout=120)
    one_line_error(res, "the other ranks of 2 did not join within 3 s")
    assert time.time() - start < 90
    assert not (tmp_path / "re").exists()


STUCK_WORKERS = """
import os, sys, time
from ckptshard.execute.parallel import map_in_processes
print(os.getpid(), flush=True)
map_in_processes(time.sleep, [600, 600], 2)
"""


def _children(pid):
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_their_parent_and_release_the_callers_stdout(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", STUCK_WORKERS], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        parent = int(p.stdout.readline())
        deadline = time.time() + 60
        while time.time() < deadline:
            workers = [c for c in _children(parent) if b"spawn_main" in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
            if len(workers) == 2:
                break
            time.sleep(0.1)
        assert len(workers) == 2
        os.kill(parent, signal.SIGKILL)
        got = []
        reader = threading.Thread(target=lambda: got.append(p.stdout.read()), daemon=True)
        reader.start()
        reader.join(30)  # every holder of the pipe (workers, resource tracker) gone: EOF
        assert got == [b""], "the caller's stdout is still held open"
        assert not [w for w in workers if _alive(w)]
    finally:
        p.kill()
        p.wait()
        for w in _children(p.pid):
            os.kill(w, signal.SIGKILL)


# 12 ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "header-not-json",
        "header-a-list",
        "entry-missing-shape",
        "index-not-json",
        "index-no-weight-map",
        "index-missing-file",
        "manifest-not-json",
        "manifest-files-a-list",
        "manifest-bytes-a-string",
    ],
)
def test_malformed_safetensors_index_and_manifest_are_one_line_errors(fixtures, tmp_path, case):
    full = tmp_path / "full.safetensors"
    consolidate(str(fixtures[2] / "fairseq"), str(full), progress=False)
    idx = tmp_path / "idx"
    consolidate(str(fixtures[2] / "fairseq"), str(idx), progress=False, max_shard_size=2000)
    raw = full.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])

    def with_header(text):
        body = text.encode().ljust(n)
        assert len(body) == n
        full.write_bytes(raw[:8] + body + raw[8 + n :])

    index = idx / "model.safetensors.index.json"
    manifest = tmp_path / "full.safetensors.manifest.json"
    target, needle = full, None
    if case == "header-not-json":
        with_header("{not json")
        needle = "header is not JSON"
    elif case == "header-a-list":
        with_header("[1, 2]")
        needle = "header is not a JSON object"
    elif case == "entry-missing-shape":
        name = next(k for k in header if k != "__metadata__")
        del header[name]["shape"]
        with_header(json.dumps(header, separators=(",", ":")))
        needle = "malformed header entry"
    elif case == "index-not-json":
        index.write_text("{")
        target, needle = idx, "model.safetensors.index.json: not JSON"
    elif case == "index-no-weight-map":
        index.write_text(json.dumps({"metadata": {}}))
        target, needle = idx, "no weight_map"
    elif case == "index-missing-file":
        m = json.loads(index.read_text())
        m["weight_map"][next(iter(m["weight_map"]))] = "gone.safetensors"
        index.write_text(json.dumps(m))
        target, needle = idx, "names 'gone.safetensors', which is not in"
    elif case == "manifest-not-json":
        manifest.write_text("][")
        needle = "not a ckptshard manifest"
    elif case == "manifest-files-a-list":
        manifest.write_text(json.dumps({"ckptshard_version": "0", "files": []}))
        needle = "not a ckptshard manifest"
    else:
        m = json.loads(manifest.read_text())
        m["files"]["full.safetensors"]["bytes"] = "many"
        manifest.write_text(json.dumps(m))
        needle = "not a ckptshard manifest"
    res = cli("verify", target)  # a changed file: the manifest tells first
    one_line_error(
        res,
        needle if case.startswith("manifest") else "manifest says" if case.startswith("index") else "checksum differs",
    )
    if not case.startswith("manifest"):  # shard reads the state dict itself, no manifest
        res = cli("shard", target, "--like", fixtures[2] / "fairseq", "-n", 2, "-o", tmp_path / "sh")
        one_line_error(res, needle)
        assert not (tmp_path / "sh").exists()


# 13 ------------------------------------------------------------------------------------------------------


def test_nesting_hundreds_of_levels_deep_is_one_line_error(fixtures, tmp_path, monkeypatch):
    src = copy_fixture(fixtures, tmp_path)

    def deep(o):
        x = []
        for _ in range(500):
            x = [x]
        o["extra_state"]["deep"] = x

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # torch.save recurses per level
    try:
        edit(src / SHARD.format(0), deep)
    finally:
        sys.setrecursionlimit(limit)
    for env in ({}, {"CKPTSHARD_TORCH_READER": "1"}):
        for args in (
            ("inspect", src),
            ("consolidate", src, "-o", tmp_path / "o.pt"),
            ("reshard", src, "-n", 2, "-o", tmp_path / "re"),
        ):
            one_line_error(cli(*args, env=env), "containers nested more than 100 levels deep")
    assert names_in(tmp_path) == ["src"]


def test_a_pickle_that_shares_one_list_exponentially_is_refused(tmp_path):
    import pickle

    from ckptshard.formats.torch_pickle import check_depth

    x = []
    for _ in range(60):
        x = [x, x]  # 2**60 leaves once expanded, 60 objects in the pickle
    assert len(pickle.dumps(x)) < 2000
    with pytest.raises(CheckpointError, match="expands to more than"):
        check_depth(x, "crafted.pt")


# 14, 15 --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_dir", [True, False])
def test_overwrite_whose_final_rename_fails_keeps_the_old_output_whole(fixtures, tmp_path, monkeypatch, is_dir):
    import ckptshard.osio.atomic as atomic

    out = tmp_path / ("re" if is_dir else "f.safetensors")
    run = (
        (lambda n, **kw: reshard(str(fixtures[n] / "fairseq"), str(out), 2, progress=False, **kw))
        if is_dir
        else (lambda n, **kw: consolidate(str(fixtures[n] / "fairseq"), str(out), progress=False, **kw))
    )
    run(2)
    before = {p.name: p.read_bytes() for p in (out.iterdir() if is_dir else [out])}
    real_rename = os.rename

    def fails_into_place(a, b, *rest):
        if str(b) == str(out) and ".ckptshard-tmp" in str(a):
            raise OSError(5, "Input/output error", str(b))
        return real_rename(a, b, *rest)

    monkeypatch.setattr(atomic.os, "rename", fails_into_place)
    monkeypatch.setattr(atomic.os, "replace", fails_into_place)
    with pytest.raises(OSError):
        run(3, overwrite=True)
    assert {p.name: p.read_bytes() for p in (out.iterdir() if is_dir else [out])} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_long_output_names_work_or_fail_in_one_line(fixtures, tmp_path):
    long_ok = tmp_path / ("a" * 230 + ".pt")  # its manifest's name is 247 bytes: fits 255
    res = cli("consolidate", fixtures[2] / "fairseq", "-o", long_ok, "-q")
    assert res.returncode == 0, res.stderr
    assert torch.load(long_ok, weights_only=True)
    too_long = tmp_path / ("b" * 245 + ".pt")  # fits, but its manifest's name would not
    one_line_error(cli("consolidate", fixtures[2] / "fairseq", "-o", too_long), "is longer than the 255 bytes")
    assert not too_long.exists()


# 16, 17, 18 ----------------------------------------------------------------------------------------------


def test_legacy_shards_holding_other_objects_read_with_trust_pickles(fixtures, tmp_path):
    import fractions

    src = tmp_path / "legacy"
    src.mkdir()
    for r in range(2):
        obj = torch.load(fixtures[2] / "fairseq" / SHARD.format(r), weights_only=False)
        obj["extra_state"]["ratio"] = fractions.Fraction(1, 3)  # outside every allow-list
        torch.save(obj, src / SHARD.format(r), _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="if it holds other Python objects and you trust it, pass --trust"):
        consolidate(str(src), str(tmp_path / "o.safetensors"), progress=False)
    consolidate(str(src), str(tmp_path / "o.safetensors"), progress=False, trust_pickles=True)
    import safetensors.torch

    want = torch.load(fixtures[2] / "ref" / "full_state_dict.pt", weights_only=True)
    got = safetensors.torch.load_file(tmp_path / "o.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


KILLED_MID_WRITE = """
import os, sys, time, ckptshard.write.copier as fill
real = fill.Copier._copy
def stuck(self, *a):
    real(self, *a)
    open(sys.argv[3], "w").close()
    time.sleep(600)
fill.Copier._copy = stuck
from ckptshard.cli import main
main(["consolidate", sys.argv[1], "-o", sys.argv[2], "-q"])
"""


def test_a_temporary_left_by_kill_9_is_removed_by_the_next_run_which_says_so(fixtures, tmp_path):
    out, reached = tmp_path / "o.safetensors", tmp_path / "copying"
    p = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, str(fixtures[2] / "fairseq"), str(out), str(reached)],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while not reached.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert reached.exists()
        held = [q for q in tmp_path.iterdir() if q.name.endswith(".ckptshard-tmp")]
        assert len(held) == 1
        # While it runs, a second run on the same output is told so and touches nothing.
        one_line_error(cli("consolidate", fixtures[2] / "fairseq", "-o", out), "another ckptshard run is writing")
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        p.kill()
        p.wait()
    assert held[0].exists()  # what kill -9 leaves
    res = cli("consolidate", fixtures[2] / "fairseq", "-o", out, "-q")
    assert res.returncode == 0, res.stderr
    assert f"removed {held[0]}: left unfinished by an interrupted run" in res.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["copying", "o.safetensors", "o.safetensors.manifest.json"]


def test_a_temporary_locked_by_a_live_run_is_left_alone(fixtures, tmp_path):
    from ckptshard.osio.atomic import TMP_SUFFIX, new_beside

    tmp = new_beside(str(tmp_path), "o.pt", TMP_SUFFIX, is_dir=False)
    fd = os.open(tmp, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CheckpointError, match="another ckptshard run is writing it now"):
            consolidate(str(fixtures[2] / "fairseq"), str(tmp_path / "o.pt"), progress=False)
        assert os.path.exists(tmp)
    finally:
        os.close(fd)


def test_reshard_plans_each_rank_when_it_writes_it(fixtures, tmp_path, monkeypatch):
    import ckptshard.execute.reshard as reshard_mod

    planned = []
    real = reshard_mod.resharded_file
    monkeypatch.setattr(reshard_mod, "resharded_file", lambda *a, **k: (planned.append(a[2]), real(*a, **k))[1])

    def full(final, nbytes):
        raise CheckpointError(f"{final}: needs {nbytes} bytes")

    monkeypatch.setattr(reshard_mod, "check_space", full)
    with pytest.raises(CheckpointError, match="needs"):
        reshard(str(fixtures[3] / "fairseq"), str(tmp_path / "re"), 100_000, progress=False)
    assert planned == [0]  # one rank planned (every check of the input), not 100,000, before the space check
    monkeypatch.undo()
    planned.clear()
    monkeypatch.setattr(reshard_mod, "resharded_file", lambda *a, **k: (planned.append(a[2]), real(*a, **k))[1])
    reshard(str(fixtures[3] / "fairseq"), str(tmp_path / "re"), 7, progress=False)
    assert sorted(planned) == list(range(7))  # each once

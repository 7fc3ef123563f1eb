"""Parallel writing (--jobs, torchrun) gives the single-process bytes."""

import os
import subprocess
import sys

import pytest

from ckptshard.execute.reshard import reshard
from ckptshard.fsdp.launch import free_port


def same_files(a, b):
    """Same files, same bytes; the manifests list the same sizes and digests (whoever computed them)."""
    import json

    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        if n != "ckptshard-manifest.json":
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    manifests = [json.loads((x / "ckptshard-manifest.json").read_text())["files"] for x in (a, b)]
    assert manifests[0] == manifests[1]
    return names


def test_jobs_equal_single_process(fixtures, tmp_path):
    reshard(str(fixtures[3] / "vissl" / "model_phase2.torch"), str(tmp_path / "one"), 5, progress=False)
    reshard(str(fixtures[3] / "vissl" / "model_phase2.torch"), str(tmp_path / "many"), 5, progress=False, jobs=3)
    assert len(same_files(tmp_path / "one", tmp_path / "many")) == 7  # 5 shards, shard_list, manifest


def test_torchrun_two_ranks_equal_single_process(fixtures, tmp_path):
    src = str(fixtures[4] / "fairseq")
    reshard(src, str(tmp_path / "one"), 5, progress=False)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    res = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "ckptshard.cli",
            "reshard",
            src,
            "-n",
            "5",
            "-o",
            str(tmp_path / "dist"),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("wrote 5 files") == 1  # rank 0 reports (manifest not counted)
    same_files(tmp_path / "one", tmp_path / "dist")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_torchrun_error_on_one_rank_fails_every_rank_promptly(fixtures, tmp_path):
    # The output exists: every rank must report it and exit, none left waiting in a
    # collective for rank 0 (where torchrun would have to tear it down).
    (tmp_path / "taken").mkdir()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    res = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "ckptshard.cli",
            "reshard",
            str(fixtures[2] / "fairseq"),
            "-n",
            "3",
            "-o",
            str(tmp_path / "taken"),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    assert res.stderr.count("exists; pass --overwrite") == 2  # both ranks, each from its own check
    assert list((tmp_path / "taken").iterdir()) == []


def test_torchrun_dcp_equals_single_process(fixtures, tmp_path):
    from ckptshard.execute.convert import convert

    src = str(fixtures[3] / "vissl" / "model_phase2.torch")
    convert(src, str(tmp_path / "one"), "dcp", progress=False)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    res = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "ckptshard.cli",
            "convert",
            src,
            "--to",
            "dcp",
            "-o",
            str(tmp_path / "dist"),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("wrote ") == 1  # rank 0 reports
    assert len(same_files(tmp_path / "one", tmp_path / "dist")) == 5  # 3 data files, .metadata, manifest
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def _consolidated_folders_equal(a, b):
    names = same_files(a, b)
    assert "model.safetensors.index.json" in names and len(names) >= 5, names  # several files, index, manifest
    return names


def test_consolidate_jobs_equal_single_process(fixtures, tmp_path):
    from ckptshard.execute.consolidate import consolidate

    src = str(fixtures[3] / "fairseq")
    consolidate(src, str(tmp_path / "one"), max_shard_size=1500, progress=False)
    consolidate(src, str(tmp_path / "many"), max_shard_size=1500, progress=False, jobs=3)
    _consolidated_folders_equal(tmp_path / "one", tmp_path / "many")


def test_torchrun_consolidate_equals_single_process(fixtures, tmp_path):
    from ckptshard.execute.consolidate import consolidate

    src = str(fixtures[2] / "metaseq")
    consolidate(src, str(tmp_path / "one"), max_shard_size=1500, optimizer=True, progress=False)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    res = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "ckptshard.cli",
            "consolidate",
            src,
            "--max-shard-size",
            "1500",
            "--optimizer",
            "-o",
            str(tmp_path / "dist"),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("wrote ") == 1  # rank 0 reports
    _consolidated_folders_equal(tmp_path / "one", tmp_path / "dist")
    # rank 0 writes the full optimizer state beside the folder
    assert (tmp_path / "dist.optim.pt").read_bytes() == (tmp_path / "one.optim.pt").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_jobs_refused_for_a_single_file(fixtures, tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptshard.cli",
            "consolidate",
            str(fixtures[2] / "fairseq"),
            "-o",
            str(tmp_path / "full.safetensors"),
            "--jobs",
            "2",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert "give --max-shard-size" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_a_torchrun_rank_leaves_the_group_then_exits_0_and_a_plain_run_does_nothing(monkeypatch):
    import types

    from ckptshard.execute import parallel

    calls = []
    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        barrier=lambda: calls.append("barrier"),
        destroy_process_group=lambda: calls.append("destroy"),
    )
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)

    def exit_(code):
        calls.append(f"exit {code}")
        raise SystemExit(code)

    monkeypatch.setattr(parallel.os, "_exit", exit_)
    with pytest.raises(SystemExit):
        parallel.leave_torchrun()
    assert calls == ["barrier", "destroy", "exit 0"]
    calls.clear()
    fake.is_initialized = lambda: False
    parallel.leave_torchrun()
    assert calls == []


def test_workers_hash_what_they_write_so_the_parent_reads_no_output_again(fixtures, tmp_path, monkeypatch):
    """--jobs: each worker returns its files' digests; the parent hashes only what it wrote itself."""
    import json

    from xxhash import xxh3_128

    import ckptshard.osio.manifest as manifest
    from ckptshard.execute.consolidate import consolidate
    from ckptshard.execute.convert import convert

    read_again = []
    real = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda p, *a: (read_again.append(os.path.basename(p)), real(p, *a))[1])
    src = str(fixtures[3] / "vissl")
    reshard(src, str(tmp_path / "re"), 5, progress=False, jobs=2)
    consolidate(str(fixtures[3] / "fairseq"), str(tmp_path / "idx"), max_shard_size=2000, progress=False, jobs=2)
    convert(str(fixtures[3] / "fairseq"), str(tmp_path / "dcp"), "dcp", progress=False, jobs=2)
    # Only the files the parent writes itself: VISSL's shard_list, the index, DCP's .metadata.
    assert sorted(read_again) == [".metadata", "model.safetensors.index.json", "model_phase2.torch"]
    for out in ("re", "idx", "dcp"):
        files = json.loads((tmp_path / out / "ckptshard-manifest.json").read_text())["files"]
        assert len(files) >= 3
        for name, info in files.items():
            assert info["xxh3_128"] == xxh3_128((tmp_path / out / name).read_bytes()).hexdigest(), (out, name)


def test_a_size_reaches_a_worker_as_itself_not_as_torch_size():
    """Unpickling torch.Size in a worker would import torch there (1-2 s, ~200 MiB each)."""
    from ckptshard.dtypes import Size
    from ckptshard.execute.parallel import map_in_processes

    assert map_in_processes(type, [Size((2, 3))], 1) == [Size]


def _three_ways(fixtures, out, monkeypatch):
    """reshard, a consolidated folder and DCP (every command that writes several files in one process):
    for each, the thread pool's size and the names of the threads that copied its tensors."""
    import threading

    import ckptshard.execute.parallel as parallel
    from ckptshard.execute.consolidate import consolidate
    from ckptshard.execute.convert import convert
    from ckptshard.write.copier import Copier

    names, pools = set(), []
    real, real_map = Copier.fill, parallel.map_in_threads
    monkeypatch.setattr(
        Copier, "fill", lambda self, *a: (names.add(threading.current_thread().name), real(self, *a))[1]
    )
    monkeypatch.setattr(
        parallel, "map_in_threads", lambda fn, jobs, n, *a: (pools.append(n), real_map(fn, jobs, n, *a))[1]
    )
    out.mkdir()
    seen = []
    reshard(str(fixtures[3] / "vissl"), str(out / "re"), 5, progress=False)
    seen.append((pools.pop(), set(names)))
    names.clear()
    consolidate(str(fixtures[3] / "fairseq"), str(out / "idx"), max_shard_size=2000, progress=False)
    seen.append((pools.pop(), set(names)))
    names.clear()
    convert(str(fixtures[3] / "fairseq"), str(out / "dcp"), "dcp", progress=True)  # the bar's ticks come from threads
    seen.append((pools.pop(), set(names)))
    assert not pools
    return seen


@pytest.mark.parametrize("cores", [2, 8])  # past one core, the files set the count, not the cores
def test_writer_threads_give_the_bytes_of_one_thread(fixtures, tmp_path, monkeypatch, cores):
    """The files of one output are written by a pool of several threads (one per file, at most 4; each file
    whole by one): the same bytes as one thread. How many of the pool's threads get a file is the scheduler's
    choice (a thread done with a small file takes the next), so the pool's size is what is checked."""
    import ckptshard.execute.parallel as parallel

    monkeypatch.setattr(parallel, "_cores", lambda: 1)
    assert _three_ways(fixtures, tmp_path / "one", monkeypatch) == [(1, {"ckptshard writer_0"})] * 3  # one writer
    monkeypatch.setattr(parallel, "_cores", lambda: cores)
    files = (5, 3, 3)  # shards, safetensors files, DCP data files
    for (pool, threads), n in zip(_three_ways(fixtures, tmp_path / "threads", monkeypatch), files):
        assert pool == min(4, n) and 1 <= len(threads) <= pool, (pool, threads)
        assert all(t.startswith("ckptshard writer") for t in threads), threads
    for out in ("re", "idx", "dcp"):
        assert len(same_files(tmp_path / "one" / out, tmp_path / "threads" / out)) >= 4, out


def test_a_failing_writer_thread_fails_the_command_and_leaves_no_output(fixtures, tmp_path, monkeypatch):
    import ckptshard.execute.parallel as parallel
    from ckptshard.errors import CheckpointError

    monkeypatch.setattr(parallel, "_cores", lambda: 2)
    monkeypatch.setattr(parallel, "writer_threads", lambda files: 2)
    import threading
    import time

    real = parallel._write_one
    failed = threading.Event()
    started = []

    def second_fails(job, *args):
        started.append(job[1])
        if job[1].endswith("shard1.torch"):
            failed.set()
            raise CheckpointError("disk on fire")
        if job[1].endswith("shard0.torch"):  # still running when shard1 fails: it ends, then the error is raised
            failed.wait(10)
            time.sleep(1)
        return real(job, *args)

    monkeypatch.setattr(parallel, "_write_one", second_fails)
    with pytest.raises(CheckpointError, match="disk on fire"):
        reshard(str(fixtures[3] / "vissl"), str(tmp_path / "re"), 5, progress=False)
    assert list(tmp_path.iterdir()) == []  # no output, no temporary
    assert len(started) == 2  # shards 2-4, not yet started when shard1 failed, were never begun


@pytest.mark.parametrize(
    "files, pieces, nbytes, cores, want",
    [
        (8, 912, 3 << 30, 2, 2),  # Adam state, reshard 3->8: runs of 3.4 MiB (1.20 s in threads, 0.89 s in 2 processes)
        (8, 930, 2 << 30, 2, 2),  # 92 FSDP instances, reshard 3->8: runs of 2.2 MiB (1.00 s, 0.66 s)
        (8, 240, 2 << 30, 2, 1),  # weights, 24 instances: runs of 8.5 MiB (0.61 s, 0.59 s: not worth two interpreters)
        (12, 216, 2 << 30, 2, 1),  # a consolidated folder of 256 MiB files: runs of 9.5 MiB (0.51 s, 0.55 s)
        (3, 1100, 3 << 30, 2, 1),  # 3 files for 2 processes: one writes two while the other idles (0.56 s, 0.63 s)
        (8, 912, 3 << 30, 1, 1),  # one core: nothing to share
        (8, 912, 32 << 20, 2, 1),  # small: starting the workers (about 0.06 s) costs more than it saves
        (64, 9000, 8 << 30, 16, 16),  # many cores, enough files: one process per core
        (8, 912, 3 << 30, 16, 4),  # many cores, 8 files: two per process (16 cores: 0.99 s threads, 0.87 s in 4)
        (48, 115_000, 3 << 28, 2, 2),  # 64 shards of 400 instances -> 48, 0.75 GiB: 11.2 s threads, 7.5 s in 2
        (48, 115_000, 3 << 28, 16, 16),  # the same on 16 cores: 32.6 s threads, 12.2 s in 16
        (12, 8642, 51 << 20, 2, 2),  # small, but many runs: 0.71 s threads, 0.62 s in 2
        (12, 2727, 51 << 20, 2, 1),  # small, fewer runs: 0.41 s, 0.38 s: within the noise, keep one process
    ],
)
def test_auto_processes_follows_the_measured_cases(files, pieces, nbytes, cores, want):
    from ckptshard.execute.parallel import auto_processes

    assert auto_processes(files, pieces, nbytes, cores) == want


def test_default_jobs_chooses_from_the_plan_and_gives_the_same_bytes(fixtures, tmp_path, monkeypatch):
    """--jobs 0 (the CLI's default) asks auto_processes with the plan's files, runs and bytes, and does what it says."""
    import ckptshard.execute.parallel as parallel
    from ckptshard.cli import main

    asked = []

    def choose(files, pieces, nbytes, cores):
        asked.append((files, pieces, nbytes))
        return 2

    monkeypatch.setattr(parallel, "auto_processes", choose)
    src = str(fixtures[3] / "vissl" / "model_phase2.torch")
    with pytest.raises(SystemExit) as done:
        main(["reshard", src, "-n", "5", "-o", str(tmp_path / "auto"), "-q"], prog_name="ckptshard")
    assert done.value.code == 0
    ((files, pieces, nbytes),) = asked
    assert files == 5 and pieces >= files and nbytes > 0
    reshard(src, str(tmp_path / "one"), 5, progress=False, jobs=1)
    assert len(same_files(tmp_path / "one", tmp_path / "auto")) == 7
    monkeypatch.setattr(parallel, "map_in_processes", lambda *a, **k: pytest.fail("processes with --jobs 1"))
    reshard(src, str(tmp_path / "threads"), 5, progress=False, jobs=1)  # an explicit 1 is never overridden
    assert asked == [(files, pieces, nbytes)]


@pytest.mark.parametrize("repartition", [(), ("--model-parallel", "1", "--mp-rule", r"layers\.1\.weight$=1")])
def test_torchrun_shares_model_parts_files_and_gives_the_single_process_bytes(tmp_path, repartition):
    from ckptshard.testing.synthetic import write_synthetic_parts

    src = str(tmp_path / "src")
    write_synthetic_parts(src, 3, 2, 2, 8)
    args = ["reshard", src, "-n", "3", *repartition, "-q"]
    one = subprocess.run([sys.executable, "-m", "ckptshard.cli", *args, "-o", str(tmp_path / "one")])
    assert one.returncode == 0
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    launch = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    res = subprocess.run(
        [*launch, "-m", "ckptshard.cli", *args, "-o", str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    names = same_files(tmp_path / "one", tmp_path / "dist")
    assert len(names) == (3 if repartition else 9) + 1  # rank files and the manifest

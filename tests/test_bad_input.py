"""Bad input: clear errors, nothing written; interrupted runs leave nothing that looks complete."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptshard
from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard
from ckptshard.execute.verify import verify


def copy_fixture(fixtures, tmp_path, ws=3, container="fairseq", name="src"):
    dst = tmp_path / name
    shutil.copytree(fixtures[ws] / container, dst)
    return dst


def edit(path, fn):
    obj = torch.load(path, weights_only=True)
    fn(obj)
    torch.save(obj, path)


def expect_error(src, needle, tmp_path):
    for run in (
        lambda: consolidate(str(src), str(tmp_path / "o.pt"), progress=False),
        lambda: reshard(str(src), str(tmp_path / "o"), 2, progress=False),
    ):
        with pytest.raises(CheckpointError) as e:
            run()
        assert needle in str(e.value), str(e.value)
    assert not any(p.name.startswith(("o", ".o")) for p in tmp_path.iterdir())


def test_missing_shard(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    os.unlink(src / "checkpoint_last-shard1.pt")
    expect_error(src, "missing shard(s) checkpoint_last-shard1.pt of 3", tmp_path)


def test_missing_last_shard_is_named_as_such(fixtures, tmp_path):
    # No name is missing (ranks 0-2 of 3 look complete); the shard sizes tell that 4 ranks wrote them.
    src = copy_fixture(fixtures, tmp_path, ws=4)
    os.unlink(src / "checkpoint_last-shard3.pt")
    expect_error(src, "fit 4 ranks: is a shard file missing?", tmp_path)


def test_metadata_saved_apart_from_the_weights_is_named_as_such(fixtures, tmp_path):
    src = tmp_path / "split"
    src.mkdir()
    for r in range(3):
        obj = torch.load(fixtures[3] / "fairseq" / f"checkpoint_last-shard{r}.pt", weights_only=True)
        torch.save(obj["model"], src / f"weights_shard{r}.pt")
        torch.save(obj["fsdp_metadata"], src / f"meta_shard{r}.pt")
    expect_error(src, "FSDP metadata is saved apart from the weights (meta_shard*.pt among", tmp_path)
    expect_error(
        src / "weights_shard0.pt", "a local state dict (flat_param_* tensors) without its FSDP metadata", tmp_path
    )


def test_replicas_of_a_smaller_sharding_are_named_as_such(fixtures, tmp_path):
    # Hybrid sharding: ranks 2-3 repeat ranks 0-1 (a second replica of a 2-rank FSDP group).
    src = copy_fixture(fixtures, tmp_path, ws=2)
    for r in range(2):
        shutil.copy(src / f"checkpoint_last-shard{r}.pt", src / f"checkpoint_last-shard{r + 2}.pt")
    expect_error(
        src, "fit 2 ranks: is there a shard file too many, or are these 2 replicas of a 2-rank sharding", tmp_path
    )


def test_extra_shard(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    shutil.copy(src / "checkpoint_last-shard2.pt", src / "checkpoint_last-shard3.pt")
    expect_error(src, "expected", tmp_path)


def test_rank_named_twice(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    shutil.copy(src / "checkpoint_last-shard1.pt", src / "checkpoint_last-shard01.pt")
    expect_error(src, "rank 1 appears more than once", tmp_path)


def test_shards_from_different_steps(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    edit(src / "checkpoint_last-shard2.pt", lambda o: o["optimizer_history"][-1].update(num_updates=7))
    expect_error(src, "shards from different steps or runs", tmp_path)


def test_shards_from_different_runs(fixtures, half_fixture, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    shutil.copy(half_fixture / "fairseq" / "checkpoint_last-shard1.pt", src / "checkpoint_last-shard1.pt")
    expect_error(src, "rank 0", tmp_path)


def test_metadata_disagree(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    edit(
        src / "checkpoint_last-shard1.pt",
        lambda o: o["fsdp_metadata"]["param_metadata"][1]["params"]["flat_param_0"].update(padding=5),
    )
    expect_error(src, "padding 5", tmp_path)


def test_truncated_file(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    p = src / "checkpoint_last-shard0.pt"
    p.write_bytes(p.read_bytes()[:-3000])
    expect_error(src, "checkpoint_last-shard0.pt", tmp_path)


def test_not_a_checkpoint(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    (src / "checkpoint_last-shard0.pt").write_text("hello")
    expect_error(src, "not a zip-format torch.save checkpoint", tmp_path)


def test_missing_metadata_key_names_keys_found(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    for r in range(3):
        edit(src / f"checkpoint_last-shard{r}.pt", lambda o: o.pop("fsdp_metadata"))
    expect_error(src, "keys found: ['args', 'cfg', 'extra_state'", tmp_path)


def test_missing_flat_param(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    edit(src / "checkpoint_last-shard1.pt", lambda o: o["model"].pop("trunk.gate.flat_param_0"))
    expect_error(src, "trunk.gate.flat_param_0", tmp_path)


def test_wrong_shard_shape(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    edit(src / "checkpoint_last-shard1.pt", lambda o: o["model"].update({"trunk.flat_param_0": torch.zeros(7)}))
    expect_error(src, "holds 7 elements", tmp_path)


def test_optimizer_entry_of_wrong_size(fixtures, tmp_path):
    src = copy_fixture(fixtures, tmp_path)
    edit(
        src / "checkpoint_last-shard0.pt",
        lambda o: o["last_optimizer_state"]["state"][1].update(exp_avg=torch.zeros(3)),
    )
    with pytest.raises(CheckpointError, match=r"state\[1\]\['exp_avg'\] has 3 elements"):
        reshard(str(src), str(tmp_path / "o"), 2, progress=False)
    assert not (tmp_path / "o").exists()


def test_not_enough_disk_space(fixtures, tmp_path, monkeypatch):
    import ckptshard.osio.atomic as atomic

    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(atomic.os, "statvfs", lambda p: Full(real(p)))
    with pytest.raises(CheckpointError, match="GiB free"):
        consolidate(str(fixtures[2] / "fairseq"), str(tmp_path / "o.pt"), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_exception_mid_write_leaves_nothing(fixtures, tmp_path, monkeypatch):
    import ckptshard.write.copier as fill

    calls = {"n": 0}
    real = fill.Copier._copy

    def failing(self, *a):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk on fire")
        return real(self, *a)

    monkeypatch.setattr(fill.Copier, "_copy", failing)
    with pytest.raises(OSError):
        reshard(str(fixtures[3] / "metaseq"), str(tmp_path / "o"), 5, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_outputs_get_the_umasks_permissions_and_temporaries_never_reuse_a_name(tmp_path, monkeypatch):
    """Temporaries are created exclusively (as mkstemp does) but end with the usual permissions, not mkstemp's 0o600."""
    from ckptshard.osio.atomic import atomic_output, new_beside

    old = os.umask(0o027)
    try:
        with atomic_output(str(tmp_path / "f.pt"), is_dir=False) as tmp:
            assert os.path.basename(tmp).startswith(".f.pt.") and tmp.endswith(".ckptshard-tmp")
        with atomic_output(str(tmp_path / "d"), is_dir=True) as tmp:
            pass
        with atomic_output(str(tmp_path / "d"), is_dir=True, overwrite=True) as tmp:  # the replace path
            (tmp_path / tmp / "x").write_text("new")
    finally:
        os.umask(old)
    assert oct((tmp_path / "f.pt").stat().st_mode & 0o777) == oct(0o640)
    assert oct((tmp_path / "d").stat().st_mode & 0o777) == oct(0o750)
    assert (tmp_path / "d" / "x").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "f.pt"]  # no temporary, no old copy left

    taken = {new_beside(str(tmp_path), "n", ".t", is_dir=False) for _ in range(50)}
    assert len(taken) == 50
    real = os.urandom
    calls = []

    def collide_once(n):  # the first name drawn is taken: another is drawn, the taken one left alone
        calls.append(n)
        return b"\0" * n if len(calls) <= 2 else real(n)

    (tmp_path / f".m.{'00' * 6}.t").write_text("someone's")
    monkeypatch.setattr(os, "urandom", collide_once)
    made = new_beside(str(tmp_path), "m", ".t", is_dir=False)
    assert made != str(tmp_path / f".m.{'00' * 6}.t") and (tmp_path / f".m.{'00' * 6}.t").read_text() == "someone's"


SLOW_CONSOLIDATE = """
import os, signal, sys, time, ckptshard.write.copier as fill
# Ctrl-C as in a terminal, even where the test runs in the background (which ignores SIGINT, and so would the child).
signal.signal(signal.SIGINT, signal.default_int_handler)
real, reached = fill.Copier._copy, sys.argv[3]
def stuck(self, *a):  # copy once, say so, then hang: the signal always lands mid-write
    real(self, *a)
    open(reached, "w").close()
    time.sleep(120)
fill.Copier._copy = stuck
from ckptshard.cli import main
sys.argv = ["ckptshard", "consolidate", sys.argv[1], "-o", sys.argv[2], "-q"]
main()
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_write_leaves_nothing(fixtures, tmp_path, sig):
    out_dir, reached = tmp_path / "out", tmp_path / "copying"
    out_dir.mkdir()
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SLOW_CONSOLIDATE,
            str(fixtures[2] / "fairseq"),
            str(out_dir / "o.safetensors"),
            str(reached),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not reached.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert reached.exists() and any(out_dir.iterdir())  # a temporary is being written
        p.send_signal(sig)
        p.wait(timeout=60)
    finally:
        p.kill()  # never left hanging, whatever failed
        p.wait()
    assert p.returncode != 0
    assert list(out_dir.iterdir()) == [], list(out_dir.iterdir())


def test_manifest_and_verify(fixtures, tmp_path):
    reshard(str(fixtures[2] / "fairseq"), str(tmp_path / "r"), 3, progress=False)
    consolidate(str(fixtures[2] / "fairseq"), str(tmp_path / "f.safetensors"), progress=False)
    m = json.loads((tmp_path / "r" / "ckptshard-manifest.json").read_text())
    assert sorted(m["files"]) == [f"checkpoint_last-shard{r}.pt" for r in range(3)]
    assert m["source"]["world_size"] == 2 and m["source"]["fingerprint"]
    assert verify(str(tmp_path / "r")) == [] and verify(str(tmp_path / "f.safetensors")) == []
    # One flipped byte in a shard is found.
    p = tmp_path / "r" / "checkpoint_last-shard1.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    assert verify(str(tmp_path / "r")) == [
        "checkpoint_last-shard1.pt: checksum differs from the manifest (modified or corrupted)"
    ]
    res = subprocess.run(
        [sys.executable, "-m", "ckptshard.cli", "verify", str(tmp_path / "r")], capture_output=True, text=True
    )
    assert res.returncode == 2 and "checksum differs" in res.stderr


def test_manifest_digests_are_xxh3_and_older_blake3_and_sha256_manifests_still_verify(fixtures, tmp_path):
    import hashlib

    from blake3 import blake3
    from xxhash import xxh3_128

    out = tmp_path / "f.safetensors"
    consolidate(str(fixtures[2] / "fairseq"), str(out), progress=False)
    mpath = tmp_path / "f.safetensors.manifest.json"
    m = json.loads(mpath.read_text())
    data = out.read_bytes()
    assert m["files"] == {"f.safetensors": {"bytes": len(data), "xxh3_128": xxh3_128(data).hexdigest()}}
    # Manifests written before XXH3 (BLAKE3, and SHA-256 before that) verify, and still find a changed byte.
    for algorithm, digest in [("blake3", blake3), ("sha256", hashlib.sha256)]:
        out.write_bytes(data)
        m["files"]["f.safetensors"] = {"bytes": len(data), algorithm: digest(data).hexdigest()}
        mpath.write_text(json.dumps(m))
        assert verify(str(out)) == [], algorithm
        out.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        assert verify(str(out)) == ["f.safetensors: checksum differs from the manifest (modified or corrupted)"], (
            algorithm
        )
    m["files"]["f.safetensors"] = {"bytes": len(data), "md5": "0" * 32}
    mpath.write_text(json.dumps(m))
    assert verify(str(out)) == [
        "f.safetensors: the manifest gives no checksum ckptshard knows (xxh3_128, blake3, sha256)"
    ]


@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_no_fsync_writes_the_same_bytes_without_a_single_fsync(fixtures, tmp_path, monkeypatch, command):
    from click.testing import CliRunner

    import ckptshard.osio.writeback as writeback
    from ckptshard.cli import main
    from ckptshard.osio.durability import ENV

    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    real_wb = writeback._bind()
    if real_wb is not None:
        monkeypatch.setattr(writeback, "_bind", lambda: lambda *a: (calls.append("writeback"), real_wb(*a))[1])
    monkeypatch.setenv(ENV, "")  # durable by default
    src = str(fixtures[2] / "fairseq")
    args = {"consolidate": ["consolidate", src, "-o"], "reshard": ["reshard", src, "-n", "3", "-o"]}[command]
    durable = CliRunner().invoke(main, args + [str(tmp_path / "a.pt"), "-q"])
    assert durable.exit_code == 0, durable.output
    assert "fsync" in calls  # the default: fsynced before the rename
    assert real_wb is None or "writeback" in calls  # and written back early, behind the hash pass
    calls.clear()
    fast = CliRunner().invoke(main, args + [str(tmp_path / "b.pt"), "-q", "--no-fsync"])
    assert fast.exit_code == 0, fast.output
    assert calls == [] and os.environ.get(ENV) == ""  # a parameter of the call, not the process's environment
    library = getattr(ckptshard, command)
    library(src, tmp_path / "c.pt", *([3] if command == "reshard" else []), progress=False, fsync=False)
    assert calls == []

    def written(name):  # every output file but the manifests (they name the command), by relative path
        root = tmp_path / name
        files = [root] if root.is_file() else sorted(root.iterdir())
        return {p.name.replace(name, ""): p.read_bytes() for p in files if "manifest" not in p.name}

    assert written("a.pt") == written("b.pt") == written("c.pt") and written("a.pt")
    assert verify(str(tmp_path / "b.pt")) == []

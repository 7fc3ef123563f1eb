"""Checkpoints in object storage, against a real S3 server on 127.0.0.1 (moto's server mode, started and
stopped here), reached through s3fs as a user reaches S3: consolidate, reshard and convert s3->s3, s3->local
and local->s3 equal the local results byte for byte; verify of remote outputs; a killed run's leftovers;
throttling and 500s; credentials missing or wrong; stores whose filesystem is not installed.

Faults come from a small HTTP proxy in front of the server (``Proxy``): it answers some requests itself
(503 SlowDown, 500, 403) or holds them, as S3 does under load."""

import http.client
import http.server
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import ckptshard
from ckptshard.errors import CheckpointError, InputChanged, OutputExists

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

CLI = [sys.executable, "-m", "ckptshard.cli"]


@pytest.fixture(scope="module")
def endpoint():
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(endpoint, monkeypatch, tmp_path):
    """A fresh bucket; the AWS variables a user sets (AWS_ENDPOINT_URL for an S3-compatible store)."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        # botocore's credential chain would otherwise ask the EC2 metadata address (not loopback) and wait on it
        "AWS_EC2_METADATA_DISABLED": "true",
        "CKPTSHARD_STAGING": str(tmp_path / "staging"),
    }.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "staging").mkdir()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=endpoint)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)

    class S3:
        pass

    s = S3()
    s.fs, s.bucket, s.endpoint, s.staging = fs, bucket, endpoint, tmp_path / "staging"
    return s


def _upload(s3, local, key):
    s3.fs.put(str(local), f"{s3.bucket}/{key}", recursive=True)
    return f"s3://{s3.bucket}/{key}"


def _download(s3, url, local):
    s3.fs.invalidate_cache()
    path = url[len("s3://") :]
    if s3.fs.isdir(path):
        s3.fs.get(path, str(local), recursive=True)
    else:
        s3.fs.get(path, str(local))
    return local


def _tree(root):
    """Every file under ``root`` (or ``root`` itself), by relative name: its bytes; manifests without their
    source block (local and remote outputs name their inputs differently)."""
    root = pathlib.Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out = {}
    for p in files:
        data = p.read_bytes()
        if p.name.endswith("manifest.json"):
            m = json.loads(data)
            m.pop("source")
            data = json.dumps(m, sort_keys=True).encode()
        out[p.name if p == root else str(p.relative_to(root))] = data
    return out


@pytest.fixture
def fairseq2(fixtures):
    return fixtures[2] / "fairseq"


COMMANDS = {
    "consolidate": lambda src, out: ckptshard.consolidate(src, out + "/full.safetensors", progress=False),
    "consolidate-index": lambda src, out: ckptshard.consolidate(src, out + "/hf", max_shard_size=2000, progress=False),
    "reshard": lambda src, out: ckptshard.reshard(src, out + "/r3", 3, progress=False),
    "convert": lambda src, out: ckptshard.convert(src, out + "/ckpt.dcp", "dcp", progress=False),
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_way_to_and_from_s3_writes_the_local_bytes(s3, fairseq2, name, tmp_path):
    run = COMMANDS[name]
    (tmp_path / "local").mkdir()
    run(str(fairseq2), str(tmp_path / "local"))
    want = _tree(tmp_path / "local")
    src = _upload(s3, fairseq2, "run/ckpt")
    ways = {
        "s3->s3": (src, f"s3://{s3.bucket}/out-s3"),
        "s3->local": (src, str(tmp_path / "s3-local")),
        "local->s3": (str(fairseq2), f"s3://{s3.bucket}/out-local"),
    }
    for way, (a, b) in ways.items():
        if not b.startswith("s3://"):
            os.makedirs(b)
        res = run(a, b)
        got = _tree(_download(s3, b, tmp_path / f"got-{way[:2]}-{way[-2:]}") if b.startswith("s3://") else b)
        assert got == want, way
        if b.startswith("s3://"):
            written = res.outputs if hasattr(res, "outputs") else [res.folder]
            assert all(o.startswith(b + "/") for o in written), (way, written)
            assert ckptshard.verify(written[0]) == [], way
            manifest = next(k for k in s3.fs.find(b[len("s3://") :]) if k.endswith("manifest.json"))
            assert src in json.dumps(json.loads(s3.fs.cat(manifest))["source"]) or way == "local->s3"
    assert os.listdir(s3.staging) == []  # staged copies removed


def test_verify_of_a_remote_output_finds_a_changed_byte(s3, fairseq2):
    src = _upload(s3, fairseq2, "ckpt")
    out = f"s3://{s3.bucket}/r2"
    ckptshard.reshard(src, out, 2, progress=False)
    assert ckptshard.verify(out) == []
    key = f"{s3.bucket}/r2/checkpoint_last-shard1.pt"
    data = bytearray(s3.fs.cat(key))
    data[len(data) // 2] ^= 1
    s3.fs.pipe(key, bytes(data))
    problems = ckptshard.verify(out)
    assert problems == ["checkpoint_last-shard1.pt: checksum differs from the manifest (modified or corrupted)"]
    cli = subprocess.run([*CLI, "verify", out], capture_output=True, text=True)
    assert cli.returncode == 2 and "checkpoint_last-shard1.pt" in cli.stderr + cli.stdout


def test_an_existing_output_is_kept_or_replaced_only_if_ckptshard_wrote_it(s3, fairseq2):
    src = _upload(s3, fairseq2, "ckpt")
    out = f"s3://{s3.bucket}/full.safetensors"
    ckptshard.consolidate(src, out, progress=False)
    with pytest.raises(OutputExists):
        ckptshard.consolidate(src, out, progress=False)
    ckptshard.consolidate(src, out, progress=False, overwrite=True, dtype="bf16")
    assert ckptshard.verify(out) == []
    s3.fs.pipe(f"{s3.bucket}/users.safetensors", b"mine")
    with pytest.raises(CheckpointError, match="not written by ckptshard"):
        ckptshard.consolidate(src, f"s3://{s3.bucket}/users.safetensors", progress=False, overwrite=True)
    assert s3.fs.cat(f"{s3.bucket}/users.safetensors") == b"mine"
    with pytest.raises(CheckpointError, match="inside the input"):
        ckptshard.reshard(src, src + "/r2", 2, progress=False)


def test_an_input_changed_while_read_is_refused_and_nothing_is_published(s3, fairseq2, monkeypatch):
    from ckptshard.execute import staging

    src = _upload(s3, fairseq2, "ckpt")
    real = staging.Staging.finish

    def rewritten_then_finish(self):  # the training job saves again while the command runs: same size
        key = f"{s3.bucket}/ckpt/checkpoint_last-shard0.pt"
        data = bytearray(s3.fs.cat(key))
        data[-100] ^= 1
        s3.fs.pipe(key, bytes(data))
        return real(self)

    monkeypatch.setattr(staging.Staging, "finish", rewritten_then_finish)
    with pytest.raises(InputChanged, match="shard0.pt: changed while it was read"):
        ckptshard.reshard(src, f"s3://{s3.bucket}/r2", 2, progress=False)
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(f"{s3.bucket}/r2")


class Proxy:
    """An HTTP proxy in front of the S3 server: ``fault(method, path, headers)`` returns None (forward), a
    status code to answer with an S3 error body, or a number of seconds to hold the request first."""

    def __init__(self, upstream, fault):
        host, port = upstream[len("http://") :].split(":")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                said = fault(self.command, self.path, self.headers)
                if isinstance(said, float):
                    time.sleep(said)
                elif said is not None:
                    codes = {503: "SlowDown", 500: "InternalError", 403: "InvalidAccessKeyId"}
                    err = f"<Error><Code>{codes[said]}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(said)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(err)))
                    self.end_headers()
                    self.wfile.write(err)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()
                proxy.count += 1

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.count = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_throttling_and_server_errors_are_retried(s3, fairseq2, tmp_path):
    src = _upload(s3, fairseq2, "ckpt")
    seen = {"n": 0}

    def flaky(method, path, headers):  # every third request fails, alternately throttled and broken
        seen["n"] += 1
        return (503 if seen["n"] % 2 else 500) if seen["n"] % 3 == 0 else None

    proxy = Proxy(s3.endpoint, flaky)
    try:
        opts = {"endpoint_url": proxy.url}
        out = f"s3://{s3.bucket}/r3"
        ckptshard.reshard(src, out, 3, progress=False, storage_options=opts)
        ckptshard.reshard(str(fairseq2), str(tmp_path / "local"), 3, progress=False)
        assert _tree(_download(s3, out, tmp_path / "got")) == _tree(tmp_path / "local")
        assert seen["n"] > 30  # the faults were met (a third of them)
    finally:
        proxy.close()


def test_missing_or_wrong_credentials_and_a_missing_bucket_are_one_line(s3, fairseq2, monkeypatch, tmp_path):
    src = _upload(s3, fairseq2, "ckpt")
    proxy = Proxy(s3.endpoint, lambda m, p, h: 403 if "Credential=wrong/" in h.get("Authorization", "") else None)
    try:
        cases = {
            "wrong": (["--storage-option", f"endpoint_url={proxy.url}", "--storage-option", "key=wrong",
                       "--storage-option", "secret=wrong"], {}),
            "missing": ([], {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}),
        }  # fmt: skip
        for why, (opts, env_change) in cases.items():
            env = dict(
                os.environ, AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none")
            )
            for k in env_change:
                env.pop(k)
            out = tmp_path / f"{why}.pt"
            cli = subprocess.run(
                [*CLI, "consolidate", src, "-o", str(out), *opts], capture_output=True, text=True, env=env, timeout=120
            )
            lines = cli.stderr.strip().splitlines()
            assert cli.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"Error: {src}"), (why, cli.stderr)
            assert not out.exists()
    finally:
        proxy.close()
    nob = subprocess.run([*CLI, "consolidate", "s3://no-such-bucket-here/x", "-o", str(tmp_path / "n.pt")],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert nob.returncode == 2 and len(nob.stderr.strip().splitlines()) == 1, nob.stderr


def test_a_run_killed_mid_upload_leaves_no_manifest_and_the_next_run_cleans_up(s3, fairseq2, tmp_path):
    src = _upload(s3, fairseq2, "ckpt")
    out = f"s3://{s3.bucket}/r4"
    hold = lambda m, p, h: 30.0 if m == "PUT" and "/r4/checkpoint_last-shard2" in p else None  # noqa: E731
    proxy = Proxy(s3.endpoint, hold)
    try:
        proc = subprocess.Popen([*CLI, "reshard", src, "-n", "4", "-o", out, "-q", "--storage-option",
                                 f"endpoint_url={proxy.url}"], stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.time() + 60
        while time.time() < deadline:
            s3.fs.invalidate_cache()
            if s3.fs.exists(f"{s3.bucket}/r4/checkpoint_last-shard0.pt"):
                break
            time.sleep(0.2)
        else:
            proc.kill()
            pytest.fail("the upload never started")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proxy.close()
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(f"{s3.bucket}/r4/ckptshard-manifest.json")  # nothing vouches for a partial output
    assert s3.fs.exists(f"{s3.bucket}/r4.ckptshard-writing")
    bucket = s3.fs.call_s3("list_multipart_uploads", Bucket=s3.bucket)  # an upload a kill -9 left open
    s3.fs.call_s3("create_multipart_upload", Bucket=s3.bucket, Key="r4/checkpoint_last-shard3.pt")
    assert len(s3.fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", [])) == 1 + len(
        bucket.get("Uploads", [])
    )
    ckptshard.reshard(src, out, 4, progress=False)  # no --overwrite needed: the leftovers were ours
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(f"{s3.bucket}/r4.ckptshard-writing")
    assert s3.fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", []) == []
    assert ckptshard.verify(out) == []


def test_any_fsspec_url_and_stores_whose_filesystem_is_missing(fairseq2, tmp_path):
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.put(str(fairseq2), "/ckpt", recursive=True)
    ckptshard.consolidate("memory://ckpt", "memory://out/full.pt", progress=False)
    ckptshard.consolidate(str(fairseq2), str(tmp_path / "full.pt"), progress=False)
    assert mem.cat("/out/full.pt") == (tmp_path / "full.pt").read_bytes()
    assert ckptshard.verify("memory://out/full.pt") == []
    ckptshard.consolidate(f"file://{fairseq2}", f"file://{tmp_path}/f.safetensors", progress=False)  # local
    for url, extra in (("gs://bucket/ckpt", "gcs"), ("az://container/ckpt", "azure")):
        try:
            fsspec.get_filesystem_class(url.split(":")[0])
            continue  # installed here: its emulator is not
        except ImportError:
            pass
        cli = subprocess.run([*CLI, "consolidate", url, "-o", str(tmp_path / "x.pt")], capture_output=True, text=True)
        assert cli.returncode == 2 and f"pip install 'ckptshard[{extra}]'" in cli.stderr, cli.stderr


PEAK_RSS = (
    "import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL); "
    "_, st, ru = os.wait4(p.pid, 0); "
    "print(os.waitstatus_to_exitcode(st), ru.ru_maxrss)"
)


def test_memory_does_not_grow_with_the_objects_size(s3, tmp_path):
    """What a transfer holds in memory is bounded: a checkpoint twice the size (objects above the bound at both
    sizes) peaks at the same RSS. With s3fs's defaults (10 ranges or parts of 50 MiB per object, each held
    whole) it was 342 -> 653 MiB."""
    from ckptshard.testing.synthetic import width_for, write_synthetic

    peaks = {}
    for mib in (128, 256):
        local = tmp_path / f"src{mib}"
        write_synthetic(str(local), 2, 2, width_for(mib << 20, 2))
        src = _upload(s3, local, f"m{mib}")
        cmd = [*CLI, "consolidate", src, "-o", f"s3://{s3.bucket}/o{mib}/full.safetensors", "-q", "--no-fsync"]
        rc, rss_kib = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, *cmd], capture_output=True, text=True, check=True, timeout=300
        ).stdout.split()
        assert rc == "0"
        peaks[mib] = int(rss_kib) >> 10
    assert peaks[256] - peaks[128] < 48, peaks

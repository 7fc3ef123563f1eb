"""Small torch.save outputs of many small runs, put together in memory: the same bytes as the file-to-file path."""

import os
import zipfile

import pytest
from conftest import src_of
from test_copier import CASES, F32, _ref, source  # noqa: F401  (source: a fixture)

import ckptshard.write.torch_file as writers
from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard
from ckptshard.tensors import Fill, Source
from ckptshard.write.copier import Copier


@pytest.mark.parametrize("src_off,out_off,numel", CASES)
def test_fill_memory_reads_what_fill_writes(tmp_path, source, src_off, out_off, numel):  # noqa: F811
    path, data = source
    f = Fill((numel,), F32, (Source(_ref(path, src_off, numel), 0, 0, numel),))
    buf = bytearray(out_off + 4 * numel)
    with Copier() as c:
        c.fill_memory(memoryview(buf)[out_off:], f)
    assert bytes(buf[out_off:]) == data[src_off : src_off + 4 * numel]


def test_fill_memory_refuses_a_short_source(source):  # noqa: F811
    path, data = source
    numel = len(data) // 4 + 10
    f = Fill((numel,), F32, (Source(_ref(path, 0, numel), 0, 0, numel),))
    with Copier() as c, pytest.raises(CheckpointError, match="truncated"):
        c.fill_memory(memoryview(bytearray(4 * numel)), f)


def _outputs(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_in_memory_outputs_equal_the_file_path_byte_for_byte(fixtures, tmp_path, monkeypatch):
    """Fixture files hold few runs: lowered, the threshold sends them in memory; manifests included."""
    used = []
    real = writers._write_torch_in_memory

    def spy(path, *a):
        used.append(path)
        return real(path, *a)

    monkeypatch.setattr(writers, "_write_torch_in_memory", spy)
    src = src_of(fixtures[3], "metaseq")
    reshard(src, str(tmp_path / "file"), 5, progress=False)
    consolidate(src, str(tmp_path / "file.pt"), optimizer=True, progress=False)
    assert used == []  # the default threshold keeps these few runs on the file path
    monkeypatch.setattr(writers, "IN_MEMORY_MIN_RUNS", 1)
    reshard(src, str(tmp_path / "mem"), 5, progress=False)
    consolidate(src, str(tmp_path / "mem.pt"), optimizer=True, progress=False)
    assert len(used) == 5 + 2  # every shard, the weights and the optimizer file
    assert _outputs(tmp_path / "mem") == _outputs(tmp_path / "file")
    assert (tmp_path / "mem.pt").read_bytes() == (tmp_path / "file.pt").read_bytes()
    assert (tmp_path / "mem.optim.pt").read_bytes() == (tmp_path / "file.optim.pt").read_bytes()
    manifest = (tmp_path / "mem.pt.manifest.json").read_text().replace("mem.", "file.")
    assert manifest == (tmp_path / "file.pt.manifest.json").read_text()
    for p in (tmp_path / "mem").iterdir():
        if p.suffix == ".pt":
            with zipfile.ZipFile(p) as z:
                assert z.testzip() is None


def test_only_small_files_of_many_small_plain_runs_go_in_memory(tmp_path, source):  # noqa: F811
    path, _ = source
    skeleton = writers.Skeleton({}, [], [(0, bytearray(100))])

    def fills(runs, numel):
        return [Fill((numel,), F32, (Source(_ref(path, 0, numel), 0, 0, numel),)) for _ in range(runs)]

    assert writers._in_memory(skeleton, fills(300, 100))  # 300 runs of 400 bytes
    assert not writers._in_memory(skeleton, fills(100, 100))  # too few runs to matter
    assert not writers._in_memory(skeleton, fills(300, 100_000))  # runs of 400 KB: kernel copies
    big = writers.Skeleton({}, [], [(writers.IN_MEMORY_MAX, bytearray(1))])
    assert not writers._in_memory(big, fills(300, 100))  # the file is too large to hold
    strided = Fill((100,), F32, (Source(writers.TensorRef(path, 0, F32, (100,), (2,)), 0, 0, 100),))
    assert not writers._in_memory(skeleton, fills(299, 100) + [strided])  # a gather, not a copy
    assert os.path.exists(path)

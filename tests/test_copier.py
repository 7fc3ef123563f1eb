"""The Copier's three ways to move bytes give the same file: copy_file_range, pwrite from a mapping, reads."""

import os
import random

import pytest

import ckptshard.write.copier as fill
from ckptshard.dtypes import StoredDType
from ckptshard.errors import CheckpointError
from ckptshard.tensors import Fill, Source, TensorRef
from ckptshard.write.copier import Copier

PAGE = 4096
F32 = StoredDType("float32")


@pytest.fixture
def source(tmp_path):
    data = random.Random(0).randbytes(64 * PAGE)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    return str(path), data


def _ref(path, offset, numel):
    return TensorRef(path, offset, F32, (numel,), (1,))


# (source byte offset, output byte offset, float32 elements): equal and unequal offsets modulo a page,
# lengths within one window and across several (the window is cut to 3 pages + 4 bytes below).
CASES = [(0, 0, 9000), (PAGE, 2 * PAGE, 7000), (12, 0, 9000), (4, 100, 20000), (PAGE + 8, 64, 3)]


@pytest.fixture(params=["as chosen", "no mapping", "no mapping, no copy_file_range"])
def way(request, monkeypatch):
    monkeypatch.setattr(fill, "MAPPED_WINDOW", 3 * PAGE + 4)
    monkeypatch.setattr(fill, "MAP_MIN", 64)  # the 12-byte case stays below it: read, not mapped
    calls = {"mapped": 0}
    real_mapped = Copier._copy_mapped

    def spy(self, *a):
        calls["mapped"] += 1
        return real_mapped(self, *a)

    monkeypatch.setattr(Copier, "_copy_mapped", spy)
    if request.param != "as chosen":

        def refuse(*a, **k):
            raise OSError("this file system cannot map")

        monkeypatch.setattr(fill.mmap, "mmap", refuse)
    return request.param, calls


@pytest.mark.parametrize("src_off,out_off,numel", CASES)
def test_every_way_writes_the_same_bytes(tmp_path, source, way, src_off, out_off, numel):
    path, data = source
    name, calls = way
    out = tmp_path / "out.bin"
    n = numel * 4
    fd = os.open(out, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, out_off + n + 16)
        with Copier(use_copy_file_range=not name.endswith("copy_file_range")) as c:
            c.fill(fd, out_off, Fill((numel,), F32, (Source(_ref(path, src_off, numel), 0, 0, numel),)))
    finally:
        os.close(fd)
    got = out.read_bytes()
    assert got[out_off : out_off + n] == data[src_off : src_off + n]
    assert got[:out_off] == bytes(out_off) and got[out_off + n :] == bytes(16)
    # Offsets unequal modulo a page are the ones that go through a mapping (or try to), unless small.
    assert calls["mapped"] == (1 if (src_off - out_off) % PAGE and n >= fill.MAP_MIN else 0)


def test_small_runs_are_read_and_written(tmp_path, source, monkeypatch):
    # A run of a few KiB: one pread and one pwrite, neither a mapping nor copy_file_range, at any offset.
    path, data = source
    used = []
    monkeypatch.setattr(fill.mmap, "mmap", lambda *a, **k: used.append("mmap"))
    monkeypatch.setattr(fill.os, "copy_file_range", lambda *a, **k: used.append("copy_file_range"), raising=False)
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT)
    try:
        with Copier() as c:
            for src_off, out_off in ((0, 0), (12, 4096 + 100), (PAGE + 8, 64)):
                c.fill(fd, out_off, Fill((1000,), F32, (Source(_ref(path, src_off, 1000), 0, 0, 1000),)))
                assert out.read_bytes()[out_off : out_off + 4000] == data[src_off : src_off + 4000]
    finally:
        os.close(fd)
    assert used == []


def test_mapped_windows_stay_small(tmp_path, source, monkeypatch):
    path, data = source
    monkeypatch.setattr(fill, "MAPPED_WINDOW", 2 * PAGE)
    monkeypatch.setattr(fill, "MAP_MIN", 64)
    sizes = []
    real = fill.mmap.mmap

    def record(fd, length, *a, **k):
        sizes.append(length)
        return real(fd, length, *a, **k)

    monkeypatch.setattr(fill.mmap, "mmap", record)
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT)
    try:
        with Copier() as c:
            c.fill(fd, 8, Fill((12000,), F32, (Source(_ref(path, 100, 12000), 0, 0, 12000),)))
    finally:
        os.close(fd)
    assert out.read_bytes()[8:] == data[100 : 100 + 48000]
    assert len(sizes) > 5 and max(sizes) <= 2 * PAGE


@pytest.mark.parametrize("src_off,out_off", [(0, 0), (12, 0)])
def test_a_source_shorter_than_its_index_says_is_an_error(tmp_path, source, src_off, out_off):
    path, data = source
    numel = (len(data) - src_off) // 4 + 100  # 400 bytes past the end
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    try:
        with Copier() as c, pytest.raises(CheckpointError, match="truncated"):
            c.fill(fd, out_off, Fill((numel,), F32, (Source(_ref(path, src_off, numel), 0, 0, numel),)))
    finally:
        os.close(fd)


def test_a_source_that_cannot_be_mapped_is_not_tried_again(tmp_path, source, monkeypatch):
    path, data = source
    tries = []

    def refuse(*a, **k):
        tries.append(1)
        raise OSError("this file system cannot map")

    monkeypatch.setattr(fill.mmap, "mmap", refuse)
    monkeypatch.setattr(fill, "MAP_MIN", 64)
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT)
    try:
        with Copier() as c:
            for at in (4, 4 + 4000):  # two runs at offsets unequal modulo a page
                c.fill(fd, at, Fill((1000,), F32, (Source(_ref(path, 12 + at, 1000), 0, 0, 1000),)))
    finally:
        os.close(fd)
    assert out.read_bytes()[4 : 4 + 8000] == data[16 : 16 + 8000]
    assert len(tries) == 1


def test_outputs_are_preallocated_or_extended(tmp_path, monkeypatch):
    # Outputs get their final size before the copy: blocks allocated where the filesystem can
    # (fallocate), else only extended, never written with zeros (glibc's posix_fallocate emulation).
    import ckptshard.osio.atomic as atomic
    import ckptshard.osio.libc as libc

    size = 3 * (1 << 20) + 5
    fd = atomic.open_empty(str(tmp_path / "a"))
    atomic.preallocate(fd, size)
    st = os.fstat(fd)
    os.close(fd)
    assert st.st_size == size
    if libc.bind("fallocate", ("c_int", "c_int", "c_int64", "c_int64")) is not None:
        assert st.st_blocks * 512 >= size  # allocated, not a sparse file (Linux, ext4/xfs/tmpfs)
    monkeypatch.setattr(atomic, "bind", lambda *a: None)  # no fallocate: extended, sparse
    fd = atomic.open_empty(str(tmp_path / "b"))
    atomic.preallocate(fd, size)
    st = os.fstat(fd)
    os.close(fd)
    assert st.st_size == size and st.st_blocks * 512 < size
    assert (tmp_path / "b").read_bytes() == bytes(size)

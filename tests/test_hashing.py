"""Hashing outputs while they are written gives the digest of the finished file."""

import os
import time

import pytest
from xxhash import xxh3_128

from ckptshard.osio.hashing import MAX_AHEAD, Hashes


@pytest.fixture(params=["mapped", "read", "as chosen"])
def span_source(request, monkeypatch):
    """Run a test with the hash pass mapping every span, with mapping refused (reads instead), and
    as it chooses (spans under MAP_MIN read, larger ones mapped)."""
    import ckptshard.osio.hashing as hashing

    if request.param == "mapped":
        monkeypatch.setattr(hashing, "MAP_MIN", 1)
    if request.param == "read":

        def refuse(*args, **kwargs):
            if args and args[0] != -1:  # file mappings only: the fallback's own buffer is anonymous
                raise OSError(19, "mapping refused")
            return real(*args, **kwargs)

        real = hashing.mmap.mmap
        monkeypatch.setattr(hashing.mmap, "mmap", refuse)
    return request.param


def test_trailing_hash_equals_xxh3_of_the_finished_file(tmp_path, span_source):
    path = tmp_path / "f"
    data = os.urandom(3 * (8 << 20) + 12345)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    with Hashes() as hashes:
        advance = hashes.watch(str(path))
        os.ftruncate(fd, len(data))
        for start in range(0, len(data), 5_000_000):  # written front to back, announced as it goes
            advance(start)
            os.pwrite(fd, data[start : start + 5_000_000], start)
        os.close(fd)
        assert hashes.digest(str(path)) == xxh3_128(data).hexdigest()


def test_many_outputs_one_after_another(tmp_path):
    want = {}
    with Hashes() as hashes:
        for i in range(3 * MAX_AHEAD):  # more files than the hash may lag behind
            p = tmp_path / f"f{i}"
            data = os.urandom(100_000 + i)
            p.write_bytes(b"")
            advance = hashes.watch(str(p))
            p.write_bytes(data)
            advance(len(data) // 2)
            hashes.complete(str(p))
            want[p] = xxh3_128(data).hexdigest()
        assert {p: hashes.digest(str(p)) for p in want} == want


def test_hashes_follow_a_rename_and_report_unwatched_files_as_none(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 1000)
    with Hashes() as hashes:
        hashes.watch(str(a))
        os.rename(a, b)
        hashes.moved(str(a), str(b))
        assert hashes.digest(str(b)) == xxh3_128(b"x" * 1000).hexdigest()
        assert hashes.digest(str(a)) is None


def test_a_file_shorter_than_announced_is_an_error(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"abc")
    with Hashes() as hashes:
        hashes.watch(str(path))(10)
        with pytest.raises(OSError, match="shorter"):
            hashes.digest(str(path))


def test_every_hashed_span_is_queued_for_writeback_once(tmp_path, monkeypatch):
    import ckptshard.osio.hashing as hashing

    spans = []
    monkeypatch.setattr(hashing, "start_writeback", lambda fd, off, n: spans.append((off, n)))
    path = tmp_path / "f"
    data = os.urandom(2 * hashing.BLOCK + 4321)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, len(data))
    with Hashes() as hashes:
        advance = hashes.watch(str(path))
        for start in range(0, len(data), 3_000_001):  # marks off page boundaries
            os.pwrite(fd, data[start : start + 3_000_001], start)
            advance(min(len(data), start + 3_000_001))
        os.close(fd)
        assert hashes.digest(str(path)) == xxh3_128(data).hexdigest()
    spans.sort()
    assert spans[0][0] == 0 and sum(n for _, n in spans) == len(data)
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))  # contiguous, no overlap


def test_start_writeback_takes_a_file_and_declines_a_pipe(tmp_path):
    import sys

    from ckptshard.osio.writeback import start_writeback

    path = tmp_path / "f"
    path.write_bytes(b"x" * 100_000)
    fd = os.open(path, os.O_RDONLY)  # the hash thread's own read-only descriptor
    try:
        assert start_writeback(fd, 0, 100_000) is sys.platform.startswith("linux")
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert start_writeback(r, 0, 10) is False  # ESPIPE: left to the final fsync, no exception
    finally:
        os.close(r)
        os.close(w)


def test_placeholders_are_free_and_fall_back_to_fake_tensors_when_memory_is_refused():
    import resource

    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    from ckptshard.write.torch_file import placeholder

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    small = placeholder((1 << 28,), torch.float32)  # 1 GiB of address space, never touched
    assert not isinstance(small, FakeTensor) and small.numel() == 1 << 28
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB
    huge = placeholder((1 << 52,), torch.float32)  # no system grants 16 PiB
    assert isinstance(huge, FakeTensor) and huge.shape == (1 << 52,)


def test_crcs_are_written_by_the_hash_pass_before_it_hashes_them(tmp_path, span_source):
    """Records at odd offsets, across block edges; each CRC goes after its record (and once more at the end)."""
    import struct
    import zlib

    from ckptshard.osio.hashing import BLOCK

    path = tmp_path / "f"
    sizes = [1000, BLOCK + 3, 0, 2 * BLOCK - 7, 5]
    layout, at = [], 0
    for size in sizes:  # [record][4-byte CRC slot]
        layout.append((at, size, at + size))
        at += size + 4
    central = at  # one more slot per record at the end, like a zip central directory
    total = central + 4 * len(sizes)
    data = bytearray(os.urandom(total))
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, total)
    with Hashes() as hashes:
        advance = hashes.watch(str(path))
        for i, (start, size, slot) in enumerate(layout):
            if size:
                hashes.patch_crc(str(path), start, size, (slot, central + 4 * i))
        for start, size, _slot in layout:
            advance(start)
            os.pwrite(fd, bytes(data[start : start + size]), start)  # the slots stay zero until the hash pass
        hashes.settled(str(path))
        final = path.read_bytes()
        digest = hashes.digest(str(path))
    os.close(fd)
    for i, (start, size, slot) in enumerate(layout):
        want = struct.pack("<I", zlib.crc32(data[start : start + size])) if size else b"\0" * 4
        assert final[slot : slot + 4] == want and final[central + 4 * i : central + 4 * i + 4] == want
    assert digest == xxh3_128(final).hexdigest()  # the hash saw the CRCs, not the zeros before them


def test_crc_records_out_of_order_or_patching_backwards_are_refused(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 100)
    with Hashes() as hashes:
        advance = hashes.watch(str(path))
        with pytest.raises(AssertionError, match="before its end"):
            hashes.patch_crc(str(path), 10, 20, (5,))
        hashes.patch_crc(str(path), 40, 10, (60,))
        with pytest.raises(AssertionError, match="out of order"):
            hashes.patch_crc(str(path), 20, 10, (95,))
        advance(100)
        hashes.settled(str(path))


def test_small_spans_are_read_not_mapped(tmp_path, monkeypatch):
    # Thousands of small tensors (optimizer state of many FSDP instances at a large world size): a
    # mapping per span cost more than the read it saves.
    import ckptshard.osio.hashing as hashing

    maps = []
    real = hashing.mmap.mmap
    monkeypatch.setattr(hashing.mmap, "mmap", lambda *a, **k: (maps.append(a[0]), real(*a, **k))[1])
    path = tmp_path / "f"
    data = os.urandom(3000 * 700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    with Hashes() as hashes:
        advance = hashes.watch(str(path))
        watched = hashes._by_path[os.path.abspath(path)]
        os.ftruncate(fd, len(data))
        for start in range(0, len(data), 700):
            os.pwrite(fd, data[start : start + 700], start)
            advance(start + 700)
            # One span at a time: a hash thread that fell 256 KiB behind (a loaded CI machine) would
            # rightly hash the joined spans through a mapping, which is not what this test is about.
            deadline = time.monotonic() + 30
            while watched.done < start + 700:
                assert time.monotonic() < deadline, "the hash thread stopped"
                time.sleep(0.0001)
        os.close(fd)
        hashes.complete(str(path))
        assert hashes.digest(str(path)) == xxh3_128(data).hexdigest()
    assert [fd for fd in maps if fd != -1] == []  # the one anonymous buffer only

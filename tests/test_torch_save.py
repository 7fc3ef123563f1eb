"""The torch-free torch.save writer: what torch.load reads back equals the torch-written file."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import src_of

from ckptshard.dtypes import Size, StoredDType
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.reshard import reshard
from ckptshard.formats.torch_pickle import Unsupported
from ckptshard.formats.torch_save import ALIGN
from ckptshard.osio.zip_crc import deferred_crcs
from ckptshard.tensors import Fill
from ckptshard.tree import leaves
from ckptshard.write.torch_file import write_skeleton


def assert_same_loaded(a_path, b_path):
    a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
    la, lb = list(leaves(a)), list(leaves(b))
    assert [p for p, _ in la] == [p for p, _ in lb], a_path
    for (path, x), (_, y) in zip(la, lb):
        assert type(x) is type(y), (a_path, path, type(x), type(y))
        if torch.is_tensor(y):
            assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), (a_path, path)
            assert torch.equal(x, y), (a_path, path)
        else:
            assert x == y, (a_path, path)
    with zipfile.ZipFile(a_path) as z:
        assert z.testzip() is None
        assert {n.split("/", 1)[1] for n in z.namelist()} == {
            n.split("/", 1)[1] for n in zipfile.ZipFile(b_path).namelist()
        }
    torch.load(a_path, weights_only=True, mmap=True)  # data aligned as torch's mmap loading needs


@pytest.mark.parametrize("which", ["fairseq", "metaseq", "vissl", "half", "frozen"])
def test_reshard_without_torch_equals_with_torch(fixtures, half_fixture, frozen_fixture, tmp_path, monkeypatch, which):
    src = {"half": src_of(half_fixture, "metaseq"), "frozen": src_of(frozen_fixture, "fairseq")}.get(which) or src_of(
        fixtures[3], which
    )
    reshard(src, str(tmp_path / "fast"), 2, progress=False)
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    reshard(src, str(tmp_path / "torch"), 2, progress=False)
    names = sorted(n for n in os.listdir(tmp_path / "torch") if n != "ckptshard-manifest.json")
    assert names == sorted(n for n in os.listdir(tmp_path / "fast") if n != "ckptshard-manifest.json")
    for n in names:
        assert_same_loaded(tmp_path / "fast" / n, tmp_path / "torch" / n)


def test_consolidate_container_and_optimizer_without_torch(fixtures, tmp_path, monkeypatch):
    src = src_of(fixtures[2], "fairseq")
    consolidate(src, str(tmp_path / "fast.pt"), container=True, progress=False)
    consolidate(src, str(tmp_path / "fast2.pt"), optimizer=True, progress=False)
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    consolidate(src, str(tmp_path / "torch.pt"), container=True, progress=False)
    consolidate(src, str(tmp_path / "torch2.pt"), optimizer=True, progress=False)
    assert_same_loaded(tmp_path / "fast.pt", tmp_path / "torch.pt")
    assert_same_loaded(tmp_path / "fast2.pt", tmp_path / "torch2.pt")
    assert_same_loaded(tmp_path / "fast2.optim.pt", tmp_path / "torch2.optim.pt")


def test_reshard_cli_imports_no_torch(fixtures, tmp_path):
    code = (
        "import sys; from ckptshard.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "reshard",
            src_of(fixtures[3], "vissl"),
            "-n",
            "2",
            "-o",
            str(tmp_path / "out"),
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "NO-TORCH"


def _carried_values(size_type):
    """Non-tensor values a checkpoint carries, with shapes of ``size_type`` (ckptshard's Size or torch's)."""
    return {
        "shapes": [size_type((2, 3))],
        "n": -7,
        "big": 2**40,
        "f": 0.1,
        "s": "é",
        "b": b"\x00\xff",
        "none": None,
        "t": (1, True),
    }


def test_layout_matches_torch_save(tmp_path):
    """Records, alignment and the pickle's values, against torch.save of the same tree."""
    f32, i64 = StoredDType("float32"), StoredDType("int64")
    a, b = Fill((2, 3), f32, ()), Fill((0,), i64, ())
    tree = {
        "w": a,
        "tied": a,
        "empty": b,
        "meta": _carried_values(Size),
    }
    skeleton = write_skeleton(str(tmp_path / "ours.pt"), tree)
    offsets = skeleton.offsets
    assert all(off % ALIGN == 0 for off in offsets.values()) and len(offsets) == 2
    # Where the writer says each CRC goes is where a zip reader finds it (non-empty tensors only).
    assert skeleton.crcs == deferred_crcs(str(tmp_path / "ours.pt"), [offsets[id(a)]])
    torch.save(
        {
            "w": torch.zeros(2, 3),
            "empty": torch.zeros(0, dtype=torch.int64),
            "meta": _carried_values(torch.Size),
        },
        tmp_path / "theirs.pt",
    )
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=True)
    assert ours["tied"] is ours["w"]  # a tie stays one tensor
    assert torch.equal(ours["w"], theirs["w"]) and ours["empty"].dtype == torch.int64
    assert ours["meta"] == theirs["meta"] and type(ours["meta"]["shapes"][0]) is torch.Size


@pytest.mark.parametrize("bad", [object(), Fill((1,), StoredDType("complex64"), ())])
def test_refuses_what_it_cannot_write(tmp_path, bad):
    with pytest.raises(Unsupported):
        write_skeleton(str(tmp_path / "x.pt"), {"x": bad})


def test_torch_dtypes_lay_out_as_their_stored_names(tmp_path):
    """Trees read through torch (torch up to 2.4 has no skip_data to lay files out) are written without it."""
    write_skeleton(str(tmp_path / "a.pt"), {"x": Fill((2, 3), torch.bfloat16, ())})
    write_skeleton(str(tmp_path / "b.pt"), {"x": Fill((2, 3), StoredDType("bfloat16"), ())})
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    assert torch.load(tmp_path / "a.pt", weights_only=True)["x"].dtype == torch.bfloat16


def test_files_past_4_gib_are_zip64_and_load_in_torch(tmp_path):
    """A 4.5 GiB skeleton (sparse: data left as holes) is zip64, as torch.save writes it, and torch maps it."""
    big = Fill((9 * 2**27,), StoredDType("float32"), ())
    small = Fill((10,), StoredDType("int64"), ())
    path = tmp_path / "x.pt"
    skeleton = write_skeleton(str(path), {"a": small, "big": big, "n": 3})
    offsets = skeleton.offsets
    assert skeleton.crcs == deferred_crcs(str(path), sorted(offsets.values()))
    assert os.path.getsize(path) > 4 * 2**30 and offsets[id(big)] > 0 and offsets[id(small)] < 2**32
    got = torch.load(path, weights_only=True, mmap=True)
    assert got["big"].shape == (9 * 2**27,) and got["big"].dtype == torch.float32 and got["n"] == 3
    assert torch.equal(got["a"], torch.zeros(10, dtype=torch.int64))
    assert float(got["big"][-1]) == 0.0  # mapped at the right place: the hole reads as zeros
    with zipfile.ZipFile(path) as z:
        sizes = {i.filename.split("/", 1)[1]: i.file_size for i in z.infolist()}
    assert sizes["data/1"] == 9 * 2**29 and sizes["data/0"] == 80


def test_zip64_layout_of_small_files_reads_back_everywhere(fixtures, tmp_path, monkeypatch):
    """zip64 forced on small outputs: torch, zipfile's CRC check and ckptshard's own reader all read them."""
    import ckptshard.formats.torch_save as torch_save
    from ckptshard.read.torch_file import read_torch_zip

    src = src_of(fixtures[3], "fairseq")
    consolidate(src, str(tmp_path / "plain.pt"), container=True, optimizer=True, progress=False)
    reshard(src, str(tmp_path / "plain-re"), 2, progress=False)
    monkeypatch.setattr(torch_save, "FORCE_ZIP64", True)
    consolidate(src, str(tmp_path / "z64.pt"), container=True, optimizer=True, progress=False)
    reshard(src, str(tmp_path / "z64-re"), 2, progress=False)
    pairs = [(tmp_path / "z64.pt", tmp_path / "plain.pt")] + [
        (p, tmp_path / "plain-re" / p.name) for p in sorted((tmp_path / "z64-re").glob("*-shard*.pt"))
    ]
    assert len(pairs) == 3
    for z64, plain in pairs:
        with open(z64, "rb") as f:
            assert f.read(8)[4:6] == (45).to_bytes(2, "little")  # version needed: zip64
        with zipfile.ZipFile(z64) as z:
            assert z.testzip() is None
        got, want = torch.load(z64, weights_only=True, mmap=True), torch.load(plain, weights_only=True)
        got_leaves, want_leaves = list(leaves(got)), list(leaves(want))
        assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
        for (path, g), (_, w) in zip(got_leaves, want_leaves):
            assert (torch.equal(g, w) and g.dtype == w.dtype) if isinstance(w, torch.Tensor) else g == w, (z64, path)
        assert [p for p, _ in leaves(read_torch_zip(str(z64)))] == [p for p, _ in want_leaves]


@pytest.mark.parametrize("hashed", [True, False])
def test_write_torch_sets_every_crc_with_or_without_a_hash_pass(tmp_path, hashed):
    """The hash pass writes the CRCs where the layout says; without one, the writer sets them itself."""
    from ckptshard.osio.hashing import Hashes
    from ckptshard.tensors import Source, TensorRef
    from ckptshard.write.copier import Copier
    from ckptshard.write.torch_file import write_torch

    f32 = StoredDType("float32")
    values = torch.arange(3000, dtype=torch.float32)
    src = tmp_path / "src.bin"
    src.write_bytes(values.numpy().tobytes())

    def fill(start, numel):  # elements [start, start + numel) of the source, at an offset 4 bytes off any page
        return Fill((numel,), f32, (Source(TensorRef(str(src), 4, f32, (2999,), (1,)), start, 0, numel),))

    a, b = fill(0, 1000), fill(1000, 1999)
    tree = {"a": a, "b": b, "tied": a, "empty": Fill((0,), f32, ()), "n": 3}
    out = str(tmp_path / "out.pt")
    with Copier() as copier, Hashes() as hashes:
        write_torch(out, tree, copier, None, False, hashes if hashed else None)
        if hashed:
            hashes.settled(out)
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None  # every CRC right, in the descriptors and the central directory
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["a"], values[1:1001]) and torch.equal(got["b"], values[1001:3000])
    assert got["tied"] is got["a"] and got["n"] == 3 and got["empty"].numel() == 0


def _python_pickle(tree):
    import io

    from ckptshard.formats.torch_save import _Pickler

    buf = io.BytesIO()
    _Pickler(buf).dump(tree)
    return buf.getvalue()


def test_c_pickler_writes_the_python_picklers_bytes():
    """The fast path (C pickler, stand-in names renamed) is byte for byte the Python pickler's, ties and all."""
    import argparse
    import collections

    from ckptshard.formats.torch_save import _pickle

    a = Fill((3, 4), StoredDType("float32"), ())
    tree = {
        "model": collections.OrderedDict((f"l{i}.w", Fill((i + 1,), StoredDType("bfloat16"), ())) for i in range(300)),
        "tied": a,
        "again": a,
        "step": Fill((), StoredDType("int64"), ()),
        "mask": Fill((2,), StoredDType("bool"), ()),
        "shapes": [Size((2, 3)), torch.Size((4,)), Size(())],
        "args": argparse.Namespace(lr=0.1),
        "groups": [{"params": list(range(300)), "betas": (0.9, 0.999)}],
        "sets": ({1, 2}, frozenset({3})),
    }
    pkl, storages = _pickle(tree)
    assert pkl == _python_pickle(tree)
    assert len(storages) == 303 and b"ckptshard" not in pkl


def test_a_string_that_looks_like_a_stand_in_is_kept(tmp_path):
    """A string holding a stand-in's GLOBAL text must not be renamed: that file goes through the Python pickler."""
    from ckptshard.formats import torch_names
    from ckptshard.formats.torch_save import _pickle

    text = torch_names.marker("FloatStorage").decode()
    tree = {text: Fill((2,), StoredDType("float32"), ()), "note": text}
    pkl, _ = _pickle(tree)
    assert pkl == _python_pickle(tree) and pkl.count(text.encode()) == 1  # one string, memoized
    write_skeleton(str(tmp_path / "x.pt"), tree)
    got = torch.load(tmp_path / "x.pt", weights_only=True)
    assert got["note"] == text and got[text].dtype == torch.float32 and got[text].shape == (2,)

"""convert --to dcp without torch: the flattening, the frames and .metadata against torch's own."""

import io
import os
import subprocess
import sys

import pytest
import torch
from conftest import src_of
from torch.distributed.checkpoint import metadata as dmd
from torch.distributed.checkpoint._nested_dict import (
    flatten_state_dict as torch_flatten,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptshard.execute.convert import convert
from ckptshard.formats.dcp_metadata import DCP_VERSION, metadata_pickle
from ckptshard.formats.dcp_state import flatten_state_dict
from ckptshard.read.dcp import read_metadata
from ckptshard.write.dcp_files import tensor_frame

T = torch.zeros(2)
TREES = [
    {"model": {"a": T, "b": {"c": T}}, "step": 3},
    {"optim": {"state": {0: {"exp_avg": T, "step": T}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}},
    {"l": [T, 1, "x"], "nested": [[1, 2], [T]], "plain": [1, 2], "t": (T, 1), "empty": {}, "e2": [], "n": None},
    {"deep": [{"a": 1}, {"b": [T]}], 7: "int key", "m": [[[]]]},
]


@pytest.mark.parametrize("tree", TREES)
def test_flatten_is_torchs(tree):
    want = torch_flatten(tree)
    got = flatten_state_dict(tree, lambda v: isinstance(v, torch.Tensor))
    assert list(got[0]) == list(want[0]) and got[1] == want[1]
    assert all(got[0][k] is want[0][k] for k in want[0])


@pytest.mark.parametrize("shape,dtype", [((3, 5), "float32"), ((0,), "int64"), ((), "bfloat16"), ((7,), "float16")])
def test_tensor_frame_loads_in_torch(shape, dtype):
    runs, data_at, length, crc_at = tensor_frame(shape, dtype)
    want = torch.arange(max(1, torch.Size(shape).numel()))[: torch.Size(shape).numel()].to(getattr(torch, dtype))
    want = want.reshape(shape)
    buf = bytearray(length)
    for at, b in runs:
        buf[at : at + len(b)] = b
    raw = want.reshape(-1).view(torch.uint8).numpy().tobytes() if want.numel() else b""
    buf[data_at : data_at + len(raw)] = raw
    if raw:
        import struct
        import zlib

        for pos in crc_at:
            buf[pos : pos + 4] = struct.pack("<I", zlib.crc32(raw))
    got = torch.load(io.BytesIO(bytes(buf)), weights_only=True)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_metadata_unpickles_to_what_torch_builds():
    entries = {
        "model.w": (
            "float32",
            (4, 3),
            [((0, 0), (2, 3), ("__0_0.distcp", 0, 100)), ((2, 0), (2, 3), ("__1_0.distcp", 0, 100))],
        ),
        "model.b": ("bfloat16", (5,), [((0,), (5,), ("__0_0.distcp", 100, 90))]),
        "model.s": ("int64", (), [((), (), ("__0_0.distcp", 190, 80))]),
        "optim.param_groups": ("__0_0.distcp", 270, 50),
    }
    mapping = {
        "model.w": ("model", "w"),
        "model.b": ("model", "b"),
        "model.s": ("model", "s"),
        "optim.param_groups": ("optim", "param_groups"),
    }
    sd, storage = {}, {}
    for name, e in entries.items():
        if isinstance(e[2], list):
            dtype, shape, chunks = e
            sd[name] = dmd.TensorStorageMetadata(
                properties=dmd.TensorProperties(dtype=getattr(torch, dtype)),
                size=torch.Size(shape),
                chunks=[dmd.ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in chunks],
            )
            for o, _, w in chunks:
                storage[dmd.MetadataIndex(name, o)] = _StorageInfo(*w)
        else:
            sd[name] = dmd.BytesStorageMetadata()
            storage[dmd.MetadataIndex(name)] = _StorageInfo(*e)
    want = dmd.Metadata(
        state_dict_metadata=sd,
        planner_data=mapping,
        storage_data=storage,
        storage_meta=dmd.StorageMeta(),
        version=DCP_VERSION,
    )
    import pickle

    got = pickle.loads(metadata_pickle(entries, mapping, DCP_VERSION))
    assert got == want
    want = pickle.loads(pickle.dumps(want))  # what dcp.save's file gives back (None fields dropped on the way)
    # What == leaves out: each index's fields, the storage infos by key, the properties' memory format.
    assert [vars(k) for k in got.storage_data] == [vars(k) for k in want.storage_data]
    assert [vars(v) for v in got.storage_data.values()] == [vars(v) for v in want.storage_data.values()]
    assert got.state_dict_metadata["model.w"].properties.memory_format is torch.contiguous_format


def test_convert_to_dcp_imports_no_torch_and_reads_back(fixtures, tmp_path):
    code = (
        "import sys; from ckptshard.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    out = tmp_path / "dcp"
    res = subprocess.run(
        [sys.executable, "-c", code, "convert", src_of(fixtures[3], "fairseq"), "--to", "dcp", "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "NO-TORCH"
    # The same folder as the in-process convert (which may have torch loaded) writes, byte for byte.
    convert(src_of(fixtures[3], "fairseq"), str(tmp_path / "again"), "dcp", progress=False)
    names = sorted(n for n in os.listdir(out) if n != "ckptshard-manifest.json")
    assert names == sorted(n for n in os.listdir(tmp_path / "again") if n != "ckptshard-manifest.json")
    for n in names:
        assert (out / n).read_bytes() == (tmp_path / "again" / n).read_bytes(), n
    assert read_metadata(str(out)).version == DCP_VERSION


def _no_torch_cli(*args):
    code = (
        "import sys; from ckptshard.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("which", ["ours", "torch-saved"])
def test_reading_dcp_imports_no_torch_and_equals_the_torch_reader(fixtures, fsdp2_runs, which, tmp_path, monkeypatch):
    # "torch-saved": written by torch's own dcp.save from FSDP2 (DTensors, tensor step, param_groups values).
    folder = str(fsdp2_runs["dcp"]["mixed3"] if which == "ours" else fsdp2_runs["saved"])
    like = src_of(fixtures[3], "fairseq")
    runs = {
        "pt": ("convert", folder, "--to", "torch", "-o", str(tmp_path / "{}" / "full.pt"), "-q"),
        "st": (
            "convert",
            folder,
            "--to",
            "safetensors",
            "-o",
            str(tmp_path / "{}" / "m.safetensors"),
            "--select",
            "model.",
            "--strip-prefix",
            "model.",
            "-q",
        ),
        "fs": (
            "convert",
            folder,
            "--to",
            "fairscale",
            "--like",
            like,
            "-n",
            "2",
            "-o",
            str(tmp_path / "{}" / "fs"),
            "-q",
        ),
    }
    for name, args in runs.items():
        os.makedirs(tmp_path / "free", exist_ok=True)
        assert _no_torch_cli(*(a.format("free") for a in args)) == "NO-TORCH", name
    assert _no_torch_cli("inspect", folder) == "NO-TORCH"
    # The same command through torch's classes and torch.load: the same safetensors bytes, .pt files
    # that load to the same tree (torch lays out its own .pt files: a serialization id, record order).
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    from ckptshard.cli import main

    for name, args in runs.items():
        os.makedirs(tmp_path / "torch", exist_ok=True)
        with pytest.raises(SystemExit) as e:
            main([a.format("torch") for a in args])
        assert not e.value.code, name
    free, with_torch = sorted((tmp_path / "free").rglob("*")), sorted((tmp_path / "torch").rglob("*"))
    assert [p.relative_to(tmp_path / "free") for p in free] == [p.relative_to(tmp_path / "torch") for p in with_torch]
    from test_dcp import _assert_tree_equal

    for a, b in zip(free, with_torch):
        if a.suffix == ".safetensors":
            assert a.read_bytes() == b.read_bytes(), a
        elif a.suffix == ".pt":
            _assert_tree_equal(torch.load(a, weights_only=True), torch.load(b, weights_only=True), str(a))


def test_unflatten_state_dict_equals_torchs(fsdp2_runs):
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict as theirs

    from ckptshard.formats.dcp_state import unflatten_state_dict

    flat = {"a.0.x": 1, "a.2": [3], "b.c": {"k": 2}, "d": 5, "e.1.0": 7}
    mapping = {"a.0.x": ("a", 0, "x"), "a.2": ("a", 2), "b.c": ("b", "c"), "d": ("d",), "e.1.0": ("e", 1, 0)}
    assert unflatten_state_dict(flat, mapping) == theirs(flat, mapping)

"""The torch-free pickle reader against torch.load, on every real FSDP fixture file."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import CONTAINERS, SOURCE_WORLD_SIZES, src_of

from ckptshard.dtypes import Size, StoredDType, dtype_name
from ckptshard.execute.consolidate import consolidate
from ckptshard.formats.torch_pickle import Unsupported
from ckptshard.read.safe_load import load_lazy
from ckptshard.read.source import open_checkpoint
from ckptshard.read.tensor_data import read_scalar, read_tensor
from ckptshard.read.torch_file import read_torch_zip
from ckptshard.tensors import TensorRef
from ckptshard.tree import leaves


def fixture_files(fixtures, half_fixture, frozen_fixture):
    folders = [fixtures[w] for w in SOURCE_WORLD_SIZES] + [half_fixture, frozen_fixture]
    for folder in folders:
        for c in CONTAINERS:
            for name in sorted(os.listdir(folder / c)):
                yield folder / c / name


def assert_same_tree(got, want, where):
    got_leaves, want_leaves = list(leaves(got)), list(leaves(want))
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves], where
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        if isinstance(w, TensorRef):
            assert isinstance(g, TensorRef) and isinstance(g.dtype, StoredDType), (where, path)
            assert (g.path, g.offset, g.shape, g.stride) == (w.path, w.offset, w.shape, w.stride), (where, path)
            assert dtype_name(g.dtype) == dtype_name(w.dtype) and g.itemsize == w.itemsize, (where, path)
        else:
            assert type(g).__name__ == type(w).__name__ and g == w and repr(g) == repr(w), (where, path)


def test_reads_every_fixture_file_as_torch_load_does(fixtures, half_fixture, frozen_fixture):
    n = 0
    for path in fixture_files(fixtures, half_fixture, frozen_fixture):
        assert_same_tree(read_torch_zip(str(path)), load_lazy(str(path)), path)
        n += 1
    assert n > 50


def test_scalars_read_without_torch(tmp_path):
    values = {
        "f32": torch.tensor(1.5),
        "f64": torch.tensor(-2.25, dtype=torch.float64),
        "f16": torch.tensor(3.0, dtype=torch.float16),
        "bf16": torch.tensor(-0.75, dtype=torch.bfloat16),
        "i64": torch.tensor(7),
        "i32": torch.tensor(-3, dtype=torch.int32),
        "u8": torch.tensor(200, dtype=torch.uint8),
        "b": torch.tensor(True),
        "one": torch.tensor([4.0]),
    }
    torch.save(values, tmp_path / "s.pt")
    got = read_torch_zip(str(tmp_path / "s.pt"))
    for k, v in values.items():
        assert read_scalar(got[k]) == v.item(), k
    with pytest.raises(ValueError):
        read_scalar(TensorRef(str(tmp_path / "s.pt"), 0, StoredDType("float32"), (2,), (1,)))


def test_torch_size_reads_as_torch_prints_it(tmp_path):
    torch.save({"shapes": [torch.Size([3, 4])], "t": torch.arange(6).view(2, 3)[:, 1:]}, tmp_path / "x.pt")
    got, want = read_torch_zip(str(tmp_path / "x.pt")), load_lazy(str(tmp_path / "x.pt"))
    assert isinstance(got["shapes"][0], Size) and repr(got["shapes"][0]) == "torch.Size([3, 4])"
    assert not got["t"].contiguous and (got["t"].offset, got["t"].stride) == (want["t"].offset, want["t"].stride)
    assert torch.equal(read_tensor(got["t"]), torch.arange(6).view(2, 3)[:, 1:])


@pytest.mark.parametrize("extra", [torch.float16, torch.device("cpu"), torch.zeros(2, dtype=torch.complex64)])
def test_unsupported_values_are_refused_not_guessed(tmp_path, extra):
    torch.save({"x": extra}, tmp_path / "x.pt")
    with pytest.raises(Unsupported):
        read_torch_zip(str(tmp_path / "x.pt"))


def test_damaged_file_is_refused(fixtures, tmp_path):
    data = (fixtures[2] / "fairseq" / "checkpoint_last-shard0.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(Unsupported):
        read_torch_zip(str(tmp_path / "cut.pt"))


def test_one_unreadable_file_sends_every_file_through_torch(fixtures, tmp_path):
    """Rank 1 holds a value the reader refuses: all ranks then load with torch (one kind of dtype per run)."""
    for r in range(3):
        obj = torch.load(fixtures[3] / "fairseq" / f"checkpoint_last-shard{r}.pt", weights_only=True)
        if r == 1:
            obj["extra_state"]["device"] = torch.device("cpu")
        torch.save(obj, tmp_path / f"checkpoint_last-shard{r}.pt")
    ckpt = open_checkpoint(str(tmp_path), torch_free=True)
    kinds = {type(leaf.dtype) for o in ckpt.objs for _, leaf in leaves(o) if isinstance(leaf, TensorRef)}
    assert kinds == {torch.dtype}
    consolidate(str(tmp_path), str(tmp_path / "a.safetensors"), progress=False)
    consolidate(str(fixtures[3] / "fairseq"), str(tmp_path / "b.safetensors"), progress=False)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def _consolidate_cli(src, out, env_extra=None):
    code = (
        "import sys; from ckptshard.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    env = dict(os.environ, **(env_extra or {}))
    res = subprocess.run(
        [sys.executable, "-c", code, "consolidate", src, "-o", out, "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("which", ["fairseq-3", "vissl-4", "half", "frozen"])
def test_safetensors_without_torch_equals_with_torch(fixtures, half_fixture, frozen_fixture, tmp_path, which):
    src = {
        "fairseq-3": src_of(fixtures[3], "fairseq"),
        "vissl-4": src_of(fixtures[4], "vissl"),
        "half": src_of(half_fixture, "metaseq"),
        "frozen": src_of(frozen_fixture, "fairseq"),
    }[which]
    assert _consolidate_cli(src, str(tmp_path / "fast.safetensors")) == "NO-TORCH"
    assert _consolidate_cli(src, str(tmp_path / "torch.safetensors"), {"CKPTSHARD_TORCH_READER": "1"}) == "TORCH"
    assert (tmp_path / "fast.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    fast = (tmp_path / "fast.safetensors.manifest.json").read_text().replace("fast.safetensors", "X")
    slow = (tmp_path / "torch.safetensors.manifest.json").read_text().replace("torch.safetensors", "X")
    assert fast == slow  # same fingerprint of the source, same checksums


@pytest.mark.parametrize("which", ["fairseq-2", "vissl-3", "frozen"])
def test_inspect_without_torch_equals_with_torch(fixtures, frozen_fixture, monkeypatch, which):
    from ckptshard.execute.inspect import format_summary, inspect_checkpoint

    src = {
        "fairseq-2": src_of(fixtures[2], "fairseq"),
        "vissl-3": src_of(fixtures[3], "vissl"),
        "frozen": src_of(frozen_fixture, "metaseq"),
    }[which]
    fast = inspect_checkpoint(src)
    monkeypatch.setenv("CKPTSHARD_TORCH_READER", "1")
    slow = inspect_checkpoint(src)
    assert fast == slow and format_summary(fast) == format_summary(slow)
    assert fast["world_size"] > 1 and fast["parts"]


def test_inspect_cli_imports_no_torch(fixtures):
    code = (
        "import sys; from ckptshard.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, "inspect", src_of(fixtures[3], "fairseq")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "world size  3" in res.stdout and res.stdout.strip().endswith("NO-TORCH")


def test_parameters_views_and_shared_storage(tmp_path):
    base = torch.arange(20, dtype=torch.float32)
    obj = {
        "p": torch.nn.Parameter(torch.randn(3, 2)),
        "view": base[5:10],
        "same": base,
        "col": base.view(4, 5)[:, 2],
        "h": torch.ones(4, dtype=torch.float16),
        "nested": [({"a": base[1:3]},)],
    }
    torch.save(obj, tmp_path / "x.pt")
    got, want = read_torch_zip(str(tmp_path / "x.pt")), load_lazy(str(tmp_path / "x.pt"))
    assert_same_tree(got, want, "x.pt")
    for path, ref in leaves(got):
        if isinstance(ref, TensorRef):  # and the bytes read back are the tensor saved
            saved = obj
            for k in path:
                saved = saved[k]
            assert torch.equal(read_tensor(ref), saved.detach()), path


def _legacy_copy(src, dst):
    """The same checkpoint re-saved in torch.save's legacy (non-zip) format."""
    dst.mkdir()
    for p in sorted(src.iterdir()):
        torch.save(torch.load(p, weights_only=False), dst / p.name, _use_new_zipfile_serialization=False)
    return dst


def _tensor_values(tree):
    from ckptshard.read.tensor_data import read_fill
    from ckptshard.tensors import whole

    return [(p, read_fill(whole(v)) if isinstance(v, TensorRef) else v) for p, v in leaves(tree)]


@pytest.mark.parametrize("container", CONTAINERS)
def test_legacy_format_reads_lazily_and_converts_like_the_zip_format(fixtures, tmp_path, container):
    from ckptshard.execute.reshard import reshard
    from ckptshard.read.torch_file import read_torch_legacy

    src = fixtures[3] / container
    legacy = _legacy_copy(src, tmp_path / "legacy")
    for name in sorted(os.listdir(src)):
        got, want = read_torch_legacy(str(legacy / name)), torch.load(src / name, weights_only=False)
        got_values = _tensor_values(got)
        want_values = list(leaves(want))
        assert [p for p, _ in got_values] == [p for p, _ in want_values]
        for (path, g), (_, w) in zip(got_values, want_values):
            if isinstance(w, torch.Tensor):
                assert g.dtype == w.dtype and torch.equal(g, w), (name, path)
            else:
                assert g == w, (name, path)
    # Torch-free (consolidate) and torch (open_checkpoint's default) paths both read it, same bytes out.
    consolidate(str(legacy), str(tmp_path / "legacy.safetensors"), progress=False)
    consolidate(str(src), str(tmp_path / "zip.safetensors"), progress=False)
    assert (tmp_path / "legacy.safetensors").read_bytes() == (tmp_path / "zip.safetensors").read_bytes()
    with_torch = open_checkpoint(str(legacy))  # the torch path's load_lazy hands legacy files to the same reader
    assert with_torch.world_size == 3 and with_torch.layout.flat_params()
    reshard(str(legacy), str(tmp_path / "re"), 2, progress=False)
    reshard(str(src), str(tmp_path / "re-zip"), 2, progress=False)
    for p in sorted((tmp_path / "re-zip").iterdir()):
        if p.name != "ckptshard-manifest.json":
            assert p.read_bytes() == (tmp_path / "re" / p.name).read_bytes(), p.name


def _gpu_saved_copy(src, dst):
    """The same checkpoint as a GPU run saves it: every storage tagged ``cuda:<rank>``."""
    import torch.serialization as ser

    dst.mkdir()
    for rank, p in enumerate(sorted(src.iterdir())):
        obj = torch.load(p, weights_only=False)
        tagger = (0, lambda storage, r=rank: f"cuda:{r}", lambda storage, location: None)
        ser._package_registry.append(tagger)
        ser._package_registry.sort(key=lambda e: e[0])
        try:
            torch.save(obj, dst / p.name)
        finally:
            ser._package_registry.remove(tagger)
    return dst


def test_gpu_saved_shards_convert_on_a_cpu_machine(fixtures, tmp_path):
    """Real checkpoints come from GPU runs; plain torch.load refuses them here without map_location."""
    from ckptshard.execute.reshard import reshard

    src = fixtures[3] / "fairseq"
    gpu = _gpu_saved_copy(src, tmp_path / "gpu")
    first = sorted(gpu.iterdir())[0]
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(first, weights_only=True)
    assert _consolidate_cli(str(gpu), str(tmp_path / "fast.safetensors")) == "NO-TORCH"
    assert _consolidate_cli(str(gpu), str(tmp_path / "torch.safetensors"), {"CKPTSHARD_TORCH_READER": "1"}) == "TORCH"
    consolidate(str(src), str(tmp_path / "cpu.safetensors"), progress=False)
    want = (tmp_path / "cpu.safetensors").read_bytes()
    assert (tmp_path / "fast.safetensors").read_bytes() == want
    assert (tmp_path / "torch.safetensors").read_bytes() == want
    # Resharded files are what the CPU-saved checkpoint gives, and load anywhere without map_location.
    reshard(str(gpu), str(tmp_path / "re-gpu"), 2, progress=False)
    reshard(str(src), str(tmp_path / "re-cpu"), 2, progress=False)
    for p in sorted((tmp_path / "re-cpu").iterdir()):
        if p.name != "ckptshard-manifest.json":
            assert p.read_bytes() == (tmp_path / "re-gpu" / p.name).read_bytes(), p.name
            torch.load(tmp_path / "re-gpu" / p.name, weights_only=True)


def test_a_damaged_legacy_file_is_one_clear_error(fixtures, tmp_path):
    from ckptshard.errors import CheckpointError

    legacy = _legacy_copy(fixtures[2] / "fairseq", tmp_path / "legacy")
    victim = sorted(legacy.iterdir())[1]
    victim.write_bytes(victim.read_bytes()[:-100])  # the last storage is cut short
    with pytest.raises(CheckpointError, match="nor a legacy one read lazily"):
        open_checkpoint(str(legacy))
    with pytest.raises(CheckpointError, match="nor a legacy one read lazily"):
        consolidate(str(legacy), str(tmp_path / "x.safetensors"), progress=False)
    assert not (tmp_path / "x.safetensors").exists()


def test_flags_on_a_tensor_are_read_past_and_anything_else_refused(tmp_path):
    """fairscale's state_dict() marks tensors ``_has_been_cloned``; torch saves that (as _rebuild_from_type_v2
    with state) and its full state dicts carry it. A flag is not the data: read. A tensor in the state: refused."""
    t = torch.arange(6.0).reshape(2, 3)
    t._has_been_cloned = True
    torch.save({"w": t}, tmp_path / "flag.pt")
    with open(tmp_path / "flag.pt", "rb") as f:
        assert b"_rebuild_from_type_v2" in f.read()
    ref = read_torch_zip(str(tmp_path / "flag.pt"))["w"]
    assert torch.equal(read_tensor(ref), t)

    u = torch.arange(3.0)
    u.extra = torch.ones(1)
    torch.save({"w": u}, tmp_path / "tensor_state.pt")
    with pytest.raises(Unsupported, match="tensor subclass"):
        read_torch_zip(str(tmp_path / "tensor_state.pt"))

"""The on-disk cache of torch's DTensor pickles for a mesh (``write/template_cache``): keyed by the torch
installed, an entry used only if it reads back whole."""

import importlib.util
import types

from ckptshard.dtypes import StoredDType
from ckptshard.formats.torch_names import Literal
from ckptshard.write import template_cache


def _fake_torch(root, version="2.99.0"):
    (root / "distributed" / "tensor").mkdir(parents=True, exist_ok=True)
    (root / "version.py").write_text(f"__version__ = '{version}'\n")
    (root / "distributed" / "device_mesh.py").write_text("# mesh\n")
    (root / "distributed" / "tensor" / "_dtensor_spec.py").write_text("# spec\n")
    return types.SimpleNamespace(origin=str(root / "__init__.py"))


def test_identity_follows_the_installed_torch(tmp_path, monkeypatch):
    real = template_cache.torch_identity()
    assert real is not None and real == template_cache.torch_identity()
    spec = _fake_torch(tmp_path / "torch")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    fake = template_cache.torch_identity()
    assert fake not in (None, real)
    _fake_torch(tmp_path / "torch", version="2.99.1")
    assert template_cache.torch_identity() != fake
    (tmp_path / "torch" / "distributed" / "device_mesh.py").unlink()
    assert template_cache.torch_identity() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert template_cache.torch_identity() is None and template_cache.entry_key(2, 0) is None


def test_cache_folder_and_off_switch(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTSHARD_CACHE_DIR", raising=False)
    monkeypatch.delenv("CKPTSHARD_NO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert template_cache.cache_dir() == str(tmp_path / "xdg" / "ckptshard" / "mesh-templates")
    monkeypatch.setenv("CKPTSHARD_CACHE_DIR", str(tmp_path / "own"))
    assert template_cache.cache_dir() == str(tmp_path / "own" / "mesh-templates")
    assert template_cache.entry_key(6, 1, (2, 3)) != template_cache.entry_key(6, 2, (2, 3))
    monkeypatch.setenv("CKPTSHARD_NO_CACHE", "1")
    assert template_cache.cache_dir() is None and template_cache.entry_key(6, 1) is None


def test_an_entry_reads_back_whole_or_not_at_all(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CKPTSHARD_NO_CACHE", raising=False)
    pt = tmp_path / "made.pt"
    pt.write_bytes(b"PK-a torch file")
    tensors = {"_rank_map": Literal((2,), StoredDType("int64"), bytes(range(16)))}
    template_cache.store("k", str(pt), tensors)
    path, back = template_cache.load("k")
    with open(path, "rb") as f:
        assert f.read() == b"PK-a torch file"
    want = [("_rank_map", (2,), StoredDType("int64"), bytes(range(16)))]
    assert [(k, v.shape, v.dtype, v.data) for k, v in back.items()] == want
    entry = tmp_path / "mesh-templates" / "k.pt"
    entry.write_bytes(b"PK-a torch filf")
    assert template_cache.load("k") is None
    assert template_cache.load("missing") is None
    (tmp_path / "mesh-templates" / "k.json").write_text("[1, 2]")
    assert template_cache.load("k") is None
    monkeypatch.setenv("CKPTSHARD_CACHE_DIR", str(pt))  # a file where the folder would be: nothing kept
    template_cache.store("k", str(pt), tensors)
    assert template_cache.load("k") is None

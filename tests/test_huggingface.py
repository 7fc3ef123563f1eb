"""From a verl run to a Hugging Face model: real verl-layout checkpoints of a tiny Llama (FSDP2 under verl's
``shard_placement_fn``, tied and untied, and FSDP1), consolidated into a folder that ``from_pretrained`` loads as
written, and resharded to the placements FSDP2 itself picks at N (``ckptshard.testing.hf_runs``).

Oracles: the live model's full state dict and logits (``torch.equal``), transformers' own loading report, and
the files FSDP2 at N saves under the same placement function."""

import hashlib
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import _once

import ckptshard
from ckptshard.errors import CheckpointError
from ckptshard.testing import hf_runs, torch_fsdp_runs

transformers = pytest.importorskip("transformers")

CODE = hashlib.sha256(pathlib.Path(hf_runs.__file__).read_bytes()).hexdigest()[:8] + transformers.__version__
RUNS = {  # name: (world size, FSDP version, placement rule, tied embeddings)
    "fsdp2": (3, 2, "divisible", False),  # embedding, head, gate/up on Shard(1) at 3 ranks
    "fsdp2-tied": (2, 2, "divisible", True),  # every weight on Shard(0) at 2: fits torch's rule too
    "fsdp1": (2, 1, "divisible", False),
}
ORACLES = {  # (run, N): FSDP2's own files at N under the run's rule
    ("fsdp2", 2): "divisible",
    ("fsdp2", 4): "divisible",  # k_proj (6, 12) on Shard(1) at 4
    ("fsdp2-tied", 3): "divisible",
}


@pytest.fixture(scope="module")
def runs(cache_root):
    return {
        name: _once(cache_root / f"hf-{name}-{CODE}", lambda d, a=args: hf_runs.build_hf_run(d, *a))
        for name, args in RUNS.items()
    }


@pytest.fixture(scope="module")
def torch_files(runs, cache_root):
    out = {}
    for (name, n), rule in ORACLES.items():

        def build(d, name=name, n=n, rule=rule):
            hf_runs.hf_torch_at(str(runs[name] / "ref"), d, n, rule, RUNS[name][3])

        out[(name, n)] = _once(cache_root / f"hf-{name}-at{n}-{CODE}", build)
    return out


def _ref(run, name):
    return torch.load(run / "ref" / f"{name}.pt", weights_only=True)


def _load_pretrained(folder):
    """The model and tokenizer transformers loads from ``folder``, its loading report, and every warning it
    gave (Python's and transformers' logger's)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), output_loading_info=True, dtype="auto"
            )
            tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    return model, tok, info, [str(w.message) for w in caught] + records


@pytest.mark.parametrize("name", list(RUNS))
def test_from_pretrained_loads_the_folder_as_written(runs, name, tmp_path):
    run = runs[name]
    out = tmp_path / "model"
    res = ckptshard.consolidate(run, out, progress=False)
    model, tok, info, said = _load_pretrained(out)
    assert {k: v for k, v in info.items() if v} == {} and said == []
    want = _ref(run, "full_model")
    got = model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    with torch.no_grad():
        assert torch.equal(model(input_ids=hf_runs.PROBE).logits, _ref(run, "logits"))
    assert tok("w1 w2").input_ids == [4, 5]
    carried = os.listdir(run / "huggingface")  # config, generation config, tokenizer files
    assert "generation_config.json" in carried and "tokenizer.json" in carried
    assert sorted(os.listdir(out)) == sorted(["ckptshard-manifest.json", "model.safetensors", *carried])
    tied = RUNS[name][3]
    assert any("lm_head.weight: the same tensor as model.embed_tokens.weight" in n for n in res.notes) == tied
    assert ckptshard.verify(out) == []


def test_bf16_folder_loads_as_bf16_and_says_so(runs, tmp_path):
    run, out = runs["fsdp2"], tmp_path / "bf16"
    ckptshard.consolidate(run, out, dtype="bf16", progress=False)
    model, _, info, said = _load_pretrained(out)
    assert model.dtype == torch.bfloat16 and said == [] and not info["missing_keys"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    got = model.state_dict()
    for k, v in _ref(run, "full_model").items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k


def test_a_folder_of_several_files_is_laid_out_as_save_pretrained_lays_it_out(runs, tmp_path):
    run, out = runs["fsdp2-tied"], tmp_path / "sharded"
    ckptshard.consolidate(run, out, max_shard_size=4000, progress=False, jobs=2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "lm_head.weight" not in index["weight_map"] and "model.safetensors" not in os.listdir(out)
    model, _, info, said = _load_pretrained(out)
    assert {k: v for k, v in info.items() if v} == {} and said == []
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(model(input_ids=hf_runs.PROBE).logits, _ref(run, "logits"))
    assert ckptshard.verify(out) == []


def test_a_single_file_output_stays_a_plain_state_dict_and_says_where_the_config_is(runs, tmp_path):
    from safetensors.torch import load_file

    run = runs["fsdp2-tied"]
    res = ckptshard.consolidate(run, tmp_path / "model.safetensors", progress=False)
    assert set(load_file(tmp_path / "model.safetensors")) == set(_ref(run, "full_model"))  # the head too
    assert any("huggingface: a Hugging Face config came with the checkpoint" in n for n in res.notes)
    with pytest.raises(CheckpointError, match="--hf-config writes a model folder"):
        ckptshard.consolidate(run, tmp_path / "b.safetensors", hf_config=run / "huggingface", progress=False)


def test_hf_config_finishes_a_folder_of_any_family(runs, tmp_path):
    """A DCP folder of the same weights (another family) with the config named by --hf-config."""
    run = runs["fsdp2"]
    ckptshard.convert(run, tmp_path / "ckpt.dcp", "dcp", progress=False)
    out = tmp_path / "model"
    ckptshard.consolidate(tmp_path / "ckpt.dcp", out, hf_config=run / "huggingface", progress=False)
    model, _, info, said = _load_pretrained(out)
    assert {k: v for k, v in info.items() if v} == {} and said == []
    with torch.no_grad():
        assert torch.equal(model(input_ids=hf_runs.PROBE).logits, _ref(run, "logits"))


def test_a_hf_config_folder_that_is_not_one_is_one_line(runs, tmp_path):
    run = runs["fsdp2"]
    cases = {
        "not JSON": lambda d: (d / "config.json").write_text("{"),
        "a JSON list": lambda d: (d / "config.json").write_text("[]"),
        "a named pipe": lambda d: os.mkfifo(d / "config.json"),
        "no config.json": lambda d: None,
        "a character device": lambda d: (
            (d / "config.json").write_text("{}"),
            os.symlink("/dev/zero", d / "tokenizer.json"),
        ),
    }
    for why, make in cases.items():
        d = tmp_path / why.replace(" ", "-")
        d.mkdir()
        make(d)
        with pytest.raises(CheckpointError) as e:
            ckptshard.consolidate(run, tmp_path / f"out-{d.name}", hf_config=d, progress=False)
        assert "\n" not in str(e.value) and str(d) in str(e.value), why
        assert not (tmp_path / f"out-{d.name}").exists()


@pytest.mark.parametrize("pair", list(ORACLES), ids=lambda p: f"{p[0]}-to{p[1]}")
def test_reshard_writes_the_placements_fsdp2_picks_at_n(runs, torch_files, pair, tmp_path):
    name, n = pair
    out = tmp_path / "out"
    placement = "divisible" if name == "fsdp2-tied" else None  # at 2 ranks the files fit both rules
    ckptshard.reshard(runs[name], out, n, placement=placement, progress=False)
    theirs = torch_files[pair]
    for r in range(n):
        for kind in ("model", "optim"):
            f = f"{kind}_world_size_{n}_rank_{r}.pt"
            torch_fsdp_runs.assert_same_state(
                torch.load(out / f, weights_only=True), torch.load(theirs / f, weights_only=True), f
            )
    assert hf_runs.placements_of(str(out), n) == hf_runs.placements_of(str(theirs), n)
    assert ckptshard.verify(out) == []


def test_a_source_that_fits_both_rules_is_refused_where_they_differ(runs, tmp_path):
    with pytest.raises(CheckpointError) as e:
        ckptshard.reshard(runs["fsdp2-tied"], tmp_path / "out", 3, progress=False)
    msg = str(e.value)
    assert "model.embed_tokens.weight (64, 12) on Shard(0) or Shard(1)" in msg and "--placement" in msg
    assert not (tmp_path / "out").exists()
    ckptshard.reshard(runs["fsdp2-tied"], tmp_path / "one", 1, progress=False)  # both rules agree at 1


def test_placement_keep_keeps_each_source_dimension(runs, tmp_path):
    ckptshard.reshard(runs["fsdp2"], tmp_path / "out", 2, placement="keep", progress=False)
    assert hf_runs.placements_of(str(tmp_path / "out"), 2) == hf_runs.placements_of(str(runs["fsdp2"]), 3)


def test_placement_of_the_cli_is_checked_and_documented(runs, tmp_path):
    cli = [sys.executable, "-m", "ckptshard.cli"]
    bad = subprocess.run([*cli, "reshard", str(runs["fsdp2"]), "-n", "2", "-o", str(tmp_path / "o"), "--placement",
                          "rows"], capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "rows" in bad.stderr
    ok = subprocess.run([*cli, "reshard", str(runs["fsdp2-tied"]), "-n", "3", "-o", str(tmp_path / "o"), "-q",
                         "--placement", "divisible"], capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    shutil.rmtree(tmp_path / "o")

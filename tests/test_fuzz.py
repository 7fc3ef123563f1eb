"""Seeded mutations of real fixture checkpoints: each run fails cleanly or writes a correct output.

Correct means: what torch itself reads from the mutated files, consolidated
by fairscale's ``consolidate_shard_weights`` (plus the nested tie fairscale
drops, #815). Never a traceback, never a wrong output, never a leftover file.
"""

import random
import shutil

import pytest
import torch
from conftest import load_ref
from fairscale.nn import FullyShardedDataParallel as FSDP

from ckptshard.errors import CheckpointError
from ckptshard.execute.consolidate import consolidate
from ckptshard.execute.convert import convert
from ckptshard.execute.reshard import reshard

CASES = 240
WS = 3
NAMES = {"fairseq": "checkpoint_last-shard{}.pt", "metaseq": "checkpoint_last-model_part-0-shard{}.pt"}
META = {"fairseq": "fsdp_metadata", "metaseq": "shard_metadata"}


def mutate_bytes(rng, path):
    data = bytearray(path.read_bytes())
    kind = rng.choice(["truncate", "flip", "zero"])
    if kind == "truncate":
        data = data[: rng.randrange(len(data))]
    elif kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        a = rng.randrange(len(data))
        data[a : a + rng.randint(1, 64)] = bytes(len(data[a : a + 64]))[: len(data[a : a + rng.randint(1, 64)])]
    path.write_bytes(bytes(data))
    return kind


def mutate_structure(rng, path, container):
    obj = torch.load(path, weights_only=True)
    meta = obj[META[container]]
    kind = rng.choice(["shape", "padding", "pop_model", "pop_meta_key", "pop_optim", "dtype", "names", "pop_instance"])
    keys = list(obj["model"])
    if kind == "shape":
        k = rng.choice(keys)
        obj["model"][k] = torch.zeros(obj["model"][k].numel() + rng.choice([-1, 1, 5]))
    elif kind == "padding":
        inst = rng.choice([i for i in meta["param_metadata"] if i["params"]])
        fp = rng.choice(list(inst["params"].values()))
        fp["padding"] += rng.choice([1, 2, -1])
    elif kind == "pop_model":
        obj["model"].pop(rng.choice(keys))
    elif kind == "pop_meta_key":
        meta.pop(rng.choice(["param_metadata", "buffer_names"]))
    elif kind == "pop_optim":
        obj["last_optimizer_state"]["state"].pop(rng.choice(list(obj["last_optimizer_state"]["state"])))
    elif kind == "dtype":
        k = rng.choice(keys)
        obj["model"][k] = obj["model"][k].to(torch.float64 if obj["model"][k].is_floating_point() else torch.int32)
    elif kind == "names":
        inst = rng.choice([i for i in meta["param_metadata"] if i["params"]])
        fp = rng.choice(list(inst["params"].values()))
        fp["names"] = fp["names"][::-1]
        fp["shapes"] = fp["shapes"][::-1]
    else:
        meta["param_metadata"].pop(rng.randrange(len(meta["param_metadata"])))
    torch.save(obj, path)
    return kind


def mutate_files(rng, folder, container):
    kind = rng.choice(["swap", "delete", "duplicate"])
    name = NAMES[container]
    a, b = rng.sample(range(WS), 2)
    pa, pb = folder / name.format(a), folder / name.format(b)
    if kind == "swap":
        tmp = folder / "tmp"
        pa.rename(tmp)
        pb.rename(pa)
        tmp.rename(pb)
    elif kind == "delete":
        pa.unlink()
    else:
        shutil.copy(pa, pb)
    return kind


def reference(folder, container):
    """What torch reads from the (mutated) files, consolidated by fairscale; None if either refuses."""
    try:
        shards = [torch.load(folder / NAMES[container].format(r), weights_only=True) for r in range(WS)]
        full = FSDP.consolidate_shard_weights(
            [s["model"] for s in shards], [s[META[container]] for s in shards], strict=False
        )
    except Exception:
        return None
    if "trunk.embed_in.weight" in full:
        full.setdefault("trunk.embed_out.weight", full["trunk.embed_in.weight"])
    return full


def equal(a, b):
    return a is not None and set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", range(CASES))
def test_mutated_checkpoint(fixtures, tmp_path, case):
    rng = random.Random(case)
    container = ["fairseq", "metaseq"][case % 2]
    src = tmp_path / "src"
    shutil.copytree(fixtures[WS] / container, src)
    group = case % 3
    if group == 0:
        victim = src / NAMES[container].format(rng.randrange(WS))
        kind = mutate_bytes(rng, victim)
    elif group == 1:
        kind = mutate_structure(rng, src / NAMES[container].format(rng.randrange(WS)), container)
    else:
        kind = mutate_files(rng, src, container)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "full.pt"
    try:
        consolidate(str(src), str(out), optimizer=True, progress=False)
    except CheckpointError as e:
        assert str(e) and "\n" not in str(e)
        assert list(out_dir.iterdir()) == [], f"{kind}: files left after an error"
        with pytest.raises(CheckpointError):  # reshard refuses the same input
            reshard(str(src), str(out_dir / "r"), 2, progress=False)
        with pytest.raises(CheckpointError):  # and so does convert --to dcp
            convert(str(src), str(out_dir / "d"), "dcp", progress=False)
        assert list(out_dir.iterdir()) == [], f"{kind}: files left after an error"
        return
    got = torch.load(out, weights_only=True)
    original = load_ref(fixtures[WS], "full_state_dict.pt")
    assert equal(got, original) or equal(got, reference(src, container)), f"{kind}: wrong output written"
    # reshard accepts it too, and its output holds the same weights.
    reshard(str(src), str(out_dir / "r"), 2, progress=False)
    consolidate(str(out_dir / "r"), str(out_dir / "again.pt"), progress=False)
    assert equal(torch.load(out_dir / "again.pt", weights_only=True), got), f"{kind}: reshard differs"
    # convert --to dcp accepts it too, and the DCP holds the same weights.
    convert(str(src), str(out_dir / "d"), "dcp", progress=False)
    convert(
        str(out_dir / "d"), str(out_dir / "d.pt"), "torch", select=["model."], strip_prefix=["model."], progress=False
    )
    assert equal(torch.load(out_dir / "d.pt", weights_only=True), got), f"{kind}: DCP differs"


DCP_CASES = 60


def _torch_reads_dcp(folder, tmp_path):
    """What torch's own dcp_to_torch_save reads from the (mutated) folder; None if it refuses."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        dcp_to_torch_save(str(folder), str(tmp_path / "theirs.pt"))
        return torch.load(tmp_path / "theirs.pt", weights_only=False)["model"]
    except Exception:
        return None


def _mutate_dcp(rng, folder):
    import pickle

    files = sorted(p for p in folder.iterdir() if p.name.endswith(".distcp"))
    kind = rng.choice(["bytes", "bytes", "metadata_bytes", "delete_file", "drop_chunk", "resize_chunk", "dtype"])
    if kind == "bytes":
        mutate_bytes(rng, rng.choice(files))
    elif kind == "metadata_bytes":
        mutate_bytes(rng, folder / ".metadata")
    elif kind == "delete_file":
        rng.choice(files).unlink()
    else:
        with open(folder / ".metadata", "rb") as f:
            md = pickle.load(f)
        name = rng.choice(
            sorted(
                k for k, v in md.state_dict_metadata.items() if k.startswith("model.") and getattr(v, "chunks", None)
            )
        )
        tmd = md.state_dict_metadata[name]
        if kind == "drop_chunk":
            tmd.chunks.pop(rng.randrange(len(tmd.chunks)))
        elif kind == "resize_chunk":
            c = rng.choice(tmd.chunks)
            if len(c.sizes):
                c.sizes = torch.Size([c.sizes[0] + 1, *c.sizes[1:]])
        else:
            tmd.properties.dtype = torch.float64
        with open(folder / ".metadata", "wb") as f:
            pickle.dump(md, f)
    return kind


@pytest.mark.parametrize("case", range(DCP_CASES))
def test_mutated_dcp(fixtures, tmp_path, case):
    """A damaged DCP folder: convert fails cleanly, or writes exactly what torch's own reader reads."""
    rng = random.Random(10_000 + case)
    src = tmp_path / "src.dcp"
    convert(str(fixtures[WS] / "fairseq"), str(src), "dcp", progress=False)
    kind = _mutate_dcp(rng, src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    try:
        convert(str(src), str(out_dir / "m.pt"), "torch", select=["model."], strip_prefix=["model."], progress=False)
    except CheckpointError as e:
        assert str(e) and "\n" not in str(e)
        assert list(out_dir.iterdir()) == [], f"{kind}: files left after an error"
        return
    theirs = _torch_reads_dcp(src, tmp_path)
    assert equal(torch.load(out_dir / "m.pt", weights_only=True), theirs), f"{kind}: differs from torch's reading"


HOSTILE_CASES = 40


def _deep(rng, paths, container):
    import sys

    depth = rng.randint(101, 600)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)  # torch.save recurses per level
    try:
        p = rng.choice(paths)
        obj = torch.load(p, weights_only=True)
        x = []
        for _ in range(depth):
            x = [x] if rng.random() < 0.5 else {"k": x}
        obj["deep"] = x
        torch.save(obj, p)
    finally:
        sys.setrecursionlimit(limit)


def _bomb(rng, paths, container):
    import zipfile

    p = rng.choice(paths)
    with zipfile.ZipFile(p) as zf:
        records = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
    packed = rng.choice([n for n, _ in records])
    with zipfile.ZipFile(p, "w") as zf:
        for n, raw in records:
            zf.writestr(
                n,
                raw + (bytes(rng.randint(1, 32) << 20) if n == packed else b""),
                zipfile.ZIP_DEFLATED if n == packed else zipfile.ZIP_STORED,
            )


def _flat_infos(obj, container):
    return [(e, k, fp) for e in obj[META[container]]["param_metadata"] for k, fp in e["params"].items()]


def _duplicate_name(rng, paths, container):
    objs = [torch.load(p, weights_only=True) for p in paths]
    choices = [
        (i, j, k)
        for i, (_, _, fp) in enumerate(_flat_infos(objs[0], container))
        for j in range(len(fp["names"]))
        for k in range(len(fp["names"]))
        if j != k and list(fp["shapes"][j]) == list(fp["shapes"][k])
    ]
    i, j, k = rng.choice(choices)
    for obj, p in zip(objs, paths):  # every rank agrees: only the names lie
        fp = _flat_infos(obj, container)[i][2]
        fp["names"][k] = fp["names"][j]
        torch.save(obj, p)


def _padding_lie(rng, paths, container):
    from ckptshard.layout.chunking import padding

    objs = [torch.load(p, weights_only=True) for p in paths]
    choices = [
        (i, j)
        for i, (_, _, fp) in enumerate(_flat_infos(objs[0], container))
        if sum(fp["numels"]) % WS == 0
        for j, s in enumerate(fp["shapes"])
        if len(s) == 1 and s[0] > 1
    ]
    i, j = rng.choice(choices)
    for r, (obj, p) in enumerate(zip(objs, paths)):  # self-consistent: sizes and paddings all add up
        fp = _flat_infos(obj, container)[i][2]
        fp["shapes"][j] = torch.Size([fp["shapes"][j][0] - 1])
        fp["numels"][j] -= 1
        fp["padding"] = padding(sum(fp["numels"]), WS, r)
        torch.save(obj, p)


def _duplicate_record(rng, paths, container):
    from test_hostile import _with_duplicate_record

    _with_duplicate_record(rng.choice(paths))


HOSTILE = {
    "nesting": _deep,
    "bomb": _bomb,
    "duplicate-name": _duplicate_name,
    "padding-lie": _padding_lie,
    "duplicate-record": _duplicate_record,
}


@pytest.mark.parametrize("case", range(HOSTILE_CASES))
def test_hostile_mutation(fixtures, tmp_path, case):
    """Crafted rather than damaged: deep nesting, a compressed record, a name listed twice, padding that
    lies, a record named twice. Each is refused in one line with nothing written, by both readers."""
    rng = random.Random(20_000 + case)
    container = ["fairseq", "metaseq"][case % 2]
    kind = sorted(HOSTILE)[case % len(HOSTILE)]
    src = tmp_path / "src"
    shutil.copytree(fixtures[WS] / container, src)
    HOSTILE[kind](rng, [src / NAMES[container].format(r) for r in range(WS)], container)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for torch_reader in ("", "1"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CKPTSHARD_TORCH_READER", torch_reader) if torch_reader else mp.delenv(
                "CKPTSHARD_TORCH_READER", raising=False
            )
            for run in (
                lambda: consolidate(str(src), str(out_dir / "full.pt"), optimizer=True, progress=False),
                lambda: reshard(str(src), str(out_dir / "r"), 2, progress=False),
            ):
                try:
                    run()
                except CheckpointError as e:
                    assert str(e) and "\n" not in str(e)
                    assert list(out_dir.iterdir()) == [], f"{kind}: files left after an error"
                    continue
                # Accepted only where the lie changes nothing: a value moved into the padding that is zero.
                assert kind == "padding-lie", f"{kind}: accepted"
                got = torch.load(out_dir / "full.pt", weights_only=True)
                assert equal(got, reference(src, container)), f"{kind}: wrong output written"
                return

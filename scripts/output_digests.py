"""Every command's output on one checkpoint of each family, as the digests its manifests record.

Run it before and after a change that should not change what ckptshard writes, and diff the two:

    python scripts/output_digests.py FIXTURES OUT.json
    (git stash; python scripts/output_digests.py FIXTURES BEFORE.json; git stash pop)
    diff BEFORE.json OUT.json

FIXTURES: a folder of the test suite's fixture cache (``$TMPDIR/ckptshard-fixtures/<key>``), which holds the
real fairscale, FSDP2, HSDP and FSDP1 runs the tests build. Model parts are made here (synthetic, seeded).
A command that refuses is recorded with its one-line error, so a refusal that changes shows too.
"""

import glob
import json
import os
import sys
import tempfile

import ckptshard
from ckptshard.testing.synthetic import write_synthetic_parts

COMMANDS = {
    "consolidate.safetensors": lambda s, o: ckptshard.consolidate(s, o + "/full.safetensors", progress=False),
    "consolidate.pt+optim": lambda s, o: ckptshard.consolidate(s, o + "/full.pt", optimizer=True, progress=False),
    "consolidate.index": lambda s, o: ckptshard.consolidate(s, o + "/hf", max_shard_size=4096, progress=False),
    "reshard-2": lambda s, o: ckptshard.reshard(s, o + "/re", 2, progress=False),
    "reshard-1": lambda s, o: ckptshard.reshard(s, o + "/re1", 1, progress=False),
    "convert.dcp": lambda s, o: ckptshard.convert(s, o + "/c.dcp", to="dcp", progress=False),
    "dcp.consolidate": lambda s, o: ckptshard.consolidate(_dcp(s, o), o + "/dcp-full.pt", progress=False),
    "dcp.convert.torch": lambda s, o: ckptshard.convert(_dcp(s, o), o + "/dcp.pt", to="torch", progress=False),
}


def _dcp(src, out):
    path = out + "/src.dcp"
    if not os.path.exists(path):
        ckptshard.convert(src, path, to="dcp", progress=False)
    return path


def _one(pattern, fixtures):
    found = sorted(glob.glob(os.path.join(fixtures, pattern)))
    return found[0] if found else None


def sources(fixtures, tmp):
    parts = os.path.join(tmp, "parts")
    write_synthetic_parts(parts, 2, 2, 2, 8, optimizer=True)
    out = {
        "fairseq": _one("mixed-ws3/fairseq", fixtures),
        "metaseq": _one("mixed-ws3/metaseq", fixtures),
        "vissl": _one("mixed-ws3/vissl", fixtures),
        "fsdp2": _one("fsdp2-ws3-*", fixtures),
        "hsdp": _one("fsdp2-hsdp-2x2-*", fixtures),
        "fsdp1": _one("fsdp1-ws3-bf160-*", fixtures),
        "model-parts": parts,
    }
    return {k: v for k, v in out.items() if v}


def manifests(folder):
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "*manifest.json"), recursive=True)):
        with open(path) as f:
            files = json.load(f)["files"]
        rel = os.path.relpath(path, folder)
        found[rel] = files  # each file's size and digest
    return found


def main(fixtures, out_json):
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family, src in sources(fixtures, tmp).items():
            for name, run in COMMANDS.items():
                out = os.path.join(tmp, family, name)
                os.makedirs(out)
                try:
                    run(src, out)
                    results[f"{family} {name}"] = manifests(out)
                except ckptshard.CheckpointError as e:
                    results[f"{family} {name}"] = "refused: " + str(e).replace(tmp, "TMP").replace(src, "SRC")
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    print(f"{len(results)} outputs recorded in {out_json}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

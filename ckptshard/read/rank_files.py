"""torch FSDP per-rank files on disk: verl's layout (``model_/optim_/extra_state_world_size_W_rank_r.pt``
beside ``fsdp_config.json`` and ``huggingface/``) or one rank-numbered file per rank holding DTensors or
ShardedTensors; found, counted and read without torch (``read.torch_ranks`` opens and checks them)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..formats.torch_pickle import Unsupported
from ..osio.inputs import input_file
from ..tensors import DTensorRef
from ..tree import leaves
from .discover import find_shards
from .torch_file import read_torch_file

VERL_NAME = re.compile(r"^(?P<kind>model|optim|extra_state)_world_size_(?P<ws>\d+)_rank_(?P<rank>\d+)\.pt$")
FSDP_CONFIG = "fsdp_config.json"  # verl's: {"FSDP_version": 2, "world_size": W}


@dataclass(frozen=True)
class RankFiles:
    """The files of one per-rank checkpoint; index = rank. ``name_of(kind, rank, world)``: a file's name."""

    folder: str
    world_size: int
    model: Tuple[str, ...]
    optim: Optional[Tuple[str, ...]] = None
    extra: Optional[Tuple[str, ...]] = None
    verl: bool = True
    head: str = ""  # plain layout: the name around the rank number
    tail: str = ""

    def name_of(self, kind: str, rank: int, world: int) -> str:
        if self.verl:
            return f"{kind}_world_size_{world}_rank_{rank}.pt"
        return f"{self.head}{rank}{self.tail}"

    @property
    def paths(self) -> Tuple[str, ...]:
        return self.model + (self.optim or ()) + (self.extra or ())

    def carried(self) -> List[str]:
        """The folder's other entries (``fsdp_config.json``, ``huggingface/``...), by name: copied on reshard."""
        if not self.verl:
            return []
        return sorted(n for n in os.listdir(self.folder) if not VERL_NAME.match(n))

    def carried_files(self) -> List[Tuple[str, str]]:
        """Every file of :meth:`carried` entries as (path relative to the folder, path), in manifest order.

        Each must be a regular file or a link to one, and is recorded as an input (so a change while the
        output is written stops it): a link to ``/dev/zero`` would otherwise be copied until the disk is
        full. Checked before any byte is written."""
        out: List[Tuple[str, str]] = []
        for name in self.carried():
            path = os.path.join(self.folder, name)
            if not os.path.isdir(path):
                out.append((name, path))
                continue
            found = []
            for d, dirs, fs in os.walk(path):
                linked = next((x for x in dirs if os.path.islink(os.path.join(d, x))), None)
                if os.path.islink(path) or linked is not None:
                    where = path if os.path.islink(path) else os.path.join(d, linked or "")
                    raise CheckpointError(f"{where}: a link to a folder; copy the folder itself in its place")
                found += [os.path.join(d, f) for f in fs]
            out += sorted((os.path.relpath(p, self.folder), p) for p in found)
        for _, path in out:
            input_file(path)
        return out


def find_verl(src: str) -> Optional[RankFiles]:
    """verl's per-rank files in folder ``src`` (or the folder of one of them); None if it has none."""
    folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    if not os.path.isdir(src) and not VERL_NAME.match(os.path.basename(src)):
        return None
    found: Dict[str, Dict[int, Dict[int, str]]] = {}
    for name in sorted(os.listdir(folder)):
        m = VERL_NAME.match(name)
        if m:
            by_rank = found.setdefault(m["kind"], {}).setdefault(int(m["ws"]), {})
            twin = by_rank.setdefault(int(m["rank"]), name)
            if twin != name:  # rank_1 and rank_01: either could be taken
                raise CheckpointError(f"{folder}: rank {int(m['rank'])} is named twice: {twin} and {name}; keep one")
    if "model" not in found:
        return None
    sizes = sorted({ws for by_ws in found.values() for ws in by_ws})
    if len(sizes) > 1:
        raise CheckpointError(f"{folder}: files of several world sizes ({', '.join(map(str, sizes))}); keep one")
    world = sizes[0]
    kinds: Dict[str, Tuple[str, ...]] = {}
    for kind, by_ws in found.items():
        by_rank = by_ws[world]
        if len(by_rank) != world or max(by_rank) >= world:  # counted first: a name may claim 10**12 ranks
            missing = next((r for r in range(len(by_rank) + 1) if r not in by_rank), None)
            beyond = sorted(r for r in by_rank if r >= world)
            what = f"rank {beyond[0]} is beyond world size {world}" if beyond else f"rank {missing} is missing"
            raise CheckpointError(f"{folder}: {kind}_world_size_{world}_rank_*.pt: {what}")
        kinds[kind] = tuple(os.path.join(folder, by_rank[r]) for r in range(world))
    return RankFiles(folder, world, kinds["model"], kinds.get("optim"), kinds.get("extra_state"))


CONFIG_LIMIT = 1 << 20  # bytes of fsdp_config.json read at most: verl's is a few dozen


def read_fsdp_config(path: str) -> Any:
    """``fsdp_config.json``, as one line of error where it is no regular file, too long or not JSON."""
    if input_file(path).st_size > CONFIG_LIMIT:
        raise CheckpointError(f"{path}: larger than {CONFIG_LIMIT:,} bytes; not a verl fsdp_config.json")
    with open(path, "rb") as f:
        text = f.read(CONFIG_LIMIT + 1)
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else "not JSON"
        raise CheckpointError(f"{path}: {why}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: a JSON {type(config).__name__}, not the object verl writes")
    return config


def read_rank_file(path: str) -> Any:
    try:
        return read_torch_file(path)
    except Unsupported as e:
        raise CheckpointError(f"{path}: cannot read this per-rank file without torch ({e})") from None


def has_dtensors(tree: Any) -> bool:
    return any(isinstance(v, DTensorRef) for _, v in leaves(tree))


def find_torch_ranks(src: str) -> Optional[Tuple[RankFiles, List[Any]]]:
    """The per-rank files ``src`` names and their model trees, if they are torch FSDP's (DTensors or
    ShardedTensors); else None."""
    files = find_verl(src)
    if files is not None:
        return files, [read_rank_file(p) for p in files.model]
    if not os.path.exists(src):
        return None
    try:
        shards = find_shards(src)
        first = read_torch_file(shards.paths[0])
    except (CheckpointError, Unsupported):
        return None
    if not has_dtensors(first):
        return None
    folder, world = os.path.dirname(shards.paths[0]), len(shards.paths)
    files = RankFiles(folder, world, shards.paths, verl=False, head=shards.head, tail=shards.tail)
    return files, [first] + [read_rank_file(p) for p in shards.paths[1:]]

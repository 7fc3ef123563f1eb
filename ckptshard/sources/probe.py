"""What a checkpoint is: the one place every family is recognised, in one order, and opened.

A family that recognises its files but finds them damaged raises its own
error; nothing falls through to another family's. A folder that holds the
files of more than one checkpoint is refused, naming them, before any is
opened.
"""

from __future__ import annotations

import os
from typing import List, Optional, Union

from ..errors import CheckpointError
from ..formats.dcp_names import METADATA
from ..read.dcp_folder import is_dcp
from ..read.discover import group_by_rank
from ..read.full_state import full_state_refs
from ..read.model_parts import find_model_parts, open_model_parts
from ..read.rank_files import VERL_NAME
from ..read.source import open_checkpoint
from ..read.torch_ranks import open_torch_ranks_like
from .base import Source
from .fairscale import FairscaleSource
from .full_state import FullStateSource
from .model_parts import ModelPartsSource
from .torch_ranks import TorchRanksSource

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # a Hugging Face model folder whose weights fit one file (no index)
PathLike = Union[str, "os.PathLike[str]"]


def checkpoints_in(folder: str) -> List[str]:
    """The checkpoints whose files a folder holds, in words (one, none, or more: then it is refused)."""
    names = sorted(os.listdir(folder))
    files = [n for n in names if os.path.isfile(os.path.join(folder, n))]
    found = []
    if METADATA in files:
        found.append(f"a DCP checkpoint ({METADATA})")
    if any(VERL_NAME.match(n) for n in files):
        found.append("torch FSDP per-rank files (model_world_size_*_rank_*.pt)")
    shards = group_by_rank([n for n in files if not VERL_NAME.match(n)])
    if shards:
        found.append(f"shard files ({', '.join(f'{h}*{t}' for h, t in sorted(shards))})")
    if INDEX in files or SINGLE in files:
        found.append(f"a full state dict ({INDEX if INDEX in files else SINGLE})")
    return found


def open_source(
    src: PathLike,
    *,
    like: Optional[PathLike] = None,
    trust_pickles: bool = False,
    full: bool = False,
    torch_free: bool = True,
    like_option: str = "--like",
) -> Source:
    """Open the checkpoint ``src`` names, whatever its family; every file's pickle is read once, no tensor data.

    Args:
        src: a folder, one shard or rank file (its siblings are found), a VISSL shard_list file, a DCP folder;
            with ``full``, also a full state dict (.pt, .safetensors, or a folder with its safetensors index or a
            Hugging Face model folder's ``model.safetensors``).
        like: the model's full state dict, which FSDP1 LOCAL_STATE_DICT files need (their flat parameters do
            not say what they hold), and from which fairscale 0.3 shards' tied parameters are restored (their
            metadata does not record them); refused for any other family.
        trust_pickles: unpickle without the weights-only safety net (files you trust only).
        full: accept a full state dict (``verify``, ``load_checkpoint``); the commands that convert sharded
            checkpoints do not.
        torch_free: read the pickles without importing torch where the files allow.
        like_option: how the caller's option for ``like`` is named in errors.

    Returns:
        A :class:`~ckptshard.sources.base.Source`: ``kind``, ``world_size``, ``inputs``, ``describe()``,
        ``check()``, ``full_weights()``, ``full_optimizer()``, and the family's opened object.

    Raises:
        CheckpointError: no such path, a folder with files of several checkpoints, or the family's own error
            for damaged or inconsistent files.
    """
    path = os.fspath(src)
    like_path = os.fspath(like) if like is not None else None
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        found = checkpoints_in(path)
        if len(found) > 1:
            raise CheckpointError(
                f"{path}: holds the files of more than one checkpoint: {' and '.join(found)}; move one away"
            )
    if is_dcp(path):
        from .dcp import DcpSource  # DCP's modules are imported for DCP folders only

        if like_path is not None:
            raise CheckpointError(f"{path}: {like_option} is for FSDP1 LOCAL_STATE_DICT files, not a DCP folder")
        return DcpSource(path, trust_pickles)
    ranks = open_torch_ranks_like(path, like_path, trust_pickles, like_option)
    if ranks is not None:
        return TorchRanksSource(path, ranks)
    not_for = f"{path}: {like_option} is for FSDP1 LOCAL_STATE_DICT files and fairscale 0.3 shards, not these"
    parts = find_model_parts(path)
    if parts is not None:
        if like_path is not None:
            raise CheckpointError(not_for)
        return ModelPartsSource(path, parts, open_model_parts(parts, trust_pickles))
    index = os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX))
    if full and (index or path.endswith(".safetensors")):
        return _full_state(path, trust_pickles, torch_free)
    if full and os.path.isdir(path) and os.path.isfile(os.path.join(path, SINGLE)):
        return _full_state(os.path.join(path, SINGLE), trust_pickles, torch_free)
    try:
        ckpt = open_checkpoint(path, trust_pickles, torch_free=torch_free)
    except CheckpointError:
        if not (full and os.path.isfile(path)) or like_path is not None:
            raise
        # One file that is not a fairscale shard: a full state dict, or its own error says what it is not.
        return _full_state(path, trust_pickles, torch_free)
    if like_path is None:
        return FairscaleSource(path, ckpt)
    source = FairscaleSource(path, ckpt)
    if not source.legacy:  # 0.4 records its ties
        raise CheckpointError(not_for)
    return FairscaleSource(path, ckpt, full_state_refs(like_path, trust_pickles, torch_free), like_path)


def _full_state(path: str, trust_pickles: bool, torch_free: bool) -> FullStateSource:
    refs = full_state_refs(path, trust_pickles, torch_free)
    inputs = tuple(sorted({r.path for r in refs.values() if hasattr(r, "path")})) or (path,)
    return FullStateSource(path, refs, inputs)


def open_template(like: PathLike, trust_pickles: bool = False, torch_free: bool = True) -> FairscaleSource:
    """A fairscale checkpoint whose FSDP wrapping an output follows (``shard --like``, ``convert --to fairscale
    --like``): any other family is refused in one line."""
    source = open_source(like, trust_pickles=trust_pickles, torch_free=torch_free)
    if not isinstance(source, FairscaleSource):
        raise source.refuse("--like (the wrapping to follow)", "name a fairscale checkpoint of that wrapping")
    return source

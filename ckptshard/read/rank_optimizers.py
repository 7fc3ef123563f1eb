"""Optimizer files of every rank (and HSDP replica) checked to be of one step and run, as far as they tell."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Sequence, Tuple

from ..errors import CheckpointError
from ..tensors import DTensorRef, TensorRef
from .tensor_data import read_scalars


def _same_on_every_rank(v: Any) -> bool:
    """A value of a parameter's optimizer state that every rank holds alike: a 0-d tensor (Adam's ``step``) or
    anything that is not a tensor; moments are each rank's piece (a slice of one element is 1-d)."""
    if isinstance(v, TensorRef):
        return v.shape == ()
    return not isinstance(v, DTensorRef)


def _kind(v: Any) -> str:
    if isinstance(v, DTensorRef):
        return "a DTensor"
    if isinstance(v, TensorRef):
        return "a 0-d tensor" if v.shape == () else "a tensor"
    return f"a {type(v).__name__}"


def check_optimizers_agree(osds: Sequence[Mapping[str, Any]], paths: Sequence[str]) -> None:
    """Refuse optimizer files of different steps or runs, as far as the files tell: every file's
    param_groups (learning rate, betas... all but the ids), each parameter's state keys and the values every
    rank holds alike (Adam's ``step``) must agree with every other file's, and no state may belong to an id
    no group lists (it would be dropped from the output). Which step a model file is of, no file records
    (docs/errors.md)."""
    first, where = osds[0], paths[0]
    listed = {pid for g in first["param_groups"] for pid in g.get("params", ())}
    seen: Dict[Any, Tuple[Any, str]] = {}  # (pid,) -> its keys; (pid, key) -> its value, with the file

    def agree(key: Any, value: Any, path: str, what: str) -> None:
        first_value, first_path = seen.setdefault(key, (value, path))
        if first_value != value:
            raise CheckpointError(
                f"{path}: {what} is {value!r}, {os.path.basename(first_path)}'s is {first_value!r}: "
                "optimizer files of different steps or runs"
            )

    for osd, path in zip(osds, paths):
        for i, (g, g0) in enumerate(zip(osd["param_groups"], first["param_groups"])):
            key = next((k for k in sorted(set(g) | set(g0), key=str) if k != "params" and g.get(k) != g0.get(k)), None)
            if key is not None:
                raise CheckpointError(
                    f"{path}: param_groups[{i}].{key} is {g.get(key)!r}, {os.path.basename(where)} says "
                    f"{g0.get(key)!r}: optimizer files of different runs or steps"
                )
        stray = next((pid for pid in osd["state"] if pid not in listed), None)
        if stray is not None:
            raise CheckpointError(f"{path}: optimizer state for parameter id {stray!r}, which no param_group lists")
        alike = []
        for pid, entry in osd["state"].items():
            if not isinstance(entry, Mapping):
                raise CheckpointError(f"{path}: state[{pid}] is a {type(entry).__name__}, not a dict of state")
            agree((pid,), sorted(map(str, entry)), path, f"state[{pid}] keys")
            for k, v in entry.items():
                agree((pid, k, type), _kind(v), path, f"state[{pid}][{k!r}]")
            alike += [((pid, k), v) for k, v in entry.items() if _same_on_every_rank(v)]
        values = iter(read_scalars([v for _, v in alike if isinstance(v, TensorRef)]))
        for key, v in alike:
            agree(key, next(values) if isinstance(v, TensorRef) else v, path, f"state[{key[0]}][{key[1]!r}]")

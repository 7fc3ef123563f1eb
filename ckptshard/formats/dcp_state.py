"""How ``torch.distributed.checkpoint`` flattens a nested state dict into named entries, and back. No torch."""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Tuple

from ..errors import CheckpointError
from ..tensors import is_tensor

Path = Tuple[Any, ...]  # keys (str) and list positions (int) from the root


def flatten_state_dict(
    tree: Mapping[str, Any], is_leaf_tensor: Callable[[Any], bool] = is_tensor
) -> Tuple[Dict[str, Any], Dict[str, Path]]:
    """What ``torch.distributed.checkpoint``'s ``flatten_state_dict`` gives (torch >= 2.4), without torch.

    Mappings are walked; a list is walked only if it holds a tensor or a
    container that is walked, else it is one value (as are tuples). Names
    are the path joined by dots. Tested against torch's own.
    """
    flat: Dict[str, Any] = {}
    mapping: Dict[str, Path] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any((isinstance(v, (Mapping, list)) and not terminal(v)) or is_leaf_tensor(v) for v in value)

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(path + (str(k),), v)
        elif terminal(value):
            name = ".".join(map(str, path))
            if name in flat:
                raise CheckpointError(f"two entries flatten to the same DCP name {name!r}")
            flat[name], mapping[name] = value, path
        else:
            for i, v in enumerate(value):
                visit(path + (i,), v)

    for key, value in tree.items():
        visit((str(key),), value)
    return flat, mapping


def unflatten_state_dict(flat: Mapping[str, Any], mapping: Mapping[str, Path]) -> Dict[str, Any]:
    """The nested state dict back from ``flat`` and the planner's ``mapping`` (torch's ``unflatten_state_dict``).

    A str key makes a dict, an int a list, grown with None as needed.
    """
    nested: Dict[str, Any] = {}
    for name, value in flat.items():
        path = mapping[name]
        cur: Any = nested
        for prev, key in zip(path[:-1], path[1:]):
            fresh: Any = {} if type(key) is str else []
            if isinstance(cur, Mapping):
                cur = cur.setdefault(prev, fresh)
            else:
                cur.extend([None] * (prev + 1 - len(cur)))
                if cur[prev] is None:
                    cur[prev] = fresh
                cur = cur[prev]
        last = path[-1]
        if type(last) is int:
            cur.extend([None] * (last + 1 - len(cur)))
        cur[last] = value
    return nested

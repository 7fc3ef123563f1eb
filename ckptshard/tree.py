"""Small helpers over nested dict/list/tuple trees (checkpoint objects)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence, Tuple, Union

Key = Union[str, int]
Path = Tuple[Key, ...]


def get_path(obj: Any, path: Sequence[Key]) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def has_path(obj: Any, path: Sequence[Key]) -> bool:
    try:
        get_path(obj, path)
        return True
    except (KeyError, IndexError, TypeError):
        return False


def set_path(obj: Any, path: Sequence[Key], value: Any) -> None:
    get_path(obj, path[:-1])[path[-1]] = value


def copy_tree(obj: Any) -> Any:
    """A structural copy: containers are new, leaves are shared."""
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = copy_tree(v)
        return out
    if isinstance(obj, list):
        return [copy_tree(v) for v in obj]
    return obj


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = map_leaves(v, fn)
        return out
    if isinstance(obj, list):
        return [map_leaves(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields") and type(obj) is tuple:
        return tuple(map_leaves(v, fn) for v in obj)
    return fn(obj)


def leaves(obj: Any, path: Path = ()) -> Iterator[Tuple[Path, Any]]:
    """Every leaf with its path, depth first, in container order."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,))
    else:
        yield path, obj

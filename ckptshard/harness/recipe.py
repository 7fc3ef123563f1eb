"""Recipes: the user's model, wrapping, optimizer and data, as verify-resume runs them.

A recipe is any object with the members of :class:`Recipe`. It is named by
a spec, ``package.module:NAME`` or ``path/to/file.py:NAME``, that every
spawned rank imports again; objects handed to the Python API travel to the
ranks pickled instead.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import CheckpointError

REQUIRED = ("build_model", "wrap", "make_optimizer", "batch", "loss")
CONTAINERS = ("fairseq", "metaseq", "vissl")


class Recipe:
    """The members verify-resume calls; subclassing is optional, having them is not.

    Required:
        build_model(): the plain, unwrapped model; called on every rank after the same seed.
        wrap(model): the FSDP wrapping (fairscale ``FullyShardedDataParallel`` or torch ``fully_shard``);
            returns the root.
        make_optimizer(root): the optimizer over the root's parameters.
        batch(step, rank, world_size): this rank's share of global batch ``step``. The global batch of a
            step must not depend on the world size: runs at different world sizes are compared.
        loss(root, batch): this rank's loss; FSDP averages the gradients over ranks.

    Optional:
        make_scheduler(optimizer): an LR scheduler, stepped after every optimizer step and saved.
        heads: names of head modules; enables the consolidated, loaded before/after wrapping scenarios.
        container: ``"fairseq"`` (default), ``"metaseq"`` or ``"vissl"`` (a model with VISSL's ``trunk`` and
            ``heads``, each FSDP-wrapped): the files fairscale runs save.
        tolerance: relative tolerance across world sizes (default 1e-5).
    """

    heads: Sequence[str] = ()
    container: str = "fairseq"
    tolerance: float = 1e-5


@dataclass(frozen=True)
class RecipeRef:
    """How a rank gets the recipe: a spec it imports, or the pickled object."""

    label: str
    spec: Optional[str] = None
    pickled: Optional[bytes] = None

    def load(self) -> Any:
        return load_spec(self.spec) if self.spec is not None else pickle.loads(self.pickled or b"")


def load_spec(spec: str) -> Any:
    """``pkg.module:NAME`` or ``path/to/file.py:NAME`` -> the object, its members checked."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise CheckpointError(f"--recipe {spec!r}: expected package.module:NAME or path/to/file.py:NAME")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise CheckpointError(f"--recipe {spec!r}: no file {where}")
        module = _module_from_file(where)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise CheckpointError(f"--recipe {spec!r}: cannot import {where}: {e}") from None
    if not hasattr(module, name):
        raise CheckpointError(f"--recipe {spec!r}: {where} defines no {name}")
    return check_members(getattr(module, name), spec)


def _module_from_file(path: str) -> Any:
    """Import a recipe file under a name of its own (its folder first on sys.path, for its own imports)."""
    path = os.path.abspath(path)
    name = "ckptshard_recipe_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise CheckpointError(f"--recipe {path}: importing it failed: {type(e).__name__}: {e}") from None
    return module


def check_members(recipe: Any, label: str) -> Any:
    missing = [m for m in REQUIRED if not callable(getattr(recipe, m, None))]
    if missing:
        raise CheckpointError(
            f"recipe {label}: no {', '.join(missing)} (a recipe needs {', '.join(REQUIRED)}; docs/recipes.md)"
        )
    container = getattr(recipe, "container", "fairseq")
    if container not in CONTAINERS:
        raise CheckpointError(f"recipe {label}: container {container!r}: one of {', '.join(CONTAINERS)}")
    heads = getattr(recipe, "heads", ())
    if isinstance(heads, str) or not all(isinstance(h, str) for h in heads):
        raise CheckpointError(f"recipe {label}: heads must be a list of module names, got {heads!r}")
    tol = getattr(recipe, "tolerance", 1e-5)
    if not isinstance(tol, (int, float)) or not 0 <= tol < 1:
        raise CheckpointError(f"recipe {label}: tolerance must be a number in [0, 1), got {tol!r}")
    return recipe


def recipe_ref(recipe: Union[str, Any]) -> Tuple[RecipeRef, Any]:
    """A spec or an object -> (how ranks get it, the object here)."""
    if isinstance(recipe, str):
        return RecipeRef(recipe, spec=recipe), load_spec(recipe)
    label = getattr(recipe, "__name__", None) or type(recipe).__name__
    check_members(recipe, label)
    try:
        blob = pickle.dumps(recipe)
    except Exception as e:
        raise CheckpointError(
            f"recipe {label}: cannot be sent to the ranks ({e}); define it at module level of an importable "
            "module, or pass its spec 'path/to/file.py:NAME'"
        ) from None
    return RecipeRef(label, pickled=blob), recipe


def _leaves(x: Any, where: str = "batch") -> List[Tuple[str, Any]]:
    if isinstance(x, torch.Tensor):
        return [(where, x)]
    if isinstance(x, dict):
        return [leaf for k in x for leaf in _leaves(x[k], f"{where}[{k!r}]")]
    if isinstance(x, (list, tuple)):
        return [leaf for i, v in enumerate(x) for leaf in _leaves(v, f"{where}[{i}]")]
    return [(where, x)]


def check_global_batch(recipe: Any, label: str, world_sizes: Sequence[int], step: int = 0) -> None:
    """The global batch of ``step`` (every rank's share, concatenated) must be the same at every world size."""
    reference: Optional[List[Tuple[str, Any]]] = None
    for ws in sorted(set(world_sizes) | {1}):
        shares = [_leaves(recipe.batch(step, r, ws)) for r in range(ws)]
        if any(len(s) != len(shares[0]) or [w for w, _ in s] != [w for w, _ in shares[0]] for s in shares):
            raise CheckpointError(f"recipe {label}: batch() returns differently shaped batches across ranks at {ws}")
        merged = []
        for i, (where, first) in enumerate(shares[0]):
            parts = [s[i][1] for s in shares]
            if isinstance(first, torch.Tensor):
                value: Any = torch.cat([p.reshape(p.shape or (1,)) for p in parts]) if first.dim() else parts[0]
            else:
                value = parts[0]
            merged.append((where, value))
        if reference is None:
            reference = merged
            continue
        for (where, a), (_, b) in zip(reference, merged):
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
            if not same:
                shape = f"{list(a.shape)} vs {list(b.shape)}" if isinstance(a, torch.Tensor) else f"{a!r} vs {b!r}"
                raise CheckpointError(
                    f"recipe {label}: batch() depends on the world size: {where} of step {step}, all ranks "
                    f"together, differs at world size {ws} from world size 1 ({shape}); a step's global batch "
                    "must not depend on the world size"
                )


def to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


def tensor_digests(module: torch.nn.Module) -> Dict[str, str]:
    """Name -> digest of the bytes of every parameter and buffer (non-persistent ones included)."""
    out = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        data = (
            t.detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes()
        )  # a copy: numpy pins storage
        out[name] = hashlib.sha1(data).hexdigest() + str(t.dtype)
    return out

"""FSDP1 LOCAL_STATE_DICT files: each FSDP unit's padded flat parameter, read with the model's full state dict
(``--like``), which says what each holds."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..errors import CheckpointError
from ..tensors import Fill, TensorRef, sources_in, whole
from .rank_pieces import assemble, is_slice, rank_slices
from .tensor_data import repeated_values


def flat_prefix(name: str) -> Optional[str]:
    """``blocks.0.`` for ``blocks.0._flat_param`` (an FSDP1 unit's flat parameter), ``""`` for the root's."""
    head, _, last = name.rpartition(".")
    return (head + "." if head else "") if last in ("_flat_param", "flat_param") else None


class LocalStateDict:
    """FSDP1's LOCAL_STATE_DICT files read with the model's full state dict ``like`` (names, shapes, ties).

    Each unit's flat parameter is stored as rank-sized chunks (a ShardedTensor). Under ``use_orig_params``
    the files also hold each original parameter's 1-D slice on that rank: joined in rank order they are the
    parameter, whatever the flat layout. Without it, the parameters are cut from the flat parameters as FSDP1
    lays them out: each unit's parameters (those under its module and no deeper unit) in ``like``'s order, a
    tie once, no padding between them; each unit's size is checked.
    """

    def __init__(self, models: List[Dict[str, Any]], like: Dict[str, TensorRef], where: str, ordered: bool) -> None:
        self.models, self.like, self.where, self.ordered = models, like, where, ordered
        first = models[0]
        unknown = next((k for k in first if flat_prefix(k) is None and k not in like), None)
        if unknown is not None:
            raise CheckpointError(f"{where}: holds {unknown}, which --like lacks: not the same model")
        self.flats = {flat_prefix(k): assemble([sd[k] for sd in models]) for k in first if flat_prefix(k) is not None}

    def _slices(self, name: str, ref: TensorRef) -> Optional[Fill]:
        """The parameter joined from each rank's 1-D slice (``use_orig_params``), or None if not stored so."""
        pieces = [sd.get(name) for sd in self.models]
        if not all(is_slice(p) for p in pieces):
            return None
        sources, count = rank_slices(pieces)
        if count != ref.numel:
            return None
        return Fill(tuple(ref.shape), pieces[0].dtype, tuple(sources.values()))

    def full_model(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        flat_params: List[str] = []
        for name, ref in self.like.items():
            v0 = self.models[0].get(name)
            joined = self._slices(name, ref)
            if joined is not None:
                out[name] = joined
            elif isinstance(v0, TensorRef) and tuple(v0.shape) == tuple(ref.shape):
                out[name] = whole(v0)  # a buffer: whole on every rank, rank 0's as FSDP1's full state dict
            elif v0 is None:
                flat_params.append(name)
            else:
                raise CheckpointError(
                    f"{self.where}: {name} is stored as {list(v0.shape)}, --like has {list(ref.shape)}: "
                    "not the same model"
                )
        out.update(self._cut(flat_params))
        # The model's order: like's if it keeps it, else the files' (each name there under use_orig_params).
        order = list(self.like) if self.ordered else [k for k in self.models[0] if flat_prefix(k) is None]
        return {name: out[name] for name in order + [n for n in self.like if n not in order]}

    @property
    def orig_params(self) -> bool:
        """Saved with ``use_orig_params=True``: each parameter's rank slice is in the files beside the flat
        parameters."""
        return any(name in self.models[0] for name in self.param_names())

    def param_names(self) -> List[str]:
        """The parameters, in ``like``'s order: the names stored as rank slices or only in a flat parameter
        (the others are buffers, whole on every rank)."""
        out = []
        for name, ref in self.like.items():
            v0 = self.models[0].get(name)
            if v0 is None or self._slices(name, ref) is not None:
                out.append(name)
        return out

    def units(self) -> Dict[str, Tuple[List[str], Dict[str, str]]]:
        """Each flat parameter's prefix -> the parameters it holds in flat order (a tie once), and the tie's
        other names -> the name stored. Under ``use_orig_params`` a tie's names are views of one place in every
        rank's file; without it, ties are told by ``like``'s values and the flat parameter's size."""
        prefixes = sorted(self.flats, key=len, reverse=True)
        members: Dict[str, List[str]] = {p: [] for p in self.flats}
        for name in self.param_names():
            unit = next((p for p in prefixes if name.startswith(p)), None)
            if unit is None:
                raise CheckpointError(f"{self.where}: {name} is under no FSDP unit's flat parameter")
            members[unit].append(name)
        out: Dict[str, Tuple[List[str], Dict[str, str]]] = {}
        for unit, names in members.items():
            if all(n in self.models[0] for n in names):  # rank slices: a tie is the same bytes on every rank
                seen: Dict[Any, str] = {}
                twins: Dict[str, str] = {}
                for n in names:
                    key = tuple((sd[n].offset, sd[n].numel) for sd in self.models)
                    if sum(sd[n].numel for sd in self.models) and key in seen:
                        twins[n] = seen[key]
                    else:
                        seen.setdefault(key, n)
                out[unit] = ([n for n in names if n not in twins], twins)
            else:
                out[unit] = self._untied(names, self.flats[unit].numel)
        return out

    def _cut(self, names: List[str]) -> Dict[str, Fill]:
        """``names`` (in ``like``'s order) cut from the flat parameters."""
        if names and not self.ordered:
            raise CheckpointError(
                f"{self.where}: {names[0]} is only in a flat parameter, laid out in the model's parameter order, "
                "and a safetensors --like lists names sorted: pass a torch.save state dict of the model "
                "(model.state_dict(), or FSDP1's FULL_STATE_DICT)"
            )
        prefixes = sorted(self.flats, key=len, reverse=True)
        units: Dict[str, List[str]] = {}
        for name in names:
            unit = next((p for p in prefixes if name.startswith(p)), None)
            if unit is None:
                raise CheckpointError(f"{self.where}: {name} is under no FSDP unit's flat parameter")
            units.setdefault(unit, []).append(name)
        out: Dict[str, Fill] = {}
        for unit, members in units.items():
            flat = self.flats[unit]
            stored, twins = self._untied(members, flat.numel)
            at = 0
            for name in stored:
                ref = self.like[name]
                out[name] = Fill(tuple(ref.shape), flat.dtype, sources_in(flat, at, at + ref.numel))
                at += ref.numel
            for name, twin in twins.items():
                out[name] = out[twin]
        return out

    def _untied(self, members: List[str], size: int) -> Tuple[List[str], Dict[str, str]]:
        """The unit's parameters stored in its flat parameter of ``size`` elements, and the ties left out
        (a later name whose values in ``like`` equal an earlier one's, taken as a tie if the sizes say so)."""
        total = sum(self.like[n].numel for n in members)
        if total == size:
            return members, {}
        twins = repeated_values([(n, whole(self.like[n])) for n in members])
        if total - sum(self.like[n].numel for n in twins) != size:
            unit = next(iter(members))
            raise CheckpointError(
                f"{self.where}: the FSDP unit holding {unit} has {size} elements in its flat parameter, and the "
                f"parameters --like puts there {total}: not the same model or wrapping"
            )
        return [n for n in members if n not in twins], twins

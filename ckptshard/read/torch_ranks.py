"""torch FSDP per-rank files opened: each rank's ``model.state_dict()`` (FSDP2's DTensors, HSDP's on a 2-D
mesh, FSDP1's ShardedTensors, or plain tensors at one rank) and optimizer state.

The files are found by ``rank_files`` (verl's layout, or one rank-numbered
file per rank); FSDP1's LOCAL_STATE_DICT flat parameters are read by
``fsdp1_local``, the optimizer files checked to agree by ``rank_optimizers``,
the pieces joined by ``rank_pieces``. Every file is read by the torch-free reader (no process group, no model
code); DTensors become :class:`~ckptshard.tensors.DTensorRef`. Everything the
conversions rely on is checked here, before any output is planned: every
rank present once, one world size, the same names, shapes, dtypes and
placements on every rank, and each rank's piece the size FSDP2 cuts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import CheckpointError
from ..layout.dim_shards import chunk_sizes, local_shape
from ..layout.param_order import match_in_order
from ..osio.inputs import input_file
from ..tensors import DTensorRef, Fill, TensorRef, numel, sources_in, whole
from ..tree import map_leaves
from .fsdp1_local import LocalStateDict, flat_prefix
from .full_state import full_state_refs, keeps_model_order
from .rank_files import RankFiles, find_torch_ranks, has_dtensors, read_rank_file
from .rank_optimizers import check_optimizers_agree
from .rank_pieces import assemble, is_slice, rank_slices
from .tensor_data import repeated_values


def _model_dict(tree: Any, path: str) -> Dict[str, Any]:
    if not isinstance(tree, Mapping) or not all(isinstance(k, str) for k in tree):
        raise CheckpointError(f"{path}: not a state dict (name -> tensor)")
    return dict(tree)


def _unplaced(path: str, name: str, piece: DTensorRef) -> CheckpointError:
    return CheckpointError(
        f"{path}: {name} is placed {piece.placements} on its device mesh; ckptshard reads FSDP2's "
        "one-dimensional Shard(dim) and Replicate() placements, and HSDP's (Replicate(), Shard(dim)) on a "
        "2-D mesh (not tensor parallel or partial sums)"
    )


def _check_piece(name: str, piece: DTensorRef, rank: int, world: int, path: str) -> None:
    if len(piece.placements) != 1 or piece.placements[0][0] not in ("shard", "replicate"):
        raise _unplaced(path, name, piece)
    if piece.coordinate is not None and piece.coordinate != (rank,):
        raise CheckpointError(f"{path}: holds {name} of mesh rank {piece.coordinate[0]}, not of rank {rank}")
    kind, dim = piece.placements[0]
    if kind == "shard":
        if not 0 <= dim < len(piece.shape):
            raise CheckpointError(f"{path}: {name} is sharded on dim {dim} of a {len(piece.shape)}-dim tensor")
        want = local_shape(piece.shape, dim, chunk_sizes(piece.shape[dim], world)[rank])
    else:
        want = piece.shape
    if tuple(piece.local.shape) != want:
        raise CheckpointError(
            f"{path}: {name}'s piece on rank {rank} has shape {tuple(piece.local.shape)}; FSDP2 at world size "
            f"{world} gives it {want}"
        )
    if piece.local.numel and not piece.local.contiguous:
        raise CheckpointError(f"{path}: {name}'s local tensor is not contiguous")


def _is_hsdp(piece: DTensorRef) -> bool:
    """HSDP's placement: replicated over the mesh's first dimension, sharded over its second."""
    kinds = tuple(kind for kind, _ in piece.placements)
    return kinds == ("replicate", "shard") and piece.coordinate is not None and len(piece.coordinate) == 2


def hsdp_replica(models: Sequence[Mapping[str, Any]], paths: Sequence[str]) -> Optional[Tuple[int, int, List[int]]]:
    """HSDP's files (FSDP2 on a 2-D mesh of replicas x shards, verl's ``fsdp_size``): the replica count,
    the shard count, and the ranks holding replica 0's shards in order; None for a 1-D mesh. Every rank's
    DTensors must be HSDP's, all at one coordinate, and the coordinates one full mesh."""
    coords: List[Tuple[int, ...]] = []
    for sd, path in zip(models, paths):
        pieces = [(k, v) for k, v in sd.items() if isinstance(v, DTensorRef)]
        if not any(len(v.placements) == 2 for _, v in pieces):
            if coords:
                raise CheckpointError(f"{path}: holds no HSDP DTensor, and {paths[0]} does: not one checkpoint")
            return None
        for k, v in pieces:
            if not _is_hsdp(v):
                raise _unplaced(path, k, v)
        at = {v.coordinate for _, v in pieces}
        if len(at) != 1:
            raise CheckpointError(f"{path}: holds DTensors of mesh coordinates {sorted(at)}: one rank's file has one")
        coords.append(at.pop())  # type: ignore[arg-type]
    replicas, shards = 1 + max(c[0] for c in coords), 1 + max(c[1] for c in coords)
    if replicas * shards != len(models) or len(set(coords)) != len(coords):
        raise CheckpointError(
            f"{paths[0]}: the files' mesh coordinates {sorted(coords)} are not one {replicas} x {shards} mesh "
            f"of {len(models)} ranks (a rank missing or twice)"
        )
    return replicas, shards, [coords.index((0, s)) for s in range(shards)]


def _shard_piece(x: Any) -> Any:
    """An HSDP DTensor as the FSDP2 piece it is within its replica: sharded on the mesh's second dimension."""
    if isinstance(x, DTensorRef) and len(x.placements) == 2:
        return replace(x, placements=x.placements[1:], coordinate=x.coordinate[1:])  # type: ignore[index]
    return x


class TorchRanks:
    """An opened per-rank torch FSDP checkpoint: its files and each rank's model (and optimizer) state.

    ``kind``: ``"fsdp2"`` (DTensors) or ``"fsdp1"`` (FSDP1's SHARDED_STATE_DICT: ShardedTensors, read
    as the DTensors they amount to). FSDP1's optimizer files (``optimizer.state_dict()`` under
    ``use_orig_params=True``) hold each rank's slice of every parameter's moments: joined in rank order.
    """

    def __init__(
        self,
        files: RankFiles,
        models: List[Any],
        like: Optional[Mapping[str, TensorRef]] = None,
        like_ordered: bool = True,
    ) -> None:
        self.files = files
        self.world_size = files.world_size
        self.models = [_model_dict(t, p) for t, p in zip(models, files.model)]
        # HSDP: replica 0's files are the checkpoint, an FSDP2 one of its shard count (the others replicate it)
        self.hsdp: Optional[Tuple[int, int]] = None
        self.model_paths, self.optim_paths = list(files.model), list(files.optim or ())
        replica = hsdp_replica(self.models, files.model)
        if replica is not None:
            replicas, self.world_size, order = replica
            self.hsdp = (replicas, self.world_size)
            self.models = [map_leaves(self.models[r], _shard_piece) for r in order]
            self.model_paths = [files.model[r] for r in order]
            self.optim_paths = [self.optim_paths[r] for r in order] if files.optim else []
        kinds = [{v.sharded_tensor for v in sd.values() if isinstance(v, DTensorRef)} for sd in self.models]
        if any(len(k) > 1 for k in kinds) or len(set().union(*kinds)) > 1:
            bad = next(p for p, k in zip(files.model, kinds) if k != kinds[0])
            raise CheckpointError(f"{bad}: FSDP1 (ShardedTensor) and FSDP2 (DTensor) files mixed in one checkpoint")
        flat = next((k for k in self.models[0] if flat_prefix(k) is not None), None)
        # FSDP1 at world size 1 runs NO_SHARD: every entry a plain tensor, parameters and buffers alike.
        self.no_shard = files.verl and self.world_size == 1 and flat is None and not has_dtensors(self.models[0])
        self.kind = "fsdp1" if True in kinds[0] or self.no_shard else "fsdp2"
        self.local: Optional[LocalStateDict] = None
        self.flat = flat  # FSDP1 LOCAL_STATE_DICT: a unit's flat parameter's name
        if flat is not None and like is not None:
            self.local = LocalStateDict(self.models, dict(like), files.model[0], like_ordered)
        self._check_models()
        self.optims = None
        if files.optim:
            read = {p: self._optim(p) for p in files.optim}  # HSDP: every replica's, compared below
            self.optims = [map_leaves(read[p], _shard_piece) for p in self.optim_paths]
            self._check_optims()
            check_optimizers_agree(list(read.values()), list(read))
        self.params_known = not self.no_shard
        self._no_shard_error: Optional[CheckpointError] = None  # kept for what needs the parameters told
        if self.no_shard and self.optims is not None:
            try:
                self._mark_no_shard_params()
            except CheckpointError as e:
                self._no_shard_error = e

    def _check_models(self) -> None:
        first, W = self.models[0], self.world_size
        if self.no_shard and not any(isinstance(v, TensorRef) for v in first.values()):
            raise CheckpointError(f"{self.files.model[0]}: holds no tensor: not a model's state dict")
        if not has_dtensors(first) and not self.no_shard:
            raise CheckpointError(f"{self.files.model[0]}: holds no DTensor: not a torch FSDP2 per-rank state dict")
        for r, (sd, path) in enumerate(zip(self.models, self.model_paths)):
            if list(sd) != list(first):
                extra = next((k for k in sd if k not in first), None)
                gone = next((k for k in first if k not in sd), None)
                what = f"has {extra}, which rank 0 lacks" if extra else f"lacks {gone}" if gone else "orders names"
                raise CheckpointError(f"{path}: {what} (every rank's file must name the same tensors)")
            for name, v in sd.items():
                v0 = first[name]
                if isinstance(v, DTensorRef):
                    if not isinstance(v0, DTensorRef) or (v.shape, str(v.dtype), v.placements) != (
                        v0.shape,
                        str(v0.dtype),
                        v0.placements,
                    ):
                        raise CheckpointError(f"{path}: {name} differs from rank 0's (shape, dtype or placement)")
                    _check_piece(name, v, r, W, path)
                elif (
                    isinstance(v, TensorRef)
                    and self.flat is None  # LOCAL_STATE_DICT: each rank's slice of an original parameter
                    and (not isinstance(v0, TensorRef) or (v.shape, str(v.dtype)) != (v0.shape, str(v0.dtype)))
                ):
                    raise CheckpointError(f"{path}: {name} differs from rank 0's in shape or dtype")

    def _optim(self, path: str) -> Dict[str, Any]:
        osd = read_rank_file(path)
        if not (isinstance(osd, Mapping) and isinstance(osd.get("state"), Mapping) and "param_groups" in osd):
            raise CheckpointError(f"{path}: not an optimizer state_dict() (state, param_groups)")
        return dict(osd)

    def _check_optims(self) -> None:
        assert self.optims is not None
        first = self.optims[0]
        for r, (osd, path) in enumerate(zip(self.optims, self.optim_paths)):
            # FSDP1 keeps no state for a parameter with no elements on a rank: its entries may differ by rank.
            if self.kind == "fsdp2" and set(osd["state"]) != set(first["state"]):
                raise CheckpointError(f"{path}: optimizer state of other parameters than rank 0's")
            if len(osd["param_groups"]) != len(first["param_groups"]) or any(
                g.get("params") != g0.get("params") for g, g0 in zip(osd["param_groups"], first["param_groups"])
            ):
                raise CheckpointError(f"{path}: param_groups differ from rank 0's")
            if self.kind == "fsdp1":
                continue
            for pid, entry in osd["state"].items():
                for k, v in entry.items():
                    if isinstance(v, DTensorRef):
                        _check_piece(f"state[{pid}][{k}]", v, r, self.world_size, path)

    def param_names(self) -> List[str]:
        """Parameter names in ``model.parameters()`` order: the DTensors of the state dict, a tie once."""
        names, seen = [], set()
        for name, v in self.models[0].items():
            if isinstance(v, DTensorRef):
                key = v.tie_key or name
                if key not in seen:
                    seen.add(key)
                    names.append(name)
        return names

    def full_model(self) -> Dict[str, Any]:
        """Every name's whole tensor as a Fill (a tie is one Fill); plain tensors and values from rank 0."""
        self.require_like()
        if self.local is not None:
            return self.local.full_model()
        out: Dict[str, Any] = {}
        tied: Dict[Any, Fill] = {}
        for name, v in self.models[0].items():
            if isinstance(v, DTensorRef):
                key = v.tie_key or name
                if key not in tied:
                    tied[key] = assemble([sd[name] for sd in self.models])
                out[name] = tied[key]
            elif isinstance(v, TensorRef):
                out[name] = whole(v)  # a buffer: every rank holds it whole; FSDP2's full state dict takes rank 0's
            else:
                out[name] = v
        return out

    def optimizer_ids(self) -> List[Tuple[int, str]]:
        """(optimizer id, parameter name) in param_groups order, checked against each moment's shape. Beside
        LOCAL_STATE_DICT files without ``use_orig_params`` the optimizer's parameters are the units' flat
        parameters: (id, flat parameter's name)."""
        if self.optims is None:
            raise CheckpointError(f"{self.files.folder}: no optimizer files (optim_world_size_*_rank_*.pt)")
        if self.flat is not None:
            return self._local_ids()
        if self.no_shard:
            self.require_params()
            return self._no_shard_ids
        ids = [pid for g in self.optims[0]["param_groups"] for pid in g["params"]]
        names = self.param_names()
        where = (self.files.optim or ("",))[0]
        hint = ""
        if self.kind == "fsdp1" and len(ids) < len(names):
            twins = self._fsdp1_twins(names)
            if len(names) - len(twins) == len(ids):
                names = [n for n in names if n not in twins]
            else:
                hint = (
                    f" (FSDP1's files record no ties: {len(twins)} name(s) repeat an earlier one's values"
                    f"{': ' + ', '.join(twins) if twins else ''}; and FSDP1 without use_orig_params keeps one flat "
                    "parameter per FSDP unit, whose contents are recorded nowhere: save with use_orig_params=True, "
                    "or the optimizer through FSDP.optim_state_dict)"
                )
        if len(ids) != len(names):
            raise CheckpointError(
                f"{where}: the optimizer holds {len(ids)} parameters and the model {len(names)}: "
                f"they cannot be matched by order{hint}"
            )
        pairs = list(zip(ids, names))
        if self.kind == "fsdp1":
            return pairs  # the slices' sizes are checked as they are joined
        model = self.models[0]
        for pid, name in pairs:
            for k, v in self.optims[0]["state"].get(pid, {}).items():
                if isinstance(v, DTensorRef) and v.shape != model[name].shape:
                    raise CheckpointError(
                        f"{where}: optimizer entry {pid}'s {k} has shape {v.shape}, parameter {name} "
                        f"{model[name].shape}: the optimizer's parameters are not the model's in order"
                    )
        return pairs

    def _local_ids(self) -> List[Tuple[int, str]]:
        """LOCAL_STATE_DICT's optimizer: one entry per parameter (a tie once) under ``use_orig_params``, else
        one per flat parameter, in the files' order; the count checked."""
        assert self.optims is not None
        self.require_like()
        assert self.local is not None
        ids = [pid for g in self.optims[0]["param_groups"] for pid in g["params"]]
        if self.local.orig_params:
            twins = {t for _, tied in self.local.units().values() for t in tied}
            params = set(self.local.param_names()) - twins
            names = [k for k in self.models[0] if k in params]  # the files' order: like's may be sorted
            what = "parameters (use_orig_params)"
        else:
            names = [k for k in self.models[0] if flat_prefix(k) is not None]
            what = "flat parameters (FSDP units without use_orig_params)"
        if len(ids) != len(names):
            raise CheckpointError(
                f"{self.files.optim[0]}: the optimizer holds {len(ids)} parameters and the files {len(names)} "  # type: ignore[index]
                f"{what}: not these files' optimizer"
            )
        return list(zip(ids, names))

    def param_shape(self, name: str) -> Tuple[int, ...]:
        """A parameter's whole shape: the model file's, or ``like``'s for LOCAL_STATE_DICT (whose files hold
        rank slices)."""
        if self.local is not None:
            return tuple(self.local.like[name].shape)
        return tuple(self.models[0][name].shape)

    def full_optimizer(self) -> Dict[str, Any]:
        """As ``get_optimizer_state_dict(model, optim, full_state_dict=True)`` gives it: keyed by name."""
        pairs = self.optimizer_ids()  # refuses where there is none to read
        assert self.optims is not None
        if self.local is not None and not self.local.orig_params:
            return self._local_flat_optimizer(pairs)
        name_of = dict(pairs)
        state: Dict[str, Dict[str, Any]] = {}
        for pid, name in pairs:
            if self.kind == "fsdp1":
                joined = self.fsdp1_entry(pid, name)
                if joined is not None:
                    state[name] = joined
                continue
            entry = self.optims[0]["state"].get(pid)
            if entry is None:
                continue
            state[name] = {
                k: assemble([o["state"][pid][k] for o in self.optims])
                if isinstance(v, DTensorRef)
                else whole(v)
                if isinstance(v, TensorRef)
                else v
                for k, v in entry.items()
            }
        groups = []
        for g in self.optims[0]["param_groups"]:
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": [name_of[p] for p in g["params"]]}
            )
        if self.kind == "fsdp1":  # as torch orders FSDP1's full optimizer state: by name
            state = dict(sorted(state.items()))
        return {"state": state, "param_groups": groups}

    def flat_moments(self, pid: int, key: str) -> Dict[str, Any]:
        """A flat parameter's optimizer state (without ``use_orig_params``): each moment joined from the ranks'
        padded shards, in flat order; ``step`` and other values rank 0's."""
        assert self.optims is not None
        where = self.files.optim[0]  # type: ignore[index]
        held = [o["state"].get(pid) for o in self.optims]
        if not all(held):
            raise CheckpointError(f"{where}: optimizer entry {pid} ({key}) is missing on some ranks")
        out: Dict[str, Any] = {}
        for name, v0 in held[0].items():  # type: ignore[union-attr]
            if not isinstance(v0, TensorRef) or not v0.shape:
                out[name] = whole(v0) if isinstance(v0, TensorRef) else v0
                continue
            pieces = [h.get(name) for h in held]  # type: ignore[union-attr]
            if not all(is_slice(p) and p.numel == v0.numel and str(p.dtype) == str(v0.dtype) for p in pieces):
                raise CheckpointError(
                    f"{where}: optimizer entry {pid} ({key})'s {name} is not one equal 1-D shard per rank: not "
                    "the state of an FSDP1 flat parameter"
                )
            sources, count = rank_slices(pieces)
            out[name] = Fill((count,), v0.dtype, tuple(sources.values()))
        return out

    def _local_flat_optimizer(self, pairs: List[Tuple[int, str]]) -> Dict[str, Any]:
        """Without ``use_orig_params``: each flat parameter's moments cut into its parameters, as the flat
        parameter itself is cut (end to end, a tie once); ``step`` to each. Keys sorted, as torch's full
        optimizer state has them."""
        assert self.optims is not None and self.local is not None
        units = self.local.units()
        state: Dict[str, Dict[str, Any]] = {}
        members: Dict[int, List[str]] = {}
        for pid, key in pairs:
            names, _ = units[flat_prefix(key)]  # type: ignore[index]
            moments = self.flat_moments(pid, key)
            members[pid] = names
            at = 0
            for name in names:
                n = numel(self.param_shape(name))
                # a Fill apiece, step too: one tensor shared by two parameters' states would be stepped twice
                state[name] = {
                    k: Fill(self.param_shape(name), v.dtype, sources_in(v, at, at + n))
                    if isinstance(v, Fill) and v.shape
                    else Fill(v.shape, v.dtype, v.sources)
                    if isinstance(v, Fill)
                    else v
                    for k, v in sorted(moments.items())
                }
                at += n
            if any(isinstance(v, Fill) and v.shape and v.numel < at for v in moments.values()):
                raise CheckpointError(
                    f"{self.files.optim[0]}: optimizer entry {pid}'s moments hold fewer elements than {key}'s "  # type: ignore[index]
                    "parameters: not these files' optimizer"
                )
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [n for p in g["params"] for n in members[p]]}
            for g in self.optims[0]["param_groups"]
        ]
        return {"state": state, "param_groups": groups}

    def _no_shard_pairs(self, ids: List[int]) -> List[Tuple[int, str]]:
        """NO_SHARD's files mark no entry a parameter: the optimizer's parameters are the model entries its
        moments' shapes pick out in order (:func:`~ckptshard.layout.param_order.match_in_order`), if only one
        choice fits."""
        assert self.optims is not None
        state = self.optims[0]["state"]
        wanted = [
            next((tuple(v.shape) for v in state.get(pid, {}).values() if isinstance(v, TensorRef) and v.shape), None)
            for pid in ids
        ]
        names = [n for n, v in self.models[0].items() if isinstance(v, TensorRef)]
        found = match_in_order(wanted, [tuple(self.models[0][n].shape) for n in names])
        where = (self.files.optim or ("",))[0]
        if found.ways == 0:
            raise CheckpointError(
                f"{where}: the moments of the optimizer's {len(ids)} parameters match no in-order choice among "
                f"the model's {len(names)} tensors by shape: not this model's optimizer"
            )
        if found.picked is None:
            at = names[found.fork] if found.fork is not None else "?"
            raise CheckpointError(
                f"{where}: the optimizer's {len(ids)} parameters match the model's tensors by order and shape in "
                f"more than one way ({at} may be a parameter or a buffer; FSDP1 at world size 1 saves both as "
                "plain tensors): its state cannot be named"
            )
        return [(pid, names[j]) for pid, j in zip(ids, found.picked)]

    def require_like(self) -> None:
        """Refuse a LOCAL_STATE_DICT read without ``like``: what its flat parameters hold is recorded nowhere."""
        if self.flat is not None and self.local is None:
            raise CheckpointError(
                f"{self.files.model[0]}: an FSDP1 LOCAL_STATE_DICT ({self.flat}: one flat parameter per FSDP unit, "
                "which does not record the parameters it holds): pass --like FULL, the model's full state dict "
                "(its own safetensors or torch.save file: names, shapes, ties)"
            )

    def require_params(self) -> None:
        """Refuse where the parameters are not told from the buffers (FSDP1 at world size 1) or from the flat
        parameters (LOCAL_STATE_DICT without ``like``)."""
        self.require_like()
        if self.params_known:
            return
        if self._no_shard_error is not None:
            raise self._no_shard_error
        raise CheckpointError(
            f"{self.files.model[0]}: FSDP1 at world size 1 (NO_SHARD) saves parameters and buffers alike as "
            "plain tensors; its optimizer files tell which are parameters, and there are none beside it: "
            "consolidate it, or convert --to dcp and load that at the new world size"
        )

    def _mark_no_shard_params(self) -> None:
        """Show NO_SHARD's parameters as the one-rank ShardedTensors they amount to (so they reshard as FSDP1's
        do): those the optimizer's moments pick out, and a tied parameter's other names (equal values)."""
        assert self.optims is not None
        ids = [pid for g in self.optims[0]["param_groups"] for pid in g["params"]]
        self._no_shard_ids = self._no_shard_pairs(ids)
        picked = [name for _, name in self._no_shard_ids]
        model = self.models[0]
        rest = [n for n, v in model.items() if isinstance(v, TensorRef) and n not in set(picked)]
        twins = repeated_values([(n, whole(model[n])) for n in picked + rest])
        for name in picked + [n for n in rest if twins.get(n) in picked]:
            v = model[name]
            model[name] = DTensorRef(v, tuple(v.shape), v.dtype, (("shard", 0),), (0,), sharded_tensor=True)
        self.params_known = True

    def _fsdp1_twins(self, names: List[str]) -> List[str]:
        """The names whose values on every rank are an earlier name's, byte for byte: FSDP1's files store a
        tied parameter once per name, as separate tensors, and record no tie. Taken as ties only when they
        are exactly the names the optimizer lacks."""
        return list(repeated_values([(n, assemble([sd[n] for sd in self.models])) for n in names]))

    def fsdp1_slices(self) -> Tuple[List[Tuple[int, str]], List[int], List[Optional[Dict[int, Tuple[int, int]]]]]:
        """FSDP1's optimizer files as the layout they show: (id, name) pairs in optimizer order, each
        parameter's element count, and its slice on each rank holding some of it (first element, count),
        None for a parameter with no state."""
        assert self.optims is not None
        pairs = self.optimizer_ids()
        numels = [numel(self.param_shape(name)) for _, name in pairs]
        seen: List[Optional[Dict[int, Tuple[int, int]]]] = []
        for (pid, _), count in zip(pairs, numels):
            if self.no_shard:  # one rank holds every parameter whole
                seen.append({0: (0, count)} if self.optims[0]["state"].get(pid) else None)
                continue
            moments = [next((v for v in o["state"].get(pid, {}).values() if is_slice(v)), None) for o in self.optims]
            sources, _ = rank_slices(moments)
            seen.append({r: (s.dst_start, s.length) for r, s in sources.items()} or None)
        return pairs, numels, seen

    def fsdp1_entry(self, pid: int, name: str) -> Optional[Dict[str, Any]]:
        """One parameter's FSDP1 state joined: with ``use_orig_params=True`` each rank holds a 1-D slice of each
        moment, the parameter's elements inside that rank's shard of its unit's flat parameter. The ranks'
        shards are consecutive ranges of the flat parameter, so the slices in rank order are the whole,
        whatever the unit's other parameters and padding. A rank holding none of it has no entry."""
        assert self.optims is not None
        held = [(r, o["state"][pid]) for r, o in enumerate(self.optims) if pid in o["state"]]
        if not held:
            return None
        shape = self.param_shape(name)
        where = (self.files.optim or ("",))[held[0][0]]
        if self.no_shard:
            return self._no_shard_entry(held[0][1], shape, name, where)
        out: Dict[str, Any] = {}
        for key, v0 in held[0][1].items():
            if not isinstance(v0, TensorRef) or len(v0.shape) == 0:
                out[key] = whole(v0) if isinstance(v0, TensorRef) else v0  # step: the same on every rank
                continue
            for r, entry in held:
                piece = entry.get(key)
                if not is_slice(piece) or str(piece.dtype) != str(v0.dtype):
                    raise CheckpointError(
                        f"{self.files.optim[r]}: optimizer entry {pid} ({name})'s {key} is not a 1-D "  # type: ignore[index]
                        f"{v0.dtype} slice like rank {held[0][0]}'s: not FSDP1 use_orig_params state"
                    )
            sources, start = rank_slices([entry[key] for _, entry in held])
            if start != numel(shape):
                raise CheckpointError(
                    f"{where}: optimizer entry {pid}'s {key} slices hold {start} elements over the ranks, "
                    f"parameter {name} {list(shape)} has {numel(shape)}: the optimizer's parameters are not the "
                    "model's in order"
                )
            out[key] = Fill(shape, v0.dtype, tuple(sources.values()))
        return out

    @staticmethod
    def _no_shard_entry(entry: Dict[str, Any], shape: Tuple[int, ...], name: str, where: str) -> Dict[str, Any]:
        """NO_SHARD keeps each moment whole, in its parameter's shape."""
        for key, v in entry.items():
            if isinstance(v, TensorRef) and v.shape and tuple(v.shape) != shape:
                raise CheckpointError(f"{where}: {name}'s {key} has shape {tuple(v.shape)}, the parameter {shape}")
        return {k: whole(v) if isinstance(v, TensorRef) else v for k, v in entry.items()}


def open_torch_ranks(
    src: str, like: Optional[Mapping[str, TensorRef]] = None, like_ordered: bool = True
) -> Optional[TorchRanks]:
    """``src`` opened as torch FSDP per-rank files, or None if it is not such a checkpoint. ``like``: the
    model's full state dict, which FSDP1's LOCAL_STATE_DICT files need (``like_ordered``: its names in the
    model's order, as torch.save keeps them and safetensors does not)."""
    found = find_torch_ranks(src)
    if found is None:
        return None
    files, models = found
    for p in files.paths:
        input_file(p)
    return TorchRanks(files, models, like, like_ordered)


def open_torch_ranks_like(
    src: str, like: Optional[str], trust_pickles: bool, option: str = "--like"
) -> Optional[TorchRanks]:
    """:func:`open_torch_ranks` with ``like`` the path of the model's full state dict (which FSDP1's
    LOCAL_STATE_DICT files need), refused where ``src`` is torch per-rank files of another kind."""
    refs = full_state_refs(like, trust_pickles, torch_free=True) if like else None
    ranks = open_torch_ranks(src, refs, keeps_model_order(like) if like else True)
    if like and ranks is not None and ranks.local is None:
        raise CheckpointError(f"{src}: {option} is for FSDP1 LOCAL_STATE_DICT files (flat parameters), not these")
    return ranks

"""``inspect``: what a sharded checkpoint holds, without reading tensor data."""

from __future__ import annotations

import math
from typing import Any, Dict, List

from ..dtypes import dtype_name as _dtype
from ..dtypes import itemsize_of
from ..errors import CheckpointError
from ..layout.chunking import padding
from ..layout.model import state_dict_name
from ..plan.torch_ranks import fsdp1_units
from ..read.containers import container_summary
from ..read.source import ShardedCheckpoint, fingerprint
from ..read.torch_ranks import TorchRanks
from ..sources.dcp import DcpSource
from ..sources.fairscale import FairscaleSource
from ..sources.model_parts import ModelPartsSource, summarize_parts
from ..sources.probe import open_source
from ..sources.torch_ranks import FAMILIES, TorchRanksSource
from ..tensors import DTensorRef, TensorRef
from .command import command


def summarize(ckpt: ShardedCheckpoint) -> Dict[str, Any]:
    M = ckpt.world_size
    parts: List[Dict[str, Any]] = []
    total_bytes = 0
    total_padding = 0
    for pi, part in enumerate(ckpt.layout.parts):
        sd0 = ckpt.local_state(0, pi)
        instances = []
        for inst in part.instances:
            fps = []
            for fp in inst.flat_params:
                pad = [0 if inst.no_broadcast_optim_state else padding(fp.numel, M, r) for r in range(M)]
                total_padding += sum(pad)
                total_bytes += fp.numel * itemsize_of(fp.dtype)
                fps.append(
                    {
                        "key": inst.local_key(fp),
                        "dtype": _dtype(fp.dtype),
                        "numel": fp.numel,
                        "shard_numel": fp.shard_numel(M),
                        "padding_per_rank": pad,
                        "params": [
                            {"name": part.prefix + inst.logical_name(m.name), "shape": list(m.shape)}
                            for m in fp.members
                        ],
                    }
                )
            instances.append(
                {
                    "fsdp_path": inst.path,
                    "flat_params": fps,
                    "tied": [
                        [part.prefix + inst.logical_name(s), part.prefix + inst.logical_name(d)] for s, d in inst.shared
                    ],
                    "no_broadcast_optim_state": inst.no_broadcast_optim_state,
                }
            )
        for alias, target in part.aliases:  # a tie FSDP stored under both names (unflattened instance)
            owner = next(i for i in instances if any(f["key"] == target for f in i["flat_params"]))
            owner["tied"].append([part.prefix + target, part.prefix + alias])
        buffers = []
        for b in part.stored_buffers:
            ref = sd0[b]
            total_bytes += ref.nbytes
            buffers.append({"name": part.prefix + b, "shape": list(ref.shape), "dtype": _dtype(ref.dtype)})
        parts.append(
            {
                "label": part.label,
                "prefix": part.prefix,
                "instances": instances,
                "buffers": buffers,
                "extra_tensors": [part.prefix + k for k in ckpt.extra_keys(pi)],
                "non_persistent_buffers": [part.prefix + state_dict_name(b) for b in part.unstored_buffers],
            }
        )
    osd = ckpt.optimizer_state(0)
    optim = None
    if osd is not None:
        keys = sorted({k for entry in osd.get("state", {}).values() for k in entry})
        optim = {
            "entries": len(osd.get("state", {})),
            "param_groups": len(osd.get("param_groups", [])),
            "state_keys": keys,
            "other_keys": sorted(str(k) for k in osd if k not in ("state", "param_groups")),
            # Flat parameters the optimizer does not number: frozen (requires_grad=False) when trained.
            "flat_params_not_in_optimizer": max(
                0,
                len(ckpt.layout.flat_params())
                - sum(len(g.get("params", [])) for g in osd.get("param_groups", []) if isinstance(g, dict)),
            ),
        }
    n_params = sum(len(fp["params"]) for p in parts for i in p["instances"] for fp in i["flat_params"])
    return {
        "source": ckpt.files.shard_list or ckpt.files.paths[0].rsplit("/", 1)[0],
        "files": list(ckpt.files.paths),
        "container": container_summary(ckpt.container),
        "world_size": M,
        "fingerprint": fingerprint(ckpt),
        "fsdp_instances": sum(len(p.instances) for p in ckpt.layout.parts),
        "parameters": n_params,
        "model_bytes": total_bytes,
        "padding_elements": total_padding,
        "optimizer": optim,
        "parts": parts,
    }


def summarize_dcp(folder: str, trust_pickles: bool = False) -> Dict[str, Any]:
    """A DCP folder, from its ``.metadata`` alone: every entry, its dtype, shape and chunks."""
    from ..read.dcp import dcp_metadata

    md = dcp_metadata(folder, trust_pickles)
    tensors, values, total = [], [], 0
    for name, smd in md.state_dict_metadata.items():
        if type(smd).__name__ == "TensorStorageMetadata":
            nbytes = math.prod(smd.size) * itemsize_of(smd.properties.dtype)
            total += nbytes
            tensors.append(
                {
                    "name": name,
                    "dtype": _dtype(smd.properties.dtype),
                    "shape": list(smd.size),
                    "chunks": len(smd.chunks),
                    "bytes": nbytes,
                }
            )
        else:
            values.append(name)
    files = sorted({info.relative_path for info in md.storage_data.values()})
    return {
        "source": folder,
        "format": "dcp",
        "files": files,
        "tensor_bytes": total,
        "tensors": tensors,
        "values": values,
    }


def _fsdp1_units(ranks: TorchRanks) -> str:
    """The FSDP units the optimizer slices show (what reshard cuts by), in words."""
    if ranks.no_shard:
        return "not told (world size 1 runs NO_SHARD: no slices)"
    try:
        units, _, _ = fsdp1_units(ranks, ranks.world_size)
    except CheckpointError as e:
        return f"not told ({str(e).split(': ', 1)[-1].split(':')[0]})"
    kinds = ", ".join(units.wrapped)
    return f"root{' + ' + kinds if kinds else ''} ({len(units.units)} units), aligned to {units.align} elements"


def summarize_ranks(source: TorchRanksSource) -> Dict[str, Any]:
    """torch FSDP per-rank files: each tensor's whole shape and placement, the optimizer, the other files."""
    ranks = source.ranks
    tensors, values, total = [], [], 0
    first_name: Dict[Any, str] = {}
    for name, v in ranks.models[0].items():
        if isinstance(v, DTensorRef):
            nbytes = math.prod(v.shape) * itemsize_of(v.dtype)
            kind, dim = v.placements[0]
            placed = f"Shard({dim})" if kind == "shard" else "Replicate()"
            if ranks.no_shard:
                placed = "whole (a NO_SHARD parameter)"
            key = v.tie_key or name
            if first_name.setdefault(key, name) != name:
                placed, nbytes = f"{placed}, tied to {first_name[key]}", 0
        elif isinstance(v, TensorRef):
            nbytes, placed = v.nbytes, "plain (rank 0's)"
            if ranks.flat is not None:  # LOCAL_STATE_DICT: a parameter's slice on rank 0, or a buffer
                placed = "rank 0's (a parameter's slice or a buffer)"
        else:
            values.append(name)
            continue
        total += nbytes
        tensors.append(
            {"name": name, "dtype": _dtype(v.dtype), "shape": list(v.shape), "placement": placed, "bytes": nbytes}
        )
    optim = None
    if ranks.optims is not None:
        first = ranks.optims[0]
        held = {pid for o in ranks.optims for pid in o["state"]}  # FSDP1: a rank lacks what it holds none of
        keys = sorted({k for o in ranks.optims for entry in o["state"].values() for k in entry})
        optim = {"entries": len(held), "param_groups": len(first["param_groups"]), "state_keys": keys}
        if ranks.kind == "fsdp1":
            optim["fsdp1_units"] = _fsdp1_units(ranks)
    files = ranks.files
    return {
        "source": files.folder,
        "format": source.kind,
        "kind": ranks.kind,
        "local_state_dict": ranks.flat is not None,
        "layout": "verl" if files.verl else "per-rank files",
        "world_size": ranks.world_size,
        "hsdp": list(ranks.hsdp) if ranks.hsdp else None,
        "tensor_bytes": total,
        "tensors": tensors,
        "values": values,
        "optimizer": optim,
        "optimizer_files": files.optim is not None,
        "extra_state": files.extra is not None,
        "carried": files.carried(),
    }


def _format_ranks(s: Dict[str, Any]) -> str:
    o = s["optimizer"]
    lines = [
        f"source      {s['source']}",
        f"format      torch {s['kind'].upper()} per-rank files ({s['layout']})"
        + (", LOCAL_STATE_DICT: flat parameters (--like FULL reads them)" if s["local_state_dict"] else ""),
        f"world size  {s['world_size']}"
        + (
            f" (HSDP: {s['hsdp'][0]} replicas x {s['hsdp'][1]} shards; weights read from replica 0, "
            "optimizer files compared across replicas)"
            if s["hsdp"]
            else ""
        ),
        f"size        {len(s['tensors'])} tensors, {s['tensor_bytes']:,} bytes; {len(s['values'])} other values",
        "optimizer   none"
        if o is None
        else f"optimizer   {o['entries']} entries, {o['param_groups']} param group(s), "
        f"state {', '.join(o['state_keys'])}",
    ]
    if o is not None and "fsdp1_units" in o:
        lines.append(f"FSDP units  {o['fsdp1_units']}")
    if s["extra_state"] or s["carried"]:
        lines.append(f"also        {', '.join((['extra_state files'] if s['extra_state'] else []) + s['carried'])}")
    lines.append("")
    for t in s["tensors"]:
        lines.append(f"  {t['name']}  {t['dtype']}  {tuple(t['shape'])}  {t['placement']}")
    for v in s["values"]:
        lines.append(f"  {v}  (value)")
    return "\n".join(lines)


@command
def inspect_checkpoint(src: str, trust_pickles: bool = False) -> Dict[str, Any]:
    """What a sharded checkpoint or a DCP folder holds, read without tensor data (and without torch where possible).

    Args:
        src: fairscale shards (folder, one shard file or a VISSL shard_list), a DCP folder, or torch
            FSDP2 per-rank files (verl's folder, or one file per rank).
        trust_pickles: unpickle without the weights-only safety net (files you trust only).

    Returns:
        A JSON-ready dict: container, world size, FSDP instances and parameters, padding, buffers,
        optimizer state, fingerprint (for DCP: every entry with dtype, shape and chunks; for FSDP2
        files: every tensor's whole shape and placement).

    Raises:
        CheckpointError: a missing, damaged or inconsistent checkpoint.
    """
    source = open_source(src, trust_pickles=trust_pickles)
    if isinstance(source, DcpSource):
        return summarize_dcp(source.path, trust_pickles)
    if isinstance(source, TorchRanksSource):
        return summarize_ranks(source)
    if isinstance(source, ModelPartsSource):
        return summarize_parts(source.files, source.ckpts, summarize(source.ckpts[0]))
    assert isinstance(source, FairscaleSource)
    return summarize(source.ckpt)


def _format_dcp(s: Dict[str, Any]) -> str:
    lines = [
        f"source      {s['source']}",
        "format      torch.distributed.checkpoint (DCP)",
        f"files       {len(s['files'])} data files",
        f"size        {len(s['tensors'])} tensors, {s['tensor_bytes']:,} bytes; {len(s['values'])} other values",
        "",
    ]
    for t in s["tensors"]:
        lines.append(f"  {t['name']}  {t['dtype']}  {tuple(t['shape'])}  {t['chunks']} chunk(s)")
    for v in s["values"]:
        lines.append(f"  {v}  (value)")
    return "\n".join(lines)


def format_summary(s: Dict[str, Any]) -> str:
    """The human-readable form of :func:`summarize` or :func:`summarize_dcp`."""
    if s.get("format") == "dcp":
        return _format_dcp(s)
    if s.get("format") in FAMILIES:  # torch FSDP per-rank files
        return _format_ranks(s)
    parts = s.get("model_parallel_parts")
    lines = [
        f"source      {s['source']}",
        f"container   {s['container']['kind']} ({', '.join(s['container']['parts'])})",
        f"world size  {s['world_size']}"
        + (f" FSDP shards x {parts} model-parallel parts ({len(s['files'])} files); below: part 0" if parts else ""),
        f"instances   {s['fsdp_instances']} FSDP instances, {s['parameters']} parameters",
        f"size        {s['model_bytes']:,} bytes of weights and buffers; {s['padding_elements']} padding elements",
        f"fingerprint {s['fingerprint']}",
    ]
    o = s["optimizer"]
    if o is None:
        lines.append("optimizer   none")
    else:
        extra = f"; also {', '.join(o['other_keys'])}" if o["other_keys"] else ""
        if o["flat_params_not_in_optimizer"]:
            extra += f"; {o['flat_params_not_in_optimizer']} flat parameters not in it (frozen)"
        lines.append(
            f"optimizer   {o['entries']} entries, {o['param_groups']} param group(s), "
            f"state {', '.join(o['state_keys'])}{extra}"
        )
    for p in s["parts"]:
        lines.append("")
        lines.append(f"[{p['label']}]")
        for inst in p["instances"]:
            lines.append(
                f"  FSDP {inst['fsdp_path'] or '(root)'}" + ("  [per-rank]" if inst["no_broadcast_optim_state"] else "")
            )
            for fp in inst["flat_params"]:
                pad = fp["padding_per_rank"]
                lines.append(
                    f"    {fp['key']}  {fp['dtype']}  {fp['numel']} elements, {fp['shard_numel']} per rank, "
                    f"padding {pad}"
                )
                for prm in fp["params"]:
                    lines.append(f"      {prm['name']}  {tuple(prm['shape'])}")
            for src, dst in inst["tied"]:
                lines.append(f"    tied: {dst} = {src}")
        for b in p["buffers"]:
            lines.append(f"  buffer {b['name']}  {tuple(b['shape'])}  {b['dtype']}")
        for b in p["non_persistent_buffers"]:
            lines.append(f"  buffer {b} (non-persistent: listed, not stored)")
        for e in p["extra_tensors"]:
            lines.append(f"  other tensor {e} (carried from rank 0)")
    return "\n".join(lines)

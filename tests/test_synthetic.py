"""The benchmark's synthetic generator writes what real FSDP saves for the same weights."""

import torch

from ckptshard.fsdp.launch import run_world
from ckptshard.testing.synthetic import SyntheticModel, full_state_dict, write_synthetic

LAYERS, WIDTH = 3, 5


def _real(rank, world_size, out):
    from fairscale.nn import FullyShardedDataParallel as FSDP

    from ckptshard.fsdp.cpu_compat import cpu_fsdp_kwargs

    m = SyntheticModel(LAYERS, WIDTH)
    m.load_state_dict(full_state_dict(LAYERS, WIDTH))
    for i in range(LAYERS):
        m.layers[i] = FSDP(m.layers[i], **cpu_fsdp_kwargs())
    root = FSDP(m, **cpu_fsdp_kwargs())
    torch.save({"model": root.local_state_dict(), "meta": root.local_metadata_dict()}, f"{out}/real{rank}.pt")


def test_synthetic_shards_equal_real_fsdp(tmp_path):
    ws = 4  # 5x5+5 = 30 elements on 4 ranks: padded last shard
    run_world(_real, ws, str(tmp_path))
    write_synthetic(str(tmp_path / "syn"), ws, LAYERS, WIDTH)
    for r in range(ws):
        real = torch.load(tmp_path / f"real{r}.pt", weights_only=True)
        syn = torch.load(tmp_path / "syn" / f"checkpoint_last-shard{r}.pt", weights_only=True)
        assert syn["fsdp_metadata"] == real["meta"]
        assert list(syn["model"]) == list(real["model"])
        for k, v in real["model"].items():
            assert torch.equal(syn["model"][k], v), (r, k)

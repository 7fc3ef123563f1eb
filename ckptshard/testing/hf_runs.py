"""Real verl-layout checkpoints of a tiny Hugging Face Llama, built offline, and FSDP2's own files at N.

``build_hf_run(out, W, fsdp=2, rule="divisible", tie=False)`` trains ``LlamaForCausalLM`` (transformers, a
config made here: no download) for two steps on W gloo ranks, wrapped as verl's workers wrap it (each
decoder layer, then the root), and saves verl's layout::

    model_/optim_/extra_state_world_size_{W}_rank_{r}.pt
    fsdp_config.json
    huggingface/   config.json, generation_config.json, the tokenizer's files (save_pretrained of each)
    ref/full_model.pt  get_model_state_dict(full_state_dict=True), rank 0
    ref/full_optim.pt  get_optimizer_state_dict(full_state_dict=True), rank 0
    ref/logits.pt      the live model's logits on :data:`PROBE`, after training

FSDP2 is given verl's ``shard_placement_fn`` (``rule="divisible"``: the first dimension the world size
divides, else 0) or torch's default (``rule="dim0"``). The shapes are picked so that the rule places the
embedding, the head and the MLP's gate/up projections on dimension 1 at 3 ranks (64 and 20 rows, 12
columns), ``k_proj`` on dimension 1 at 4 ranks (6 rows), and everything on dimension 0 at 2.
``hf_torch_at(ref, out, N, rule)``: the full reference loaded into FSDP2 at N under the same rule and each
rank's state dicts saved, the oracle for ``reshard``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import torch

from ..fsdp.launch import run_world

SIZES = {"vocab_size": 64, "hidden_size": 12, "intermediate_size": 20, "num_hidden_layers": 2}
PROBE = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 8, 16, 32, 63, 0, 7]])
SPECIAL = ("<unk>", "<s>", "</s>")


def hf_config(tie: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **SIZES,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )


def tokenizer() -> Any:
    """A word-level tokenizer of the model's 64 tokens, made offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *(f"w{i}" for i in range(SIZES["vocab_size"] - 3))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def placement_fn(rule: str, group: int) -> Any:
    """verl's ``get_shard_placement_fn(fsdp_size)`` (``divisible``) or None (torch's default, Shard(0))."""
    if rule == "dim0":
        return None
    from torch.distributed.tensor import Shard

    def place(param: Any) -> Any:
        return Shard(next((i for i, n in enumerate(param.shape) if n % group == 0), 0))

    return place


def wrapped(tie: bool, rule: str, seed: int = 0) -> Any:
    """The Llama under FSDP2 as verl's ``apply_fsdp2`` wraps it: each decoder layer, then the root."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(tie))
    kw: Dict[str, Any] = {}
    fn = placement_fn(rule, dist.get_world_size())
    if fn is not None:
        kw["shard_placement_fn"] = fn
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def fsdp1_wrapped(tie: bool, seed: int = 0) -> Any:
    """The Llama under FSDP1 as verl's workers wrap it (each decoder layer a unit, ``use_orig_params``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(tie))
    kw: Dict[str, Any] = {"device_id": torch.device("cpu"), "use_orig_params": True}
    for i in range(len(model.model.layers)):
        model.model.layers[i] = FSDP(model.model.layers[i], **kw)
    return FSDP(model, **kw)


def _train(model: Any, rank: int, world: int) -> Any:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        g = torch.Generator().manual_seed(50 + step)
        tokens = torch.randint(0, SIZES["vocab_size"], (4, 9), generator=g)[rank * 4 // world : (rank + 1) * 4 // world]
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    return optim


def _save_huggingface(folder: str, tie: bool) -> None:
    """verl's ``huggingface/``: the config, generation config and tokenizer, each by its save_pretrained."""
    from transformers import GenerationConfig

    hf = os.path.join(folder, "huggingface")
    hf_config(tie).save_pretrained(hf)
    GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=8).save_pretrained(hf)
    tokenizer().save_pretrained(hf)


def _run_worker(rank: int, world: int, out: str, fsdp: int, rule: str, tie: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    model = wrapped(tie, rule) if fsdp == 2 else fsdp1_wrapped(tie)
    optim = _train(model, rank, world)
    if fsdp == 2:
        states = (model.state_dict(), optim.state_dict())
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

        sharded = (ShardedStateDictConfig(offload_to_cpu=True), ShardedOptimStateDictConfig(offload_to_cpu=True))
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, *sharded):
            states = (model.state_dict(), optim.state_dict())
    for kind, state in zip(("model", "optim"), states):
        torch.save(state, os.path.join(out, f"{kind}_world_size_{world}_rank_{rank}.pt"))
    torch.save({"lr_scheduler": None}, os.path.join(out, f"extra_state_world_size_{world}_rank_{rank}.pt"))
    opts = StateDictOptions(full_state_dict=True)
    full = (get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optim, options=opts))
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    if rank == 0:
        with open(os.path.join(out, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": fsdp, "world_size": world}, f)
        _save_huggingface(out, tie)
        os.makedirs(os.path.join(out, "ref"), exist_ok=True)
        for name, value in (("full_model", full[0]), ("full_optim", full[1]), ("logits", logits)):
            torch.save(value, os.path.join(out, "ref", f"{name}.pt"))


def build_hf_run(out: str, world: int, fsdp: int = 2, rule: str = "divisible", tie: bool = False) -> None:
    os.makedirs(out, exist_ok=True)
    run_world(_run_worker, world, out, fsdp, rule, tie)


def _at_worker(rank: int, world: int, ref: str, out: str, rule: str, tie: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    model = wrapped(tie, rule, seed=7)  # other initial values: loading must overwrite them
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_model_state_dict(model, torch.load(os.path.join(ref, "full_model.pt"), weights_only=True), options=opts)
    set_optimizer_state_dict(
        model, optim, torch.load(os.path.join(ref, "full_optim.pt"), weights_only=True), options=opts
    )
    torch.save(model.state_dict(), os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(optim.state_dict(), os.path.join(out, f"optim_world_size_{world}_rank_{rank}.pt"))


def hf_torch_at(ref: str, out: str, world: int, rule: str = "divisible", tie: bool = False) -> None:
    """FSDP2's own per-rank files at ``world`` under placement ``rule``, of the full state in folder ``ref``."""
    os.makedirs(out, exist_ok=True)
    run_world(_at_worker, world, ref, out, rule, tie)


def placements_of(folder: str, world: int) -> Dict[str, Tuple[Any, ...]]:
    """Each DTensor's placements in rank 0's model file of ``folder``."""
    import torch.distributed.tensor  # weights_only loads DTensors once it is imported

    sd = torch.load(os.path.join(folder, f"model_world_size_{world}_rank_0.pt"), weights_only=True)
    return {k: tuple(v.placements) for k, v in sd.items() if hasattr(v, "placements")}

"""Training runs that save in one framework and resume in another, on gloo ranks with FSDP2 on CPU.

Each source trains a tiny Llama with AdamW for 6 steps of one global batch (6 sequences, split evenly over the
ranks, so the gradients are the same at any world size), saves with its framework's own calls after step 3
and goes on: the uninterrupted run, whose losses and final weights are the oracle. A resume loads the
converted step-3 checkpoint with the target framework's own calls at another world size and trains steps 4-6.

- torchtitan: torchtitan 0.3's own Llama 3 (``Llama3Model``: q/k/v in Meta's rotary row order, complex RoPE,
  its RMSNorm and feed-forward; ``fuse_qkv=False``, as its optimizer state then names the parameters the
  checkpoint's model keys name), saved and loaded as its CheckpointManager does: the model's keys
  flat beside ``optimizer`` (``get_flat_optim_state_dict``), ``dcp.save`` / strict ``dcp.load`` of both,
  ``load_flat_optim_state_dict``. Its attention kernel, flex attention, has no backward on CPU; a causal SDPA
  module (no weights) stands in for it. Final weights are compared under HF names by torchtitan's own
  ``Llama3StateDictAdapter.to_hf``.
- plain FSDP2 with transformers' Llama: torch's recipe, ``get_state_dict`` / ``dcp.save`` of
  ``{"model", "optim"}``; resumed with ``dcp.load`` and ``set_state_dict`` (flattened optimizer state, the
  layout a rename into HF names keeps from torchtitan).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 256, 64, 4, 2, 96, 2
GLOBAL, SEQ, LR = 6, 16, 1e-2
SAVED, STEPS = 3, 6


def hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


class _CausalAttention(torch.nn.Module):
    """torchtitan's inner-attention call, computed by SDPA with a causal mask (no weights of its own)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def titan_config():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN,
                                    rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000.0),
                                    attn_backend="flex", fuse_qkv=False))


def titan_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = titan_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    for layer in model.layers.values():
        layer.attention.inner_attention = _CausalAttention()
    return model


def titan_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's own adapter's HF names and rotary row order of a torchtitan Llama state dict."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(titan_config(), None).to_hf(dict(state))


def hf_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(hf_config())


def _sharded(model: torch.nn.Module, layers) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    return fully_shard(model)


def _train(model, opt, steps: range, rank: int, world: int) -> list[float]:
    """Steps ``steps`` on this rank's share of each global batch; the global mean loss of each."""
    losses = []
    for step in steps:
        ids = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(1000 + step))
        mine = ids[rank * GLOBAL // world:(rank + 1) * GLOBAL // world]
        out = model(mine)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), mine[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _full_model(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _titan_states(model, opt) -> dict[str, Any]:
    """What torchtitan's CheckpointManager saves and loads of the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state

    init_optim_state(opt)
    return {**get_model_state_dict(model), "optimizer": get_flat_optim_state_dict(opt)}


def sources(rank: int, world: int, out: str) -> None:
    """torchtitan and plain FSDP2 each train 6 steps, saving after step 3 (``<out>/titan/step-3``,
    ``<out>/fsdp2/step-3``); rank 0 writes each run's losses and final HF-named weights (``expected.pt``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo")
    expected: dict[str, Any] = {}
    try:
        titan = titan_model(0)
        _sharded(titan, titan.layers.values())
        opt = torch.optim.AdamW(titan.named_parameters(), lr=LR)
        losses = _train(titan, opt, range(1, SAVED + 1), rank, world)
        dcp.save({**_titan_states(titan, opt), "train_state": {"step": SAVED}},
                 checkpoint_id=f"{out}/titan/step-{SAVED}")
        losses += _train(titan, opt, range(SAVED + 1, STEPS + 1), rank, world)
        expected["titan"] = {"losses": losses, "model": titan_to_hf(_full_model(titan))}

        hf = hf_model(1)
        _sharded(hf, hf.model.layers)
        opt = torch.optim.AdamW(hf.parameters(), lr=LR)
        losses = _train(hf, opt, range(1, SAVED + 1), rank, world)
        msd, osd = get_state_dict(hf, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/fsdp2/step-{SAVED}")
        losses += _train(hf, opt, range(SAVED + 1, STEPS + 1), rank, world)
        expected["fsdp2"] = {"losses": losses, "model": _full_model(hf)}
        if rank == 0:
            torch.save(expected, f"{out}/expected.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def resumes(rank: int, world: int, titan_as_hf: str, fsdp2_as_titan: str, out: str) -> None:
    """Steps 4-6 from each converted checkpoint, in the other framework: ``titan_as_hf`` (torchtitan's save
    under HF names) in plain FSDP2, ``fsdp2_as_titan`` (the FSDP2 save under torchtitan's names) in torchtitan;
    rank 0 writes the losses and final HF-named weights of each (``resumed.pt``), and of a control: the
    weights of ``titan_as_hf`` with a fresh optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )
    from torchtitan.components.optimizer.utils import load_flat_optim_state_dict

    dist.init_process_group("gloo")
    resumed: dict[str, Any] = {}
    try:
        hf = hf_model(99)
        _sharded(hf, hf.model.layers)
        opt = torch.optim.AdamW(hf.parameters(), lr=LR)
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd = get_state_dict(hf, opt, options=flat)
        dcp.load({**msd, "optimizer": osd}, checkpoint_id=titan_as_hf)
        set_state_dict(hf, opt, model_state_dict=msd, optim_state_dict=osd, options=flat)
        losses = _train(hf, opt, range(SAVED + 1, STEPS + 1), rank, world)
        resumed["titan"] = {"losses": losses, "model": _full_model(hf)}

        hf = hf_model(99)  # the control: the same weights, a fresh AdamW
        _sharded(hf, hf.model.layers)
        opt = torch.optim.AdamW(hf.parameters(), lr=LR)
        msd = get_state_dict(hf, opt)[0]
        dcp.load(msd, checkpoint_id=titan_as_hf)
        set_model_state_dict(hf, msd)
        losses = _train(hf, opt, range(SAVED + 1, STEPS + 1), rank, world)
        resumed["fresh optimizer"] = {"losses": losses, "model": _full_model(hf)}

        titan = titan_model(99)
        _sharded(titan, titan.layers.values())
        opt = torch.optim.AdamW(titan.named_parameters(), lr=LR)
        states = _titan_states(titan, opt)
        dcp.load(states, checkpoint_id=fsdp2_as_titan)  # strict: every key of both must be there
        set_model_state_dict(titan, {k: v for k, v in states.items() if k != "optimizer"})
        load_flat_optim_state_dict(opt, states["optimizer"])
        losses = _train(titan, opt, range(SAVED + 1, STEPS + 1), rank, world)
        resumed["fsdp2"] = {"losses": losses, "model": titan_to_hf(_full_model(titan))}
        if rank == 0:
            torch.save(resumed, f"{out}/resumed.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()

"""Tiny GPTModels of megatron-core's own class, built on CPU ranks over gloo and saved with its own
``dist_checkpointing.save`` (the ``torch_dist`` backend); and megatron-core's own load and forward of them.

megatron-core runs on CPU given four patches, each applied inside the spawned ranks only:
- for the save, ``torch.cuda.synchronize`` (``strategies/filesystem_async.py``) and
  ``torch.cuda.current_device`` (``strategies/state_dict_saver.py``) are redirected to the CPU; nothing else of
  Megatron's code is touched;
- for the forward, an explicit causal attention mask is passed, and the RNG tracker's ``fork`` (a CUDA RNG
  context) is a no-op; ``moe_utils.te_general_gemm`` is None (a MoE router reads it unguarded without TE); a
  sliding window's mask, which megatron-core makes on ``cuda``, is made on the CPU by the same formula.
Multi-latent attention builds with two more (:func:`_spec`: plain softmax attention in place of TE's), and
``torch.cuda.current_device`` pointed at the CPU while its rotary embedding is made.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 64
SEQ = 8

# family -> (TransformerConfig fields, layer-spec fields)
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # Llama 3: RMSNorm, SwiGLU, RoPE, GQA (4 heads in 2 query groups), no biases, untied output layer.
    "llama": ({}, {}),
    # Qwen3: Llama plus RMSNorm over each head's q and k.
    "qwen3": ({}, {"qk_layernorm": True}),
    # Qwen3-MoE: Qwen3 with 4 experts, top-2 routing, no shared expert.
    "qwen3_moe": ({"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48,
                   "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
                   "moe_token_dispatcher_type": "allgather"},
                  {"qk_layernorm": True, "num_experts": 4}),
    # Llama 3 trained with Megatron's interleaved rotary embeddings: q/k rotate adjacent pairs of each head.
    "llama_interleaved": ({"rotary_interleaved": True}, {}),
}
_MOE = FAMILIES["qwen3_moe"][0]
FAMILIES.update({
    # Qwen2: Llama plus q/k/v biases.
    "qwen2": ({"add_qkv_bias": True}, {}),
    # Mixtral: Qwen3-MoE without q/k norms, its experts split over 2 ranks (EP=2; TP=1 then, on 2 ranks).
    "mixtral": ({**_MOE, "expert_model_parallel_size": 2}, {"num_experts": 4}),
    # Qwen2-MoE: q/k/v biases, a dense first layer (moe_layer_freq: saved with per-layer keys), then a MoE layer
    # with a gated shared expert.
    "qwen2_moe": ({**_MOE, "add_qkv_bias": True, "moe_layer_freq": [0, 1], "moe_shared_expert_intermediate_size": 40,
                   "moe_shared_expert_gate": True}, {}),
    # DeepSeek-V3: multi-latent attention (q through a low rank), a dense first layer, then a MoE layer with a
    # shared expert and the router's expert bias.
    "deepseek_v3": ({**_MOE, "multi_latent_attention": True, "num_query_groups": None, "kv_channels": None,
                     "q_lora_rank": 16, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4,
                     "v_head_dim": 8, "qk_layernorm": True, "rope_type": "rope", "moe_layer_freq": [0, 1],
                     "moe_shared_expert_intermediate_size": 48, "moe_router_enable_expert_bias": True,
                     "moe_router_score_function": "sigmoid"}, {}),
})
# DeepSeek-V3 with q projected at once (DeepSeek-V2-Lite's linear_q_proj), no low rank.
FAMILIES["deepseek_v3_q"] = ({**FAMILIES["deepseek_v3"][0], "q_lora_rank": None}, {})
# GPT-OSS: q/k/v and output biases, each head's attention sink (a learnable softmax offset), a sliding window on
# every other layer (window_size (3, 0): HF's sliding_window 4, the key itself and 3 before it), YaRN rotary
# embeddings (YARN), and MoE layers (4 experts over 2 ranks, EP=2) with router and expert biases and the
# clamped SwiGLU: quick_gelu(min(gate, 7)) * (clamp(up, -7, 7) + 1).
FAMILIES["gpt_oss"] = ({**_MOE, "expert_model_parallel_size": 2, "add_bias_linear": True,
                        "activation_func": "quick_gelu", "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
                        "softmax_type": "learnable", "window_size": (3, 0), "window_attn_skip_freq": 2},
                       {"num_experts": 4})
# GPT-OSS at TP=2 (no expert parallelism), to load what was saved at EP=2; megatron-core takes MoE biases only
# with experts whole on each rank (expert_tensor_parallel_size 1).
FAMILIES["gpt_oss_tp"] = ({**{k: v for k, v in FAMILIES["gpt_oss"][0].items() if k != "expert_model_parallel_size"},
                           "expert_tensor_parallel_size": 1}, {"num_experts": 4})
YARN = {"yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 4, "yarn_beta_fast": 32.0,
        "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0,
        "yarn_correction_range_round_to_int": False}
"""The YaRN fields megatron-core's GPTModel reads from its config (``getattr``) for ``position_embedding_type``
``yarn``; HF's ``rope_parameters`` of the same rotation: factor 4, original_max_position_embeddings 4, beta_fast
32, beta_slow 1, truncate False."""
# Qwen2-MoE saved with singleton_local_shards: each expert on its own, a gated linear_fc1 as two tensors.
FAMILIES["qwen2_moe_singletons"] = FAMILIES["qwen2_moe"]
# GPT-OSS saved so too.
FAMILIES["gpt_oss_singletons"] = FAMILIES["gpt_oss"]
METADATA = {name: {"singleton_local_shards": True} for name in ("qwen2_moe_singletons", "gpt_oss_singletons")}
"""The ``metadata`` a family's ``sharded_state_dict`` is asked with."""


def _config(family: str, tp: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields, _ = FAMILIES[family]
    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        kv_channels=8, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False)
    cls = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    if fields.get("activation_func") == "quick_gelu":
        from megatron.core.activations import quick_gelu

        fields = {**fields, "activation_func": quick_gelu}
    config = cls(**{**base, **fields})
    if family.startswith("gpt_oss"):
        for name, value in YARN.items():
            setattr(config, name, value)
    return config


class _Attention(torch.nn.Module):
    """Softmax attention of multi-latent attention's q, k and v ([seq, batch, heads, dim]) under the mask, in place
    of the local spec's ``DotProductAttention``, which takes neither MLA's channel counts nor its unequal q/k and
    v head sizes (TE's attention does). It holds no weights; everything around it is megatron-core's."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [batch, heads, seq, dim]
        scores = (q @ k.transpose(-1, -2) * self.scale).masked_fill(attention_mask, float("-inf"))
        out = scores.softmax(-1) @ v
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _spec(family: str, config):
    """The local spec of ``family``'s layers: megatron-core's decoder block spec where its layers differ
    (``moe_layer_freq``). Multi-latent attention takes :class:`_Attention`, and an isinstance check against TE's
    class (a stand-in without TE) is turned off."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    fields, spec_fields = FAMILIES[family]
    if "moe_layer_freq" not in fields:
        return get_gpt_layer_local_spec(normalization="RMSNorm", **spec_fields)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if fields.get("multi_latent_attention"):
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = _Attention
    return spec


def build(family: str, tp: int, seed: int = 0):
    """The GPTModel of ``family`` on this rank (parallel state already set up), weights drawn from ``seed``."""
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    config = _config(family, tp)
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # MLA's rotary embedding asks for it
    try:
        model = GPTModel(config=config, vocab_size=VOCAB, max_sequence_length=SEQ * 2,
                         transformer_layer_spec=_spec(family, config), share_embeddings_and_output_weights=False,
                         position_embedding_type="yarn" if family.startswith("gpt_oss") else "rope",
                         rotary_base=10000)
    finally:
        torch.cuda.current_device = current  # type: ignore[assignment]
    # Every weight random, norms included: a mapping that swapped two norms would not show with ones.
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _init(rank: int, world: int, tp: int, family: str) -> None:
    from megatron.core import parallel_state

    dist.init_process_group("gloo", rank=rank, world_size=world)
    fields = FAMILIES[family][0]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             expert_model_parallel_size=fields.get("expert_model_parallel_size", 1),
                                             expert_tensor_parallel_size=fields.get("expert_tensor_parallel_size"))


def _done() -> None:
    from megatron.core import parallel_state

    dist.barrier()
    parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def _cpu_save():
    """The two CUDA calls of megatron-core's torch_dist save path, sent to the CPU for the save only."""
    sync, current = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = sync, current


def megatron_lm_args(family: str, tp: int) -> argparse.Namespace:
    """The run's arguments as Megatron-LM keeps them in a checkpoint (a few of its many fields, under its names)."""
    from megatron.core.transformer.enums import AttnBackend

    fields, _ = FAMILIES[family]
    config = _config(family, tp)
    args = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads, group_query_attention=True,
        num_query_groups=config.num_query_groups, kv_channels=config.kv_channels, padded_vocab_size=VOCAB,
        max_position_embeddings=SEQ * 2, normalization="RMSNorm", norm_epsilon=config.layernorm_epsilon,
        swiglu=True, untie_embeddings_and_output_weights=True, position_embedding_type="rope", rotary_base=10000,
        qk_layernorm=FAMILIES[family][1].get("qk_layernorm", False), num_experts=config.num_moe_experts,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size, moe_router_topk=config.moe_router_topk,
        tensor_model_parallel_size=tp, params_dtype=torch.float32, attention_backend=AttnBackend.auto,
        rotary_interleaved=config.rotary_interleaved, rotary_percent=1.0, add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_qkv_bias, apply_query_key_layer_scaling=config.apply_query_key_layer_scaling,
        apply_layernorm_1p=False, squared_relu=False, make_vocab_size_divisible_by=VOCAB, bf16=False, fp16=False,
        **{k: v for k, v in fields.items() if k not in vars(config)})
    if family.startswith("gpt_oss"):  # Megatron-LM's --quick-geglu, --softmax-type learnable, YaRN
        args.update(swiglu=False, quick_geglu=True, position_embedding_type="yarn", softmax_type="learnable",
                    glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    return argparse.Namespace(**args)


def save(rank: int, world: int, family: str, tp: int, out: str, with_args: bool, prefix: str = "",
         logits: str | None = None) -> None:
    """Build ``family`` at ``tp`` and save it to ``out`` with ``dist_checkpointing.save`` (torch_dist);
    ``with_args``: beside the model, the common state Megatron-LM saves (its ``args``, ``iteration``,
    ``checkpoint_version``), which goes into ``common.pt``; ``prefix``: before every key (NeMo 2's ``module.``);
    ``logits``: a file where rank 0 then saves megatron-core's forward (:func:`_forward`) of the checkpoint, as
    its own ``dist_checkpointing.load`` reads it back."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    _init(rank, world, tp, family)
    model = build(family, tp)
    state = model.sharded_state_dict(prefix=prefix, metadata=METADATA.get(family))
    if with_args:
        state = {**state, "args": megatron_lm_args(family, tp), "checkpoint_version": 3.0, "iteration": 0}
    os.makedirs(out, exist_ok=True)
    with _cpu_save():
        dist_checkpointing.save(state, out,
                                sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    _stop_writer_manager()
    if logits is not None:  # the ranks' replicated norms differ until they load the one copy saved
        _load_into(model, out, prefix, METADATA.get(family))
        result = _forward(model, tp)
        if rank == 0:
            torch.save(result, logits)
    _done()


def _stop_writer_manager() -> None:
    """The save's writer starts a ``multiprocessing`` Manager for its results queue and leaves it running;
    these ranks end with ``os._exit``, which would orphan it (holding the test's output pipes open)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        queue._manager.shutdown()
        filesystem_async._results_queue = None


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


@contextlib.contextmanager
def _cpu_forward():
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # the router reads it unguarded without Transformer Engine
    window = fused_softmax.get_sliding_window_causal_mask
    # A sliding window's mask is made on "cuda": the same mask, made on the CPU.
    fused_softmax.get_sliding_window_causal_mask = lambda sq, sk, w: ~torch.ones(sq, sk, dtype=torch.bool).triu(
        sk - sq - w[0]).tril(sk - sq + w[1])
    tracker = random.get_cuda_rng_tracker()
    fork, current = tracker.fork, torch.cuda.current_device
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # a CUDA RNG context, with no dropout to seed
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on its first call.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        tracker.fork, torch.cuda.current_device = fork, current
        fused_softmax.get_sliding_window_causal_mask = window


def load(rank: int, world: int, family: str, tp: int, ckpt: str, forward: bool, result: str) -> None:
    """megatron-core's own ``dist_checkpointing.load`` of ``ckpt`` into a fresh ``family`` model at ``tp``;
    saves to ``result``/rank{rank}.pt this rank's parts of every parameter (:func:`assemble` joins them) and the
    logits over the whole vocabulary (tensors cannot go back through the spawn queue once a rank has exited)."""

    _init(rank, world, tp, family)
    model = build(family, tp, seed=1)  # weights unlike the saved ones: a tensor not loaded shows
    common = _load_into(model, ckpt, metadata=METADATA.get(family))
    out: dict[str, Any] = {"params": _local(model), "common": common}
    if forward:
        out["logits"] = _forward(model, tp)
    torch.save(out, Path(result) / f"rank{rank}.pt")
    _done()


def _load_into(model, ckpt: str, prefix: str = "", metadata: dict | None = None) -> dict[str, Any]:
    """megatron-core's own ``dist_checkpointing.load`` of ``ckpt`` (its keys under ``prefix``, spelled as
    ``sharded_state_dict`` spells them given ``metadata``) into ``model``; returns the entries of the common state
    its load merged in beside the model's."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(prefix=prefix, metadata=metadata), ckpt)
    state = {k.removeprefix(prefix): v for k, v in state.items()}
    common = {k: state.pop(k) for k in list(state) if k not in model.state_dict()}  # common.pt's, merged in
    model.load_state_dict(state)
    return common


def _forward(model, tp: int) -> torch.Tensor:
    """megatron-core's forward of :func:`tokens`, logits over the whole vocabulary."""
    ids = tokens()
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]  # True: masked out
    position_ids = torch.arange(SEQ)[None].expand_as(ids)
    model.eval()
    with torch.no_grad(), _cpu_forward():
        logits = model(ids, position_ids, mask)
    return _gather_vocab(logits) if tp > 1 else logits


def _local(model) -> dict[str, list[tuple]]:
    """This rank's parts of every parameter in its sharded state dict, as megatron-core saves them: for each key,
    (global shape, global offset, data) per part, the data with the leading axes the sharded tensor prepends (a
    layer-stacked tensor's layer). A factory (SwiGLU's ``linear_fc1``, which saves gate and up as two parts of
    one key) is built into its parts."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors

    out: dict[str, list[tuple]] = {}
    pending = list(model.sharded_state_dict().values())
    while pending:
        sh = pending.pop()
        if isinstance(sh, ShardedTensorFactory):
            built, _ = extract_sharded_tensors(sh.build())
            pending += built.values() if isinstance(built, dict) else built
        elif isinstance(sh, ShardedTensor) and not sh.key.endswith("_extra_state"):
            data = sh.data.detach()
            local = (1,) * (len(sh.global_shape) - data.dim()) + tuple(data.shape)
            out.setdefault(sh.key, []).append((tuple(sh.global_shape), tuple(sh.global_offset),
                                               data.reshape(local).clone()))
        elif isinstance(sh, (list, tuple, dict)):
            pending += sh.values() if isinstance(sh, dict) else sh
    return out


def assemble(parts: list[dict[str, list[tuple]]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's :func:`_local` parts (NaN where no rank held a part)."""
    out: dict[str, torch.Tensor] = {}
    for rank_parts in parts:
        for key, pieces in rank_parts.items():
            for shape, offset, data in pieces:
                full = out.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
                full[tuple(slice(o, o + n) for o, n in zip(offset, data.shape, strict=True))] = data
    return out


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def loaded(tmp: Path, family: str, tp: int, ckpt: Path, forward: bool = False) -> dict[str, Any]:
    """megatron-core's own load of ``ckpt`` at ``tp`` over 2 ranks: ``{"params": whole tensors, "common": the
    entries its load merged in beside the model's, "logits": ...}``."""
    from _spawn import spawn

    result = tmp / f"loaded-{family}-tp{tp}"
    result.mkdir()
    spawn(load, 2, family, tp, str(ckpt), forward, str(result))
    # (weights_only=False: the common state holds megatron-core's own classes; these files are the test's own.)
    ranks = [torch.load(result / f"rank{r}.pt", weights_only=False) for r in range(2)]
    out: dict[str, Any] = {"params": assemble([r["params"] for r in ranks]), "common": ranks[0]["common"]}
    if forward:
        assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])
        out["logits"] = ranks[0]["logits"]
    return out


def saved(tmp: Path, family: str, tp: int, with_args: bool = True) -> Path:
    """A ``family`` checkpoint saved by megatron-core at ``tp`` over 2 ranks (see :func:`save`)."""
    from _spawn import spawn

    out = tmp / f"{family}-tp{tp}"
    spawn(save, 2, family, tp, str(out), with_args)
    return out


def saved_with_logits(tmp: Path, family: str, tp: int, with_args: bool = True, prefix: str = "",
                      out: Path | None = None) -> tuple[Path, torch.Tensor]:
    """:func:`saved` (in ``out``, its keys under ``prefix``), and megatron-core's own load and forward of it, in
    one launch of the ranks."""
    from _spawn import spawn

    out = out or tmp / f"{family}-tp{tp}"
    logits = tmp / f"{out.name}-logits.pt"
    spawn(save, 2, family, tp, str(out), with_args, prefix, str(logits))
    return out, torch.load(logits)

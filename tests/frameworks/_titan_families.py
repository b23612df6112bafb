"""Tiny torchtitan 0.3 models of each family ckptkit adapts, built from torchtitan's own config builders (the
registries' debug configurations, shrunk: 2 layers, 4 experts, small dims), their HF configs, and the save
torchtitan's CheckpointManager makes of them (the model's keys flat at the top level, ``dcp.save`` over gloo
ranks, ``Shard(0)`` DTensors as FSDP2 holds them).

Each family is ``(titan config, torchtitan adapter class, HF config dict)``; the HF config states what
transformers needs to build the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")
VOCAB, DIM = 256, 64


def _qwen3(moe: bool):
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    rope = CosSinRoPE.Config(dim=16, max_seq_len=64, theta=1000000.0)
    common = dict(n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, attn_backend="flex", rope=rope)
    layers = (_build_qwen3_moe_layers(**common, moe_hidden_dim=32, num_experts=4, top_k=2,
                                      moe_comm_backend="standard") if moe
              else _build_qwen3_layers(**common, hidden_dim=96))
    config = Qwen3Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_qwen3_norm(DIM), enable_weight_tying=not moe,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT), layers=layers)
    hf = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=64,
              tie_word_embeddings=not moe, hidden_act="silu")
    if moe:
        hf.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[])
    else:
        hf.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=96)
    return config, Qwen3StateDictAdapter, hf


def _model_config(model, layers, embedding_init, norm_init, output_init):
    """``model.Config`` with the embedding, final norm and output head every family builds the same way, each
    initialised as the family's own module does."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    return model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=embedding_init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm_init),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=output_init(DIM)),
        layers=layers)


def _deepseek_v3():
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mscale=0.70, dense_hidden_dim=96, moe_hidden_dim=32, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0))
    config = _model_config(DeepSeekV3Model, layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init)
    hf = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=VOCAB, hidden_size=DIM,
              intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
              first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, head_dim=8, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
              rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
              rope_interleave=True, hidden_act="silu")
    return config, DeepSeekV3StateDictAdapter, hf


def _gpt_oss():
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.gpt_oss import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        GptOssModel,
        _build_gptoss_layers,
        _output_linear_init,
    )
    from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter

    layers = _build_gptoss_layers(  # torchtitan's builder fixes 64 heads of 64, 8 kv heads
        fuse_qkv=True, dim=DIM, n_layers=2, hidden_dim=48, num_experts=4, top_k=2, load_balance_coeff=1e-3,
        attn_backend="flex", moe_comm_backend="standard", rope=CosSinRoPE.Config(dim=64, max_seq_len=64,
                                                                              theta=150000.0))
    config = _model_config(GptOssModel, layers, _EMBEDDING_INIT, _NORM_INIT, _output_linear_init)
    hf = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=VOCAB, hidden_size=DIM,
              intermediate_size=48, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=128, max_position_embeddings=64,
              rms_norm_eps=1e-5, tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"])
    return config, GptOssStateDictAdapter, hf


def _kimi():
    """Kimi K2.5: DeepSeek-V3's MLA and MoE under ``language_model.``, and a MoonViT vision tower."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.kimi_k2_7 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        KimiK25Model,
        _build_kimi_layers,
        _output_linear_init,
        _vision_encoder_config,
    )
    from torchtitan.models.kimi_k2_7.state_dict_adapter import KimiK25StateDictAdapter

    layers = _build_kimi_layers(
        n_layers=2, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=96, moe_hidden_dim=32, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="sigmoid", router_route_norm=True,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=50000.0))
    vision = _vision_encoder_config(dim=32, ffn_dim=48, num_layers=2, num_heads=2, patch_size=2,
                                    init_pos_emb_height=4, init_pos_emb_width=4, text_hidden_size=DIM)
    config = KimiK25Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers, vision_encoder=vision)
    text = dict(model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=DIM, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                head_dim=8, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                scoring_func="sigmoid", rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=64,
                tie_word_embeddings=False, rope_interleave=True, hidden_act="silu")
    hf = dict(model_type="kimi_k25", architectures=["Kimi_K25ForConditionalGeneration"], text_config=text,
              vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                 patch_size=2, pos_emb_height=4, pos_emb_width=4, merge_kernel_size=[2, 2]),
              projection_hidden_size=32, tie_word_embeddings=False)
    return config, KimiK25StateDictAdapter, hf


def _stub_fla() -> None:
    """torchtitan's Qwen3.5 imports the flash-linear-attention package (``fla``) at load time, for the
    GatedDeltaNet kernels of its linear-attention layers. Conversion never runs them: stand-in modules with
    the names it imports let it load without the package (and without a GPU)."""
    import sys
    import types

    if "fla" in sys.modules:
        return
    names = {"fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
             "fla.modules.conv.causal_conv1d": ("causal_conv1d",),
             "fla.ops.gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
             "fla.ops.gated_delta_rule.chunk": ("ChunkGatedDeltaRuleFunction",),
             "fla.ops.gated_delta_rule.fused_recurrent": ("FusedRecurrentFunction",)}
    for name, attributes in names.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for attribute in attributes:
            setattr(sys.modules[name], attribute, None)


def _qwen3_5(moe: bool):
    """Qwen3.5: layers of GatedDeltaNet linear attention with every second one full attention (q/k norms, gated
    q), a dense or MoE MLP (stacked experts, a sigmoid-gated shared expert), and a vision tower."""
    _stub_fla()
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.qwen3_5 import (
        _EMBEDDING_INIT,
        Qwen35Model,
        _build_qwen35_layers,
        _build_qwen35_moe_layers,
        _offset_norm,
        _output_linear_init,
        _qwen35_vision_encoder_config,
    )
    from torchtitan.models.qwen3_5.rope import MRoPE
    from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter

    common = dict(n_layers=2, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=8, n_key_heads=2,
                  n_value_heads=4, key_head_dim=16, value_head_dim=16, full_attention_interval=2, attn_backend="flex",
                  rope=MRoPE.Config(dim=8, max_seq_len=64, theta=10_000_000.0, mrope_section=[2, 1, 1]))
    layers = (_build_qwen35_moe_layers(**common, moe_hidden_dim=24, num_experts=4, top_k=2,
                                       shared_expert_hidden_dim=48) if moe
              else _build_qwen35_layers(**common, hidden_dim=96))
    vision = _qwen35_vision_encoder_config(dim=32, ffn_dim=48, num_layers=2, num_heads=2, patch_size=2,
                                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=DIM,
                                           num_position_embeddings=16)
    config = Qwen35Model.Config(
        vocab_size=VOCAB, dim=DIM, norm=_offset_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers, vision_encoder=vision)
    text = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=64,
                layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False,
                rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.5,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    if moe:
        text.update(model_type="qwen3_5_moe_text", moe_intermediate_size=24, shared_expert_intermediate_size=48,
                    num_experts=4, num_experts_per_tok=2)
    else:
        text.update(model_type="qwen3_5_text", intermediate_size=96)
    hf = dict(model_type="qwen3_5_moe" if moe else "qwen3_5", tie_word_embeddings=False, text_config=text,
              architectures=["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3,
                                 patch_size=2, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=DIM,
                                 num_position_embeddings=16))
    return config, Qwen35StateDictAdapter, hf


def _muse_glimmer(vision: bool = True):
    """Muse Glimmer: gated attention with split-half rotary in HF, four norms a layer, a soft-capped head, and a
    vision encoder, adapter and projection."""
    from torchtitan.models.muse_glimmer import (
        _muse_glimmer_config,
        muse_glimmer_vision_adapter_config,
        muse_glimmer_vision_encoder_config,
    )
    from torchtitan.models.muse_glimmer.state_dict_adapter import MuseGlimmerStateDictAdapter

    encoder = muse_glimmer_vision_encoder_config(latent_dim=32, num_layers=2, num_heads=4, mlp_ratio=1.5,
                                                 patch_size=2, patch_temporal=2, downsample_factor=2,
                                                 sparse_attention_factor=2, pos_emb_grid_h=2, pos_emb_grid_w=2)
    adapter = muse_glimmer_vision_adapter_config(input_dim=encoder.output_dim, output_dim=48)
    parts = dict(vision_adapter_dim=48, vision_encoder=encoder, vision_adapter=adapter) if vision else {}
    config = _muse_glimmer_config(dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=VOCAB,
                                  max_seq_len=64, window_pattern=[16, 0], output_multiplier=1.0,
                                  attn_backend="flex", **parts)
    text = dict(model_type="muse_glimmer_text", vocab_size=VOCAB, hidden_size=DIM, intermediate_size=192,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    hf = dict(model_type="muse_glimmer", architectures=["MuseGlimmerForConditionalGeneration"], text_config=text,
              vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                 patch_size=2, patch_temporal=2, merge_size=2, pos_emb_height=2, pos_emb_width=2,
                                 max_position_embeddings=4),
              projector_hidden_size=48, out_hidden_size=128, tie_word_embeddings=False)
    return config, MuseGlimmerStateDictAdapter, hf


def family(name: str):
    """``(torchtitan model config, its state-dict adapter class, HF config dict)`` of family ``name``."""
    return {"qwen3": lambda: _qwen3(False), "qwen3_moe": lambda: _qwen3(True), "deepseek_v3": _deepseek_v3,
            "gpt_oss": _gpt_oss, "kimi_k2_7": _kimi,
            "qwen3_5": lambda: _qwen3_5(False), "qwen3_5_moe": lambda: _qwen3_5(True),
            "muse_glimmer": _muse_glimmer, "muse_glimmer_text": lambda: _muse_glimmer(False)}[name]()


def build(name: str, seed: int = 0, perturb: bool = True) -> torch.nn.Module:
    """The family's torchtitan model on CPU, its weights initialised from ``seed``: by its own ``init_weights``
    alone, or with every parameter and float buffer moved off its initial value (``perturb``)."""
    config = family(name)[0]
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        # init_weights leaves some at zero (router biases): make every value count
        for p in model.parameters() if perturb else ():
            p.add_(torch.randn_like(p) * 0.02)
        for b in model.buffers() if perturb else ():
            if b.is_floating_point():
                b.add_(torch.randn_like(b) * 0.02)
    return model


def write_hf_assets(name: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(family(name)[2], indent=2))
    return out


def save_families(rank: int, world: int, out: str, names: tuple[str, ...] = FAMILIES) -> None:
    """Each family's model saved as torchtitan's CheckpointManager saves it at a step (model keys flat at the
    top level) over ``world`` gloo ranks, ``Shard(0)`` DTensors; rank 0 also saves the full state dicts."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    try:
        for name in names:
            state = build(name).state_dict()
            sharded = {k: distribute_tensor(v.detach(), mesh, [Shard(0)]) for k, v in state.items()}
            dcp.save(sharded, checkpoint_id=f"{out}/{name}/step-0")
            if rank == 0:
                torch.save(state, f"{out}/{name}/expected.pt")
                write_hf_assets(name, Path(out) / name / "assets")
    finally:
        dist.destroy_process_group()

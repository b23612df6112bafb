"""The model-family presets on small hand-made checkpoints: ``--preset auto`` and its detection, ``inspect``'s
family line, and the refusals (one line, exit 2, nothing written) of input a family's table cannot map.

torchtitan's own models and adapters prove the mappings themselves (tests/frameworks/test_titan_families.py);
here the names and shapes are torchtitan's, written with safetensors, so that each refusal is quick to reach.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckptkit.cli import cli

CONFIG = {"model_type": "qwen3_moe", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 4, "num_hidden_layers": 1, "num_experts": 4, "vocab_size": 10, "tie_word_embeddings": False}


def qwen3_moe_titan(experts: int = 4) -> dict[str, torch.Tensor]:
    """A one-layer Qwen3-MoE under torchtitan 0.3's names (dim 8, 2 heads of 4, 1 kv head, ``experts`` experts)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"tok_embeddings.weight": (10, 8), "norm.weight": (8,), "lm_head.weight": (10, 8),
              "layers.0.attention.qkv_linear.wq.weight": (8, 8), "layers.0.attention.qkv_linear.wk.weight": (4, 8),
              "layers.0.attention.qkv_linear.wv.weight": (4, 8), "layers.0.attention.wo.weight": (8, 8),
              "layers.0.attention.q_norm.weight": (4,), "layers.0.attention.k_norm.weight": (4,),
              "layers.0.attention_norm.weight": (8,), "layers.0.ffn_norm.weight": (8,),
              "layers.0.moe.router.gate.weight": (experts, 8), "layers.0.moe.expert_bias_E": (experts,),
              "layers.0.moe.routed_experts.inner_experts.w1_EFD": (experts, 6, 8),
              "layers.0.moe.routed_experts.inner_experts.w3_EFD": (experts, 6, 8),
              "layers.0.moe.routed_experts.inner_experts.w2_EDF": (experts, 8, 6)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def checkpoint(tmp_path: Path, state: dict[str, torch.Tensor], config: dict | None = None) -> tuple[Path, Path]:
    """``state`` as a safetensors file, and a directory holding ``config`` as its config.json."""
    save_file(state, tmp_path / "ckpt.safetensors")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    return tmp_path / "ckpt.safetensors", assets


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_export_hf_preset_auto_splits_the_experts_of_a_recognised_family(tmp_path):
    state = qwen3_moe_titan()
    src, assets = checkpoint(tmp_path, state)
    result = run("export-hf", src, tmp_path / "hf", "--hf-assets", assets)
    assert result.exit_code == 0, result.output
    assert "--preset auto: torchtitan-qwen3-moe (model_type 'qwen3_moe' in " in result.output
    got = load_file(tmp_path / "hf" / "model.safetensors")
    stacked = state["layers.0.moe.routed_experts.inner_experts.w2_EDF"]
    for e in range(4):
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], stacked[e])
    assert "layers.0.moe.expert_bias_E" not in got and len(got) == 3 + 9 + 3 * 4


def test_inspect_names_the_family_and_the_preset_auto_uses(tmp_path):
    src, assets = checkpoint(tmp_path, qwen3_moe_titan())
    (src.parent / "config.json").write_text((assets / "config.json").read_text())
    result = run("inspect", src)
    assert result.exit_code == 0, result.output
    assert "family: torchtitan-qwen3-moe (model_type 'qwen3_moe' in " in result.output


def assert_refused(result, message: str, out: Path) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("ckptkit: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize("state, config, args, message", [
    # the config's expert count disagrees with the stacked tensors
    (qwen3_moe_titan(), {**CONFIG, "num_experts": 8}, [],
     "'layers.0.moe.routed_experts.inner_experts.w1_EFD' of shape [4, 6, 8] stacks experts along dim 0, but "),
    # a key the table does not know is refused, never passed through
    ({**qwen3_moe_titan(), "layers.0.moe.shared_expert.w1.weight": torch.zeros(2, 8)}, CONFIG, [],
     "no preset maps all of them: the nearest, --preset torchtitan-qwen3-moe, does not know 1: "
     "'layers.0.moe.shared_expert.w1.weight'; this family or variant is not mapped yet"),
    # a Qwen3-MoE checkpoint given DeepSeek-V3's preset
    (qwen3_moe_titan(), CONFIG, ["--preset", "torchtitan-deepseek-v3"],
     "--preset torchtitan-deepseek-v3: "),
    # the config names another family than the keys are
    (qwen3_moe_titan(), {**CONFIG, "model_type": "deepseek_v3"}, [],
     "model_type 'deepseek_v3' is --preset torchtitan-deepseek-v3's family, but the keys are --preset "
     "torchtitan-qwen3-moe's"),
])
def test_export_hf_refuses_what_the_family_table_cannot_map(tmp_path, state, config, args, message):
    src, assets = checkpoint(tmp_path, state, config)
    assert_refused(run("export-hf", src, tmp_path / "hf", "--hf-assets", assets, *args), message, tmp_path / "hf")


def test_export_hf_without_a_config_names_the_field_the_experts_need(tmp_path):
    src, _ = checkpoint(tmp_path, qwen3_moe_titan())
    assert_refused(run("export-hf", src, tmp_path / "hf", "--preset", "torchtitan-qwen3-moe"),
                   "num_experts", tmp_path / "hf")


def deepseek_fp8_hf(scale_rows: int | None) -> dict[str, torch.Tensor]:
    """One FP8 weight of a DeepSeek-V3 HF checkpoint, with ``scale_rows`` rows of block scales (None: none)."""
    state = {"model.layers.0.self_attn.kv_b_proj.weight": torch.ones(200, 8).to(torch.float8_e4m3fn)}
    if scale_rows is not None:
        state["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(scale_rows, 1)
    return state


@pytest.mark.parametrize("scale_rows, message", [
    (None, "'model.layers.0.self_attn.kv_b_proj.weight' is float8_e4m3fn but "
           "'model.layers.0.self_attn.kv_b_proj.weight_scale_inv' is missing"),
    (1, "'model.layers.0.self_attn.kv_b_proj.weight_scale_inv': shape [1, 1] (float32); the 128x128 block grid of "
        "'model.layers.0.self_attn.kv_b_proj.weight' [200, 8] is [2, 1] floats"),
])
def test_convert_refuses_fp8_weights_without_scales_that_cover_them(tmp_path, scale_rows, message):
    src, assets = checkpoint(tmp_path, deepseek_fp8_hf(scale_rows), {**CONFIG, "model_type": "deepseek_v3"})
    result = run("convert", src, tmp_path / "titan", "--to", "sharded", "--preset", "torchtitan-deepseek-v3",
                 "--hf-assets", assets)
    assert_refused(result, message, tmp_path / "titan")


def test_convert_refuses_gpt_oss_mxfp4_blocks_without_their_scales(tmp_path):
    state = {"model.embed_tokens.weight": torch.zeros(10, 8),
             "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(2, 4, 1, 16, dtype=torch.uint8)}
    src, assets = checkpoint(tmp_path, state, {**CONFIG, "model_type": "gpt_oss"})
    result = run("convert", src, tmp_path / "titan", "--to", "sharded", "--preset", "torchtitan-gpt-oss",
                 "--hf-assets", assets)
    assert_refused(result, "'model.layers.0.mlp.experts.gate_up_proj_blocks' holds MXFP4 blocks but "
                           "'model.layers.0.mlp.experts.gate_up_proj_scales' is missing", tmp_path / "titan")


# ------------------------------------------------------------------------- names no preset maps, and the advice


def unknown_titan_family() -> dict[str, torch.Tensor]:
    """torchtitan's names of a family no preset maps: a Qwen3-MoE layer with an attention output gate of a name
    no torchtitan release uses (so that no preset will ever know it)."""
    return {**qwen3_moe_titan(), "layers.0.attention.zz_output_gate.weight": torch.zeros(8, 8)}


def test_export_hf_preset_auto_refuses_torchtitan_names_no_preset_maps_and_none_keeps_them(tmp_path):
    src, assets = checkpoint(tmp_path, unknown_titan_family(), {**CONFIG, "model_type": "zz_family"})
    result = run("export-hf", src, tmp_path / "hf", "--hf-assets", assets)
    assert_refused(result, "--preset auto: the keys are torchtitan (or Meta) names (e.g. ", tmp_path / "hf")
    assert "does not know 1: 'layers.0.attention.zz_output_gate.weight'; this family or variant is not mapped yet" \
        in result.stderr and "torchtitan-qwen3-moe, " in result.stderr and "--preset none writes the names" \
        in result.stderr
    kept = run("export-hf", src, tmp_path / "kept", "--preset", "none")
    assert kept.exit_code == 0, kept.output
    assert set(load_file(tmp_path / "kept" / "model.safetensors")) == set(unknown_titan_family())


def test_export_hf_preset_auto_tells_megatron_families_apart_by_their_keys(tmp_path):
    layer = {"decoder.layers.self_attention.linear_qkv.layer_norm_weight": (1, 8),
             "decoder.layers.self_attention.linear_qkv.weight": (1, 16, 8),
             "decoder.layers.self_attention.linear_proj.weight": (1, 8, 8),
             "decoder.layers.mlp.linear_fc1.layer_norm_weight": (1, 8),
             "decoder.layers.mlp.linear_fc1.weight": (1, 12, 8), "decoder.layers.mlp.linear_fc2.weight": (1, 8, 6),
             "embedding.word_embeddings.weight": (10, 8), "decoder.final_layernorm.weight": (8,),
             "output_layer.weight": (10, 8)}
    norms = {f"decoder.layers.self_attention.{x}_layernorm.weight": (1, 4) for x in "qk"}
    config = {k: v for k, v in CONFIG.items() if k not in ("model_type", "num_experts")}
    for shapes, chosen in ((layer, "megatron-llama"), ({**layer, **norms}, "megatron-qwen3")):
        (tmp_path / chosen).mkdir()
        src, assets = checkpoint(tmp_path / chosen, {k: torch.ones(s) for k, s in shapes.items()}, config)
        result = run("export-hf", src, tmp_path / chosen / "hf", "--hf-assets", assets, "--dry-run")
        assert result.exit_code == 0, result.output
        assert f"--preset auto: {chosen} (Megatron names of --preset {chosen}'s table)" in result.output


def test_export_hf_preset_auto_keeps_an_empty_key_that_nothing_renames(tmp_path):
    torch.save({"": torch.ones(2), "w": torch.zeros(3)}, tmp_path / "model.pt")
    result = run("export-hf", tmp_path / "model.pt", tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == {"", "w"}


def test_convert_to_sharded_with_preset_auto_says_it_renames_nothing_when_it_renames_nothing(tmp_path):
    save_file({"model.norm.weight": torch.ones(8)}, tmp_path / "model.safetensors")
    result = run("convert", tmp_path / "model.safetensors", tmp_path / "out", "--to", "sharded", "--preset", "auto")
    assert result.exit_code == 0, result.output
    assert "renames the model's weights" not in result.output


def test_export_hf_refusal_names_a_weight_as_unmapped_and_never_offers_to_leave_it_out(tmp_path):
    src, assets = checkpoint(tmp_path, {**qwen3_moe_titan(), "layers.0.moe.shared_expert.w1.weight": torch.zeros(2, 8)})
    result = run("export-hf", src, tmp_path / "hf", "--hf-assets", assets, "--preset", "torchtitan-qwen3-moe")
    assert_refused(result, "'layers.0.moe.shared_expert.w1.weight' is a weight of a family or variant that --preset "
                           "torchtitan-qwen3-moe does not map yet", tmp_path / "hf")
    assert "null" not in result.stderr


def test_export_hf_refusal_offers_to_leave_out_a_recomputed_buffer_and_key_map_takes_it_inline(tmp_path):
    buffer = "layers.0.attention.rotary_emb.inv_freq"
    src, assets = checkpoint(tmp_path, {**qwen3_moe_titan(), buffer: torch.ones(2)})
    result = run("export-hf", src, tmp_path / "hf", "--hf-assets", assets, "--preset", "torchtitan-qwen3-moe")
    advice = f"--key-map '{{\"{buffer}\": null}}'"
    assert_refused(result, f"they are not weights (the model recomputes them): leave them out with {advice}",
                   tmp_path / "hf")
    followed = run("export-hf", src, tmp_path / "hf", "--hf-assets", assets, "--preset", "torchtitan-qwen3-moe",
                   "--key-map", f'{{"{buffer}": null}}')
    assert followed.exit_code == 0, followed.output
    assert len(load_file(tmp_path / "hf" / "model.safetensors")) == 3 + 9 + 3 * 4


@pytest.mark.parametrize("keys, framework", [
    (["tok_embeddings.weight", "layers.0.attention.wq.weight"], "torchtitan (or Meta)"),  # Meta, torchtitan <= 0.2
    (["layers.3.feed_forward.w1.weight"], "torchtitan (or Meta)"),
    (["decoder.layers.self_attention.linear_qkv.weight"], "Megatron"),  # torch_dist, layer-stacked
    (["decoder.layers.0.mlp.linear_fc1.weight"], "Megatron"),  # megatron-core's per-layer state dict
    (["language_model.encoder.layers.0.self_attention.query_key_value.weight"], "Megatron"),  # Megatron-LM legacy
    (["layers.0.self_attn.q_proj.weight", "embed_tokens.weight", "norm.weight"], None),  # HF's LlamaModel
    (["decoder.layers.0.self_attn.k_proj.weight", "encoder.layers.0.fc1.weight"], None),  # HF's BartModel
    (["model.layers.0.self_attn.q_proj.weight"], None),
])
def test_recognise_knows_framework_names_and_not_hf_base_models(keys, framework):
    from ckptkit.models.detect import recognise

    found = recognise(keys)
    assert (found[0].name if found else None) == framework

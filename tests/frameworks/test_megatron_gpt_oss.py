"""The Megatron GPT-OSS table: megatron-core's GPTModel with GPT-OSS's features (q/k/v and output biases, attention
sinks as a learnable softmax offset, a sliding window on every other layer, YaRN rotary embeddings, MoE layers with
router and expert biases and the clamped SwiGLU) <-> transformers' GptOssForCausalLM.

The checkpoint is saved by megatron-core's own ``dist_checkpointing.save`` from its own GPTModel (local spec, its 4
experts over 2 gloo ranks: EP=2, ``_megatron.py``), and megatron-core's forward of it is its own. The HF export must
equal a reference written here from torch's own reading of the checkpoint (HF's ``gate_up_proj`` interleaves the
gate and up columns that megatron-core's ``linear_fc1`` holds as gate rows, then up rows), load in transformers with
nothing missing or unexpected, and give megatron-core's logits. ``convert --to megatron`` of that export must load in
megatron-core at TP=2 (no expert parallelism) with every parameter equal and the same logits, and export back to the
same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_dcp, load_hf
from _megatron import SEQ, VOCAB, loaded, saved, saved_with_logits, tokens

pytest.importorskip("megatron.core")

LAYERS, EXPERTS, FFN, HIDDEN = 2, 4, 48, 32


def _hf_config():
    import transformers

    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=EXPERTS, num_experts_per_tok=2, rms_norm_eps=1e-6,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        max_position_embeddings=SEQ * 2, swiglu_limit=7.0, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4})


def _hf_model(path: Path):
    """transformers' GptOssForCausalLM loaded from ``path``: nothing missing, unexpected or mismatched."""
    import transformers

    model, info = transformers.GptOssForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                 torch_dtype=torch.float32, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's last dim of GPT-OSS's experts: gate and up elements taken in turn (its forward reads gate as
    ``[..., ::2]`` and up as ``[..., 1::2]``)."""
    return torch.stack([gate, up], -1).flatten(-2)


def _reference(megatron: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core's names and layout turned into HF GPT-OSS's by hand: the oracle for the table."""
    out = {"model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"],
           "model.norm.weight": megatron["decoder.final_layernorm.weight"],
           "lm_head.weight": megatron["output_layer.weight"]}
    for n in range(LAYERS):
        h = f"model.layers.{n}."

        def get(name: str, n: int = n) -> torch.Tensor:
            return megatron[f"decoder.layers.{name}"][n]

        out[h + "input_layernorm.weight"] = get("self_attention.linear_qkv.layer_norm_weight")
        out[h + "post_attention_layernorm.weight"] = get("mlp.linear_fc1.layer_norm_weight")
        for suffix in ("weight", "bias"):  # per query group (2 of them): its 2 q heads, its k head, its v head
            fused = get(f"self_attention.linear_qkv.{suffix}")
            parts = fused.reshape(2, 4 * 8, *fused.shape[1:]).split([16, 8, 8], 1)
            for x, part in zip("qkv", parts, strict=True):
                out[f"{h}self_attn.{x}_proj.{suffix}"] = part.reshape(-1, *fused.shape[1:])
            out[f"{h}self_attn.o_proj.{suffix}"] = get(f"self_attention.linear_proj.{suffix}")
        out[h + "self_attn.sinks"] = get("self_attention.core_attention.softmax_offset")
        out[h + "mlp.router.weight"] = get("mlp.router.weight")
        out[h + "mlp.router.bias"] = get("mlp.router.bias")
        gate, up = get("mlp.experts.experts.linear_fc1.weight").chunk(2, 1)  # [experts, ffn, hidden] each
        out[h + "mlp.experts.gate_up_proj"] = _interleaved(gate.transpose(1, 2), up.transpose(1, 2))
        gate_bias, up_bias = get("mlp.experts.experts.linear_fc1.bias").chunk(2, 1)
        out[h + "mlp.experts.gate_up_proj_bias"] = _interleaved(gate_bias, up_bias)
        out[h + "mlp.experts.down_proj"] = get("mlp.experts.experts.linear_fc2.weight").transpose(1, 2)
        out[h + "mlp.experts.down_proj_bias"] = get("mlp.experts.experts.linear_fc2.bias")
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> dict:
    """megatron-core's GPT-OSS saved at EP=2 with Megatron-LM's args of the run, and its own forward; torch's
    reading of it; its HF export (``--preset auto``, from the CLI); that export converted back, and
    megatron-core's load of the conversion at TP=2."""
    from click.testing import CliRunner

    from ckptkit.cli import cli

    root = tmp_path_factory.mktemp("megatron-gpt-oss")
    ckpt, logits = saved_with_logits(root, "gpt_oss", 1)  # common.pt holds Megatron-LM's args of a GPT-OSS run
    _hf_config().save_pretrained(root / "assets")
    result = CliRunner().invoke(cli, ["export-hf", str(ckpt), str(root / "hf"), "--preset", "auto",
                                      "--hf-assets", str(root / "assets")])
    assert result.exit_code == 0, result.output
    report = ckptkit.convert(root / "hf", root / "mcore", to="megatron", world_size=2)
    return {"ckpt": ckpt, "logits": logits, "oracle": load_dcp(ckpt, root / "oracle.pt"), "hf": root / "hf",
            "mcore": root / "mcore", "notes": report.notes, "cli": result.output,
            "loaded": loaded(root, "gpt_oss_tp", 2, root / "mcore", forward=True)}


def test_megatron_export_hf_of_gpt_oss_equals_the_reference_and_loads_in_transformers(gpt_oss):
    assert "megatron-gpt-oss" in gpt_oss["cli"], gpt_oss["cli"]
    assert_same_tree(load_hf(gpt_oss["hf"]), _reference(gpt_oss["oracle"]))
    _hf_model(gpt_oss["hf"])


def test_megatron_export_hf_of_gpt_oss_gives_megatrons_own_logits_in_transformers(gpt_oss):
    with torch.no_grad():
        logits = _hf_model(gpt_oss["hf"])(tokens()).logits
    difference = (logits - gpt_oss["logits"]).abs().max().item()
    print(f"gpt_oss: largest logit difference, transformers vs megatron-core: {difference:.3g}")
    assert difference < 1e-5


def test_megatron_export_hf_of_gpt_oss_with_the_named_preset_writes_the_same_bytes(gpt_oss, tmp_path):
    ckptkit.export_hf(gpt_oss["ckpt"], tmp_path / "hf", preset="megatron-gpt-oss", hf_assets=gpt_oss["hf"],
                      max_memory=1 << 12)  # boxes of a few rows: the interleave and transpose stream
    for f in gpt_oss["hf"].iterdir():
        assert (tmp_path / "hf" / f.name).read_bytes() == f.read_bytes(), f.name


def test_megatron_convert_to_megatron_of_gpt_oss_loads_at_another_parallelism_with_every_parameter_equal(gpt_oss):
    assert any("--preset megatron-gpt-oss" in n for n in gpt_oss["notes"]), gpt_oss["notes"]
    params = gpt_oss["loaded"]["params"]
    expected = {k: v for k, v in gpt_oss["oracle"].items() if isinstance(v, torch.Tensor)}
    assert set(params) == set(expected)
    assert_same_tree(params, expected)
    difference = (gpt_oss["loaded"]["logits"] - gpt_oss["logits"]).abs().max().item()
    assert difference < 1e-5, difference  # TP=2 sums in another order than EP=2


def test_megatron_convert_to_megatron_of_gpt_oss_writes_megatrons_keys_and_exports_back_to_the_same_bytes(
        gpt_oss, tmp_path):
    ours, theirs = ckptkit.inspect(gpt_oss["mcore"]), ckptkit.inspect(gpt_oss["ckpt"])
    assert {t.key: t.shape for t in ours.tensors} == {t.key: t.shape for t in theirs.tensors}
    ckptkit.export_hf(gpt_oss["mcore"], tmp_path / "back", preset="megatron-gpt-oss", hf_assets=gpt_oss["hf"])
    for f in gpt_oss["hf"].iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("args, refused", [
    ({"quick_geglu": False, "swiglu": False}, "quick_geglu False"),  # not gated: no gate and up rows to interleave
    ({"softmax_type": "vanilla"}, "softmax_type 'vanilla'"),  # no sinks
    ({"glu_linear_offset": 0.0}, "glu_linear_offset 0.0"),  # HF's GPT-OSS adds 1 to the up projection
])
def test_megatron_export_hf_of_gpt_oss_refuses_run_arguments_its_table_does_not_map(gpt_oss, tmp_path, args,
                                                                                       refused):
    from click.testing import CliRunner

    from ckptkit.cli import cli

    result = CliRunner().invoke(cli, ["export-hf", str(gpt_oss["ckpt"]), str(tmp_path / "hf"), "--preset",
                                      "megatron-gpt-oss", "--hf-assets", str(gpt_oss["hf"]), "--megatron-args",
                                      json.dumps(args)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert f"--preset megatron-gpt-oss: {refused} (" in result.output
    assert not (tmp_path / "hf").exists()


def test_megatron_export_hf_with_a_llama_table_refuses_a_quick_geglu_run():
    from ckptkit.models.megatron_args import RunArgs, for_run
    from ckptkit.models.registry import PRESETS

    with pytest.raises(ckptkit.UsageError, match="quick_geglu True .* a gated quick-GELU MLP"):
        for_run(PRESETS["megatron-llama"], None, RunArgs({"quick_geglu": True}, "common.pt's args"))


def test_megatron_export_hf_of_gpt_oss_refuses_the_singleton_local_shards_spelling_in_one_line(gpt_oss, tmp_path):
    from click.testing import CliRunner

    from ckptkit.cli import cli

    ckpt = saved(tmp_path, "gpt_oss_singletons", 1, with_args=False)  # each expert on its own, fc1 as _w and _v
    assert any(t.key.endswith("experts.experts.3.linear_fc1.weight_v") for t in ckptkit.inspect(ckpt).tensors)
    result = CliRunner().invoke(cli, ["export-hf", str(ckpt), str(tmp_path / "hf"), "--hf-assets", str(gpt_oss["hf"])])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "the nearest, --preset megatron-gpt-oss, does not know" in result.output
    assert not (tmp_path / "hf").exists()

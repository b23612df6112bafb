"""An HF output is checked against transformers' class of its ``--hf-assets`` config before it is written: keys
the class does not load, and weights of it that no key gives, are refused (a note under ``--preset none``).
transformers' own ``from_pretrained(output_loading_info=True)`` is the oracle for what the class loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptkit.cli import cli

transformers = pytest.importorskip("transformers")

FIELDS = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=4, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama as transformers saves it."""
    out = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**FIELDS)).save_pretrained(out)
    return out


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def loading_info(path: Path) -> dict:
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return info


def test_export_hf_of_the_configs_own_model_loads_and_says_so(llama, tmp_path):
    result = run("export-hf", llama / "model.safetensors", tmp_path / "hf", "--hf-assets", llama)
    assert result.exit_code == 0, result.output
    assert "every key loads in transformers' LlamaForCausalLM" in result.output
    info = loading_info(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_export_hf_refuses_keys_the_configs_class_does_not_load(llama, tmp_path):
    assets = tmp_path / "assets"
    transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, bos_token_id=0, eos_token_id=0,
                            tie_word_embeddings=False).save_pretrained(assets)
    result = run("export-hf", llama / "model.safetensors", tmp_path / "hf", "--hf-assets", assets)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "transformers' GPT2LMHeadModel does not load 11 of the keys to write ('model.embed_tokens.weight', " \
        in result.output
    assert "would initialise" in result.output and "--preset none writes the names as they are" in result.output
    assert not (tmp_path / "hf").exists()
    # --preset none writes them as asked, and says what transformers will not load: what transformers reports.
    kept = run("export-hf", llama / "model.safetensors", tmp_path / "hf", "--hf-assets", assets, "--preset", "none")
    assert kept.exit_code == 0, kept.output
    assert "--preset none: transformers' GPT2LMHeadModel (" in kept.output
    assert len(loading_info(tmp_path / "hf")["unexpected_keys"]) == 11
    assert "does not load 11 of the keys written" in kept.output


def test_export_hf_refuses_to_leave_a_weight_out_on_a_key_map(llama, tmp_path):
    bias = "model.layers.0.self_attn.q_proj.weight"
    result = run("export-hf", llama / "model.safetensors", tmp_path / "hf", "--hf-assets", llama,
                 "--key-map", json.dumps({bias: None}))
    assert result.exit_code == 2, result.output
    assert f"would initialise 1 of its weights afresh, which no key gives ('{bias}')" in result.output
    assert not (tmp_path / "hf").exists()


def test_convert_to_hf_with_hf_assets_checks_the_class_too(llama, tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    result = run("convert", tmp_path / "w.safetensors", tmp_path / "hf", "--to", "hf", "--hf-assets", llama)
    assert result.exit_code == 2, result.output
    assert "transformers' LlamaForCausalLM does not load 1 of the keys to write ('w')" in result.output


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_export_hf_leaves_out_a_quantization_config_the_written_weights_are_not_in(llama, tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    config = json.loads((llama / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, "quantization_config": FP8}))
    result = run("export-hf", llama / "model.safetensors", tmp_path / "hf", "--hf-assets", assets, "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "config.json: quantization_config (fp8) left out: the weights written are not quantized" in result.output
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in written and written["dtype"] == "bfloat16"
    info = loading_info(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_export_hf_keeps_the_quantization_config_of_fp8_weights_with_their_scales(tmp_path):
    weight = "model.layers.0.mlp.down_proj.weight"
    save_file({weight: torch.ones(128, 128).to(torch.float8_e4m3fn), weight + "_scale_inv": torch.ones(1, 1)},
              tmp_path / "fp8.safetensors")
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": FP8}))
    result = run("export-hf", tmp_path / "fp8.safetensors", tmp_path / "hf", "--hf-assets", assets)
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"] == FP8


def test_a_refusal_stands_when_transformers_answer_comes_from_the_cache(llama, tmp_path, monkeypatch):
    """The second export of the same keys against the same config asks transformers nothing (the answer is
    cached) and is refused the same way; a cache file that cannot be read is asked again."""
    from _checks import run_cli_watching_imports
    from ckptkit.models.classcache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assets = tmp_path / "assets"
    transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=16, bos_token_id=0, eos_token_id=0,
                            tie_word_embeddings=False).save_pretrained(assets)
    args = ("export-hf", str(llama / "model.safetensors"), str(tmp_path / "hf"), "--hf-assets", str(assets))
    first = run_cli_watching_imports(*args)
    again = run_cli_watching_imports(*args)
    assert first[0] == again[0] == 2
    assert first[1] == again[1] and "transformers' GPT2LMHeadModel does not load 11 of the keys" in again[1]
    assert "transformers" in first[2] and "transformers" not in again[2]
    assert not (tmp_path / "hf").exists()
    for kept in (tmp_path / "cache").rglob("*.json"):
        kept.write_text("{not json")
    broken = run_cli_watching_imports(*args)
    assert broken[:2] == first[:2] and "transformers" in broken[2]


def test_class_check_off_imports_neither_transformers_nor_torch_and_says_the_output_was_not_checked(
        llama, tmp_path, monkeypatch):
    """The first class check of a model imports torch and transformers' model code (seconds, hundreds of MB);
    CKPTKIT_CLASS_CHECK=0 skips it, and the report says what was not checked."""
    from _checks import run_cli_watching_imports
    from ckptkit.models.classcache import CACHE_ENV
    from ckptkit.models.hfclass import CHECK_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # nothing asked before
    monkeypatch.setenv(CHECK_ENV, "0")
    code, output, imported = run_cli_watching_imports("export-hf", str(llama / "model.safetensors"),
                                                      str(tmp_path / "hf"), "--hf-assets", str(llama))
    assert code == 0 and imported == set(), output
    assert "not checked against transformers' class of" in output and f"({CHECK_ENV}=0)" in output
    info = loading_info(tmp_path / "hf")
    assert not info["missing_keys"] and not info["unexpected_keys"]

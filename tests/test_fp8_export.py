"""``export-hf --dtype fp8``: a DeepSeek-V3 written back in its release form, checked against an independent
per-block computation, torch's ``QuantizedHuggingFaceStorageReader`` and transformers' own FP8 loading.

The model is transformers' ``DeepseekV3ForCausalLM`` (bf16, ``save_pretrained``), whose weights hold whole
128x128 tiles (the dense MLP, 256 wide) and partial ones (every dim under 128). transformers' own FP8
dequantization on CPU takes the block size from the scale grid (rows // grid rows), so it reads a tile right
only where a dim is a multiple of 128 or under it, as DeepSeek-V3's are; a weight of 200 x 300 is checked
against torch's reader alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import load_dcp, load_hf

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = tmp_path_factory.mktemp("deepseek_bf16")
    config = DeepseekV3Config(vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
                              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                              topk_group=1, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[:128, :128] = 0  # an all-zero tile: scale 0, values 0
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def fp8_export(bf16_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deepseek_fp8") / "hf"
    # Sharded, with its index, as the release is (torch's QuantizedHuggingFaceStorageReader reads the index).
    ckptkit.export_hf(bf16_model, out, hf_assets=bf16_model, dtype="fp8", max_memory=40_000, max_shard_size="100KB")
    return out


def reference_scales(w: torch.Tensor) -> torch.Tensor:
    """Each 128x128 tile's largest magnitude / 448, in float32, written out tile by tile."""
    rows, cols = w.shape
    out = torch.empty(-(-rows // 128), -(-cols // 128))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float().abs().max() / 448
    return out


def test_export_hf_fp8_writes_release_form_with_independent_block_scales(bf16_model, fp8_export):
    source, got = load_hf(bf16_model), load_hf(fp8_export)
    linear = [k for k, v in source.items() if v.dim() == 2 and k.endswith(("_proj.weight", "_proj_with_mqa.weight"))]
    assert linear and "model.layers.0.mlp.up_proj.weight" in linear
    for key in linear:
        assert got[key].dtype == torch.float8_e4m3fn, key
        assert got[key + "_scale_inv"].dtype == torch.float32
        assert torch.equal(got[key + "_scale_inv"], reference_scales(source[key])), key
    kept = set(source) - set(linear)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight"} <= kept
    assert all(torch.equal(got[k], source[k]) for k in kept)  # bf16 already: written unchanged
    assert set(got) == set(source) | {k + "_scale_inv" for k in linear}
    config = json.loads((fp8_export / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    assert config["dtype"] == "bfloat16"


def test_torchs_quantized_reader_reads_the_fp8_export_within_the_block_quantization_error(bf16_model, fp8_export):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    source = load_hf(bf16_model)
    got = load_hf(fp8_export)
    read = {k: torch.empty(v.shape, dtype=torch.float32) for k, v in got.items() if not k.endswith("_scale_inv")}
    dcp.load(read, storage_reader=QuantizedHuggingFaceStorageReader(str(fp8_export), target_dtype=torch.float32,
                                                                     block_size=128, thread_count=1))
    for key, w in source.items():
        w = w.float()
        if key + "_scale_inv" not in got:
            assert torch.equal(read[key], w), key
            continue
        scale = reference_scales(source[key]).repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0],
                                                                                                 :w.shape[1]]
        # e4m3 keeps 3 mantissa bits: half an ulp is |x| / 16 for normal values, 2^-10 of the scale below them.
        assert torch.all((read[key] - w).abs() <= w.abs() / 16 + scale / 1024), key
    assert torch.equal(read["model.layers.0.mlp.up_proj.weight"][:128, :128], torch.zeros(128, 128))


def test_transformers_loads_the_fp8_export_with_nothing_missing(fp8_export):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    model, info = AutoModelForCausalLM.from_pretrained(fp8_export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    got = load_hf(fp8_export)
    key = "model.layers.0.mlp.down_proj.weight"
    expected = _dequantize_fp8_weight(got[key], got[key + "_scale_inv"], [128, 128], torch.float32)
    loaded = model.state_dict()[key].float()
    # transformers dequantizes into the model's dtype (bf16 here): equal within bf16's rounding.
    assert torch.all((loaded - expected).abs() <= expected.abs() / 128), key


def test_export_hf_fp8_refuses_a_model_without_a_config(bf16_model, tmp_path):
    from ckptkit.errors import UsageError

    with pytest.raises(UsageError, match="--dtype fp8 names the quantization in config.json"):
        ckptkit.export_hf(bf16_model / "model.safetensors", tmp_path / "out", dtype="fp8")
    assert not (tmp_path / "out").exists()


def test_export_hf_fp8_cuts_partial_tiles_as_torchs_reader_reads_them(tmp_path):
    """A weight whose dims are not multiples of 128: its last tiles are partial in both dims."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    torch.manual_seed(0)
    key = "model.layers.0.mlp.down_proj.weight"
    w = torch.randn(200, 300).to(torch.bfloat16)
    (tmp_path / "src").mkdir()
    save_file({key: w, "model.norm.weight": torch.ones(300, dtype=torch.bfloat16)},
              tmp_path / "src" / "model.safetensors")
    # Not a whole model of a transformers class, so a model_type transformers does not know.
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "my-own-lm"}))
    ckptkit.export_hf(tmp_path / "src", tmp_path / "fp8", hf_assets=tmp_path / "src", dtype="fp8",
                      max_memory=20_000, max_shard_size="50KB")
    got = load_hf(tmp_path / "fp8")
    assert got[key + "_scale_inv"].shape == (2, 3)
    assert torch.equal(got[key + "_scale_inv"], reference_scales(w))
    read = {key: torch.empty(200, 300)}
    dcp.load(read, storage_reader=QuantizedHuggingFaceStorageReader(str(tmp_path / "fp8"), target_dtype=torch.float32,
                                                                     block_size=128, thread_count=1))
    scale = reference_scales(w).repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert torch.all((read[key] - w.float()).abs() <= w.float().abs() / 16 + scale / 1024)


def test_the_fp8_export_imports_back_as_torchs_quantized_reader_dequantizes_it(fp8_export, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    key = "model.layers.0.mlp.down_proj.weight"
    read = {key: torch.empty(load_hf(fp8_export)[key].shape)}
    dcp.load(read, storage_reader=QuantizedHuggingFaceStorageReader(str(fp8_export), target_dtype=torch.float32,
                                                                     block_size=128, thread_count=1))
    ckptkit.convert(fp8_export, tmp_path / "titan", to="sharded", world_size=2, preset="torchtitan-deepseek-v3")
    titan = {"layers.0.feed_forward.w2.weight": torch.empty(read[key].shape)}
    dcp.load(titan, checkpoint_id=str(tmp_path / "titan"))
    assert torch.equal(titan["layers.0.feed_forward.w2.weight"], read[key])


def test_export_hf_fp8_and_its_import_back_compute_without_torch_or_transformers(bf16_model, fp8_export, tmp_path):
    """The (de)quantization computes in numpy, and the class check's answer is cached: a second export of the
    same model imports neither torch nor transformers (their imports alone cost some 300 MB), and writes what
    the in-process export wrote."""
    from _checks import run_cli_watching_imports

    args = ["--hf-assets", str(bf16_model), "--dtype", "fp8", "--max-shard-size", "100KB", "--max-memory", "40000"]
    first = run_cli_watching_imports("export-hf", str(bf16_model), str(tmp_path / "first"), *args)
    assert first[0] == 0, first[1]
    code, output, imported = run_cli_watching_imports("export-hf", str(bf16_model), str(tmp_path / "fp8"), *args)
    assert code == 0, output
    assert imported == set(), output
    assert {p.name: p.read_bytes() for p in (tmp_path / "fp8").iterdir()} == {
        p.name: p.read_bytes() for p in fp8_export.iterdir()}
    code, output, imported = run_cli_watching_imports(
        "convert", str(fp8_export), str(tmp_path / "titan"), "--to", "sharded", "--world-size", "1", "--preset",
        "torchtitan-deepseek-v3", "--hf-assets", str(bf16_model))
    assert code == 0, output
    assert imported == set(), output
    back = load_dcp(tmp_path / "titan", tmp_path / "titan.pt")
    expected = load_hf(fp8_export)
    weight = "model.layers.0.mlp.up_proj.weight"
    scales = expected[weight + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    wanted = expected[weight].float() * scales[:256, :128]  # what torch's reader computes
    assert torch.equal(back["layers.0.feed_forward.w3.weight"].view(torch.int32), wanted.view(torch.int32))


def test_export_hf_fp8_with_the_releases_own_config_names_fp8_and_leaves_nothing_out(bf16_model, fp8_export, tmp_path):
    """A fine-tuned model written back in its release form with the release's folder as --hf-assets: the
    release's quantization_config is what the output holds, not a config "left out"."""
    ckptkit.export_hf(bf16_model, tmp_path / "again", hf_assets=fp8_export, dtype="fp8")
    notes = (tmp_path / "again" / "config.json").read_text()
    assert json.loads(notes)["quantization_config"]["weight_block_size"] == [128, 128]
    from click.testing import CliRunner

    from ckptkit.cli import cli

    result = CliRunner().invoke(cli, ["export-hf", str(bf16_model), str(tmp_path / "cli"), "--hf-assets",
                                      str(fp8_export), "--dtype", "fp8"])
    assert result.exit_code == 0, result.output
    assert "left out" not in result.output.replace("left out of --hf-assets", "")
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"] == json.loads(
        (fp8_export / "config.json").read_text())["quantization_config"]


def test_export_hf_fp8_with_workers_shares_the_weights_and_writes_what_one_process_writes(bf16_model, fp8_export,
                                                                                          tmp_path):
    report = ckptkit.export_hf(bf16_model, tmp_path / "two", hf_assets=bf16_model, dtype="fp8", max_memory=40_000,
                               max_shard_size="100KB", workers=2)
    assert report.workers == 2
    assert {p.name: p.read_bytes() for p in (tmp_path / "two").iterdir()} == {
        p.name: p.read_bytes() for p in fp8_export.iterdir()}

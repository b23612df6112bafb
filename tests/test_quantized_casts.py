"""A quantized release under every command: a cast writes values (each FP8 weight times its block scale, as
torch's ``QuantizedHuggingFaceStorageReader`` and transformers dequantize it, then cast), never float8 codes as if
they were values; a float8 scale is decoded by its dtype; what ckptkit cannot read as values is refused by name;
a command without a cast carries codes and scales as they are.

The release is transformers' own ``DeepseekV3ForCausalLM`` (``save_pretrained``) whose linear weights are
replaced by random float8 codes and random float32 block scales, saved with an index as the release is, and a
``quantization_config``: its dims (32 to 256) make whole and partial tiles.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import ckptkit
from _checks import load_dcp, load_hf
from ckptkit.cli import cli

pytest.importorskip("transformers")

QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def codes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random float8 e4m3fn codes, NaN's two codes left out (NaN is compared apart)."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return torch.where((raw & 0x7F) == 0x7F, raw - 1, raw).view(torch.float8_e4m3fn)


def save_release(out: Path, state: dict[str, torch.Tensor], config: dict) -> Path:
    """``state`` as one safetensors file with the index torch's quantized reader reads, and ``config``."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    root = tmp_path_factory.mktemp("deepseek_release")
    config = DeepseekV3Config(vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
                              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                              topk_group=1, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "bf16")
    state = load_hf(root / "bf16")
    gen = torch.Generator().manual_seed(1)
    for key in [k for k, v in state.items() if v.dim() == 2 and k.endswith(("_proj.weight", "_mqa.weight"))]:
        rows, cols = state[key].shape
        state[key] = codes((rows, cols), gen)
        state[key + "_scale_inv"] = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 2 ** -6
    meta = json.loads((root / "bf16" / "config.json").read_text())
    return save_release(root / "fp8", state, {**meta, "quantization_config": QUANTIZATION})


def blockwise(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each float8 value times its 128x128 tile's scale, both decoded by torch, in float32."""
    tiles = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight.float() * tiles[:weight.shape[0], :weight.shape[1]]


def torch_reader(release: Path, keys: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``keys`` of ``release`` as torch's ``QuantizedHuggingFaceStorageReader`` reads them, in float32."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    read = {k: torch.empty(shape) for k, shape in keys.items()}
    dcp.load(read, storage_reader=QuantizedHuggingFaceStorageReader(str(release), target_dtype=torch.float32,
                                                                     block_size=128, thread_count=1))
    return read


def test_export_hf_cast_of_an_fp8_release_writes_transformers_dequantized_weights_without_scales(release, tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    out = tmp_path / "bf16"
    result = CliRunner().invoke(cli, ["export-hf", str(release), str(out), "--hf-assets", str(release),
                                      "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert "dequantized 26 FP8 weights" in result.output and "quantization_config (fp8) left out" in result.output
    source, got = load_hf(release), load_hf(out)
    quantized = [k for k in source if k + "_scale_inv" in source]
    assert len(quantized) == 26 and set(got) == set(source) - {k + "_scale_inv" for k in quantized}
    for key in quantized:
        w, s = source[key], source[key + "_scale_inv"]
        expected = _dequantize_fp8_weight(w, s, [128, 128], torch.float32).to(torch.bfloat16)
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key].view(torch.int16),
                                                                expected.view(torch.int16)), key
        if all(n % 128 == 0 or n < 128 for n in w.shape):  # transformers' loader derives the tile from the grid
            loaded = Fp8Dequantize(None)._dequantize_one(w, s, torch.bfloat16)
            assert torch.equal(got[key].view(torch.int16), loaded.view(torch.int16)), key
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_convert_with_a_cast_writes_the_fp8_release_as_torchs_quantized_reader_reads_it(release, tmp_path):
    source = load_hf(release)
    dense, expert = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight"
    read = torch_reader(release, {k: tuple(source[k].shape) for k in (dense, expert)})
    ckptkit.convert(release, tmp_path / "titan", to="sharded", world_size=2, preset="torchtitan-deepseek-v3",
                    dtype="bf16")
    titan = load_dcp(tmp_path / "titan", tmp_path / "titan.pt")
    assert torch.equal(titan["layers.0.feed_forward.w2.weight"], read[dense].to(torch.bfloat16))
    assert torch.equal(titan["layers.1.moe.routed_experts.inner_experts.w3_EFD"][2], read[expert].to(torch.bfloat16))
    report = ckptkit.convert(release, tmp_path / "model.pt", to="full", dtype="fp16")
    full = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(full[dense], read[dense].to(torch.float16))
    assert not any(k.endswith("_scale_inv") for k in full) and all(v.dtype != torch.float8_e4m3fn
                                                                   for v in full.values())
    assert {k for k, _ in report.dropped} == {k for k in source if k.endswith("_scale_inv")}


def test_commands_without_a_cast_carry_the_codes_and_scales_as_they_are(release, tmp_path):
    source = load_hf(release)
    ckptkit.convert(release, tmp_path / "dcp", to="sharded", world_size=2)
    ckptkit.reshard(tmp_path / "dcp", tmp_path / "dcp3", world_size=3)
    ckptkit.export_hf(release, tmp_path / "hf", hf_assets=release)
    for got in (load_dcp(tmp_path / "dcp3", tmp_path / "dcp3.pt"), load_hf(tmp_path / "hf")):
        assert set(got) == set(source)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8))
                   for k, v in source.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"] == QUANTIZATION


def test_export_hf_fp8_of_an_fp8_release_writes_its_weights_and_scales_as_they_are(release, tmp_path):
    source = load_hf(release)
    report = ckptkit.export_hf(release, tmp_path / "fp8", hf_assets=release, dtype="fp8")
    got = load_hf(tmp_path / "fp8")
    for key in (k for k in source if k.endswith("_scale_inv")):
        weight = key.removesuffix("_scale_inv")
        assert torch.equal(got[key], source[key]) and got[key].dtype == torch.float32
        assert torch.equal(got[weight].view(torch.uint8), source[weight].view(torch.uint8))
    assert any("26 weights already FP8 written as they are" in n for n in report.notes)


def test_verify_compares_an_fp8_release_with_its_dequantized_copy_as_values(release, tmp_path):
    source = load_hf(release)
    copy = {k: blockwise(v, source[k + "_scale_inv"]).to(torch.bfloat16) if k + "_scale_inv" in source else v
            for k, v in source.items() if not k.endswith("_scale_inv")}
    save_file(copy, tmp_path / "copy.safetensors")
    report = ckptkit.verify(release, tmp_path / "copy.safetensors")
    assert report.ok, report
    assert any("26 quantized weights" in n for n in report.notes)
    key = "model.layers.1.self_attn.o_proj.weight"
    copy[key][3, 5] = -copy[key][3, 5] - 1
    save_file(copy, tmp_path / "copy.safetensors")
    report = ckptkit.verify(release, tmp_path / "copy.safetensors")
    assert [(d.key, d.mismatched, d.first_index) for d in report.differences] == [(key, 1, (3, 5))]


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float8_e5m2,
                                         torch.bfloat16])
def test_a_float8_block_scale_is_decoded_by_its_dtype_as_torch_and_transformers_decode_it(tmp_path, scale_dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(2)
    key = "model.layers.0.mlp.down_proj.weight"
    weight = codes((256, 384), gen)
    scale = (torch.rand(2, 3, generator=gen) * 4 + 2 ** -4).to(scale_dtype)  # an e8m0 scale rounds to 2^k
    src = save_release(tmp_path / "src", {key: weight, key + "_scale_inv": scale}, {"model_type": "my-own-lm"})
    ckptkit.export_hf(src, tmp_path / "fp32", dtype="fp32")
    got = load_hf(tmp_path / "fp32")[key]
    expected = blockwise(weight, scale)
    assert torch.equal(got, expected)
    assert torch.equal(got, Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32))


@pytest.mark.parametrize(("state", "dtype", "refused"), [
    # per-tensor FP8 (compressed-tensors, FBGEMM): a scale ckptkit does not apply
    ({"l.weight": "float8", "l.weight_scale": torch.ones(1)}, "bf16", "'l.weight"),
    # float8 codes whose scale is missing, beside others with theirs
    ({"a.weight": "float8", "a.weight_scale_inv": torch.ones(1, 1), "l.weight": "float8"}, "fp32",
     "'l.weight' is float8_e4m3fn without 'l.weight_scale_inv'"),
    # an integer scale: e8m0 exponents as uint8 or a count, not a value
    ({"l.weight": "float8", "l.weight_scale_inv": torch.ones(1, 1, dtype=torch.uint8)}, "bf16",
     "'l.weight_scale_inv': uint8; an FP8 block scale is read by value"),
    # MXFP4 under --dtype fp8: already quantized in another form
    ({"e_blocks": torch.zeros(2, 4, 1, 16, dtype=torch.uint8), "e_scales": torch.zeros(2, 4, 1, dtype=torch.uint8),
      "l_proj.weight": torch.ones(4, 4)}, "fp8", "'e_blocks' (uint8, [2, 4, 1, 16]) is already quantized"),
])
def test_a_cast_refuses_a_quantized_form_it_cannot_read_as_values_in_one_line(tmp_path, state, dtype, refused):
    state = {k: codes((4, 4), torch.Generator().manual_seed(0)) if v == "float8" else v for k, v in state.items()}
    src = save_release(tmp_path / "src", state, {"model_type": "my-own-lm"})
    for command in (["export-hf", str(src), str(tmp_path / "out"), "--hf-assets", str(src)],
                    ["convert", str(src), str(tmp_path / "out"), "--to", "full"]):
        if dtype == "fp8" and command[0] == "convert":
            continue
        result = CliRunner().invoke(cli, [*command, "--dtype", dtype])
        assert result.exit_code == 2, result.output
        assert refused in result.output and len(result.output.strip().splitlines()) == 1, result.output
        assert not (tmp_path / "out").exists()


def test_ckptkit_load_of_an_fp8_release_into_a_bf16_model_loads_transformers_dequantized_weights(release):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    config = AutoConfig.from_pretrained(release)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    # not strict: transformers 5 holds the routed experts fused, which the release names one by one
    ckptkit.load(release, model, strict=False)
    source, loaded = load_hf(release), model.state_dict()
    for key in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"):
        expected = _dequantize_fp8_weight(source[key], source[key + "_scale_inv"], [128, 128], torch.float32)
        assert torch.equal(loaded[key], expected.to(torch.bfloat16)), key

"""GPT-OSS's MXFP4 experts (``*_blocks`` uint8, two FP4 values a byte; ``*_scales`` e8m0) dequantized on import,
against transformers' own MXFP4 dequantization (``transformers.integrations.mxfp4.convert_moe_packed_tensors``)
and read back by torch's ``dcp.load``.

The model is transformers' own ``GptOssForCausalLM`` with dims that MXFP4's 32-value blocks divide, saved by
``save_pretrained``; its expert weights are then replaced by random MXFP4 blocks and scales in the released
checkpoints' layout (``gate_up_proj_blocks`` ``[experts, 2 x intermediate, hidden / 32, 16]``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import load_hf

pytest.importorskip("transformers")

EXPERTS, HIDDEN, INTERMEDIATE = 4, 64, 32
_INNER = "layers.{n}.moe.routed_experts.inner_experts."


@pytest.fixture(scope="module")
def mxfp4_release(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GPT-OSS folder whose experts are MXFP4, as the released weights are, and its quantized tensors."""
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    config = GptOssConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS,
                          num_experts_per_tok=2, max_position_embeddings=64, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    GptOssForCausalLM(config).save_pretrained(out)
    state = load_hf(out)
    g = torch.Generator().manual_seed(1)
    quantized = {}
    for n in range(2):
        for proj, rows, cols in (("gate_up_proj", 2 * INTERMEDIATE, HIDDEN), ("down_proj", HIDDEN, INTERMEDIATE)):
            name = f"model.layers.{n}.mlp.experts.{proj}"
            del state[name]
            quantized[name + "_blocks"] = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8,
                                                        generator=g)
            quantized[name + "_scales"] = torch.randint(118, 134, (EXPERTS, rows, cols // 32), dtype=torch.uint8,
                                                        generator=g)
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    save_file({**state, **quantized}, out / "model.safetensors")
    meta = json.loads((out / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                       "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(meta))
    return out, quantized


def transformers_dequantized(quantized: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """HF's ``[experts, in, out]`` expert weight, as transformers dequantizes it on load."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(quantized[name + "_blocks"], quantized[name + "_scales"])


def dcp_read(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, read by torch's own ``dcp.load`` into templates of the stored shapes."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(directory)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if hasattr(m, "size")}
    dcp.load(state, checkpoint_id=str(directory))
    return state


@pytest.mark.parametrize("max_memory", [None, 3000])  # whole tensors; boxes that cut the 32-value blocks
def test_convert_gpt_oss_mxfp4_to_torchtitan_equals_transformers_dequantization(mxfp4_release, tmp_path,
                                                                              max_memory):
    src, quantized = mxfp4_release
    options = {"max_memory": max_memory} if max_memory else {}
    report = ckptkit.convert(src, tmp_path / "titan", to="sharded", world_size=2, preset="torchtitan-gpt-oss",
                             hf_assets=src, **options)
    got = dcp_read(tmp_path / "titan")
    for n in range(2):
        for leaf, proj in (("mlp1_weight_EGD", "gate_up_proj"), ("mlp2_weight_EDF", "down_proj")):
            hf = transformers_dequantized(quantized, f"model.layers.{n}.mlp.experts.{proj}")
            # torchtitan holds the transpose of HF's [experts, in, out]: the blocks' own [experts, rows, values].
            expected = hf.transpose(1, 2).contiguous()
            value = got[_INNER.format(n=n) + leaf]
            assert value.dtype == torch.bfloat16 and torch.equal(value, expected), (n, leaf)
    assert not any(k.endswith(("_blocks", "_scales")) for k in got)
    assert report.tensors == len(got)


def test_export_back_to_hf_gives_transformers_dequantized_experts(mxfp4_release, tmp_path):
    src, quantized = mxfp4_release
    ckptkit.convert(src, tmp_path / "titan", to="sharded", world_size=1, preset="torchtitan-gpt-oss", hf_assets=src)
    ckptkit.export_hf(tmp_path / "titan", tmp_path / "hf", hf_assets=src, preset="torchtitan-gpt-oss")
    back = load_hf(tmp_path / "hf")
    name = "model.layers.1.mlp.experts.down_proj"
    assert torch.equal(back[name], transformers_dequantized(quantized, name))


def test_convert_gpt_oss_mxfp4_to_megatron_writes_dequantized_experts_as_gate_then_up_rows_and_exports_back(
        mxfp4_release, tmp_path):
    src, quantized = mxfp4_release
    ckptkit.convert(src, tmp_path / "mcore", to="megatron", world_size=2, max_memory=3000)
    got = dcp_read(tmp_path / "mcore")
    for n in range(2):
        hf = transformers_dequantized(quantized, f"model.layers.{n}.mlp.experts.gate_up_proj")  # [E, in, 2 x out]
        # megatron-core's linear_fc1: [E, 2 x out, in], the gate rows (HF's even columns), then the up rows.
        expected = torch.cat([hf[..., 0::2], hf[..., 1::2]], -1).transpose(1, 2)
        assert torch.equal(got["decoder.layers.mlp.experts.experts.linear_fc1.weight"][n], expected), n
        down = transformers_dequantized(quantized, f"model.layers.{n}.mlp.experts.down_proj")
        assert torch.equal(got["decoder.layers.mlp.experts.experts.linear_fc2.weight"][n], down.transpose(1, 2)), n
    assert not any(k.endswith(("_blocks", "_scales")) for k in got)
    ckptkit.export_hf(tmp_path / "mcore", tmp_path / "hf", hf_assets=src, preset="megatron-gpt-oss")
    back = load_hf(tmp_path / "hf")  # HF's interleaved gate_up_proj again, as transformers dequantizes it
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(back[name], transformers_dequantized(quantized, name))
    from transformers import GptOssForCausalLM

    _, info = GptOssForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_export_hf_cast_of_the_mxfp4_release_writes_transformers_dequantized_experts(mxfp4_release, tmp_path, dtype):
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, quantized = mxfp4_release
    report = ckptkit.export_hf(src, tmp_path / "hf", hf_assets=src, dtype=dtype)
    got = load_hf(tmp_path / "hf")
    wanted = torch.bfloat16 if dtype == "bf16" else torch.float32
    for name in (k.removesuffix("_blocks") for k in quantized if k.endswith("_blocks")):
        expected = convert_moe_packed_tensors(quantized[name + "_blocks"], quantized[name + "_scales"], dtype=wanted)
        assert got[name].dtype == wanted and torch.equal(got[name], expected), name
    assert not any(k.endswith(("_blocks", "_scales")) for k in got)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert any("dequantized 4 MXFP4 weights" in n for n in report.notes)
    _, info = GptOssForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    checked = ckptkit.verify(src, tmp_path / "hf")  # the rest of the model is float32 in the source, cast here
    assert [d.key for d in checked.differences if d.key.endswith(("gate_up_proj", "down_proj"))] == []
    assert any("4 quantized weights" in n for n in checked.notes)


def test_mxfp4_scales_typed_e8m0_are_read_as_their_exponent_bytes(mxfp4_release, tmp_path):
    """``float8_e8m0fnu`` scales hold the same byte as the released uint8 exponents (2^(b - 127)); e8m0's NaN code
    gives NaN."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, quantized = mxfp4_release
    state = load_hf(src)
    name = "model.layers.0.mlp.experts.down_proj"
    exponents = state[name + "_scales"].clone()
    exponents[1, 2, 0] = 0xFF
    state[name + "_scales"] = exponents.view(torch.float8_e8m0fnu)
    (tmp_path / "src").mkdir()
    save_file(state, tmp_path / "src" / "model.safetensors")
    (tmp_path / "src" / "config.json").write_bytes((src / "config.json").read_bytes())
    ckptkit.export_hf(tmp_path / "src", tmp_path / "hf", dtype="bf16")
    got = load_hf(tmp_path / "hf")[name]
    expected = convert_moe_packed_tensors(quantized[name + "_blocks"], exponents)
    scale = exponents.view(torch.float8_e8m0fnu).float().repeat_interleave(32, -1).transpose(1, 2)
    nan = scale.isnan()
    assert nan.sum() == 32 and got[nan].isnan().all()
    assert torch.equal(got[~nan], expected[~nan])

"""torchtitan 0.3's multimodal families both ways, against torchtitan's own state-dict adapters and transformers:
Kimi K2.5 (``kimi_k2_7``), Qwen3.5 (``qwen3_5``, dense and MoE) and Muse Glimmer (``muse_glimmer``, multimodal).

Tiny models of torchtitan's own classes (:mod:`_titan_families`) are saved as torchtitan's CheckpointManager
saves them, over 2 gloo ranks, once for the module. Then:

- ``export-hf`` equals torchtitan's ``to_hf()`` of the same state dict, key for key and bit for bit, and the
  transformers class of the family loads it with nothing missing, unexpected or mismatched;
- an HF checkpoint of each family (``to_hf()`` of another torchtitan model: the release layout) converts to a
  torchtitan DCP that torchtitan's strict ``dcp.load`` of its whole model reads as ``from_hf()`` of the same
  weights, and back to HF unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_hf
from _spawn import spawn

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
import _titan_families as fam  # noqa: E402  (imports torchtitan's models lazily, after the skip)

NAMES = ("kimi_k2_7", "qwen3_5", "qwen3_5_moe", "muse_glimmer", "muse_glimmer_text")
_PRESETS = {"kimi_k2_7": "torchtitan-kimi-k2.5", "qwen3_5": "torchtitan-qwen3.5",
            "qwen3_5_moe": "torchtitan-qwen3.5-moe", "muse_glimmer": "torchtitan-muse-glimmer",
            "muse_glimmer_text": "torchtitan-muse-glimmer"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("titan_vlm_families")
    spawn(fam.save_families, 2, str(out), NAMES)
    return out


def to_hf(name: str, state: dict) -> dict:
    """torchtitan's ``to_hf()`` of ``state``. torchtitan 0.3.0's Qwen3.5-MoE adapter writes the experts
    transposed (``gate_up_proj`` ``[experts, dim, 2 x hidden]``), which transformers cannot load: for those
    tensors the oracle is transformers' ``Qwen3_5MoeExperts`` layout, ``[experts, 2 x hidden, dim]`` (gate rows,
    then up rows) and ``down_proj`` ``[experts, dim, hidden]``: torchtitan's own tensors, joined along dim 1."""
    config, adapter, _ = fam.family(name)
    out = adapter(config, None).to_hf({k: v.clone() for k, v in state.items()})
    for layer in _moe_layers(name, state):
        experts = f"layers.{layer}.moe.routed_experts.inner_experts."
        hf = f"model.language_model.layers.{layer}.mlp.experts."
        out[hf + "gate_up_proj"] = torch.cat([state[experts + "w1_EFD"], state[experts + "w3_EFD"]], dim=1)
        out[hf + "down_proj"] = state[experts + "w2_EDF"]
    return out


def from_hf(name: str, hf: dict) -> dict:
    """torchtitan's ``from_hf()`` of ``hf`` (Qwen3.5-MoE's experts as in :func:`to_hf`)."""
    config, adapter, _ = fam.family(name)
    out = adapter(config, None).from_hf(dict(hf))
    for layer in _moe_layers(name, out):
        experts = f"layers.{layer}.moe.routed_experts.inner_experts."
        gate_up = hf[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"]
        out[experts + "w1_EFD"], out[experts + "w3_EFD"] = (t.contiguous() for t in gate_up.chunk(2, dim=1))
        out[experts + "w2_EDF"] = hf[f"model.language_model.layers.{layer}.mlp.experts.down_proj"]
    return out


def _moe_layers(name: str, state: dict) -> list[str]:
    return sorted({k.split(".")[1] for k in state if name == "qwen3_5_moe" and ".inner_experts." in k})


def hf_class_loads(directory: Path) -> None:
    """The transformers class that ``config.json`` names loads ``directory`` with nothing missing, unexpected or
    mismatched."""
    import transformers

    config = json.loads((directory / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    _, info = cls.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("name", NAMES)
def test_export_hf_equals_torchtitans_to_hf_and_loads_in_transformers(saved, tmp_path, name):
    expected = to_hf(name, torch.load(saved / name / "expected.pt", weights_only=True))
    ckptkit.export_hf(saved / name / "step-0", tmp_path / "hf", hf_assets=saved / name / "assets")
    assert_same_tree(load_hf(tmp_path / "hf"), expected)
    if name != "muse_glimmer_text":  # transformers' Muse Glimmer class holds a vision tower
        hf_class_loads(tmp_path / "hf")


def hf_dir(name: str, state: dict, out: Path) -> Path:
    from safetensors.torch import save_file

    fam.write_hf_assets(name, out)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_convert_hf_to_torchtitan_dcp_resumes_in_torchtitan_as_from_hf_and_exports_back(tmp_path, name):
    import torch.distributed.checkpoint as dcp

    hf = {k: v.contiguous() for k, v in to_hf(name, fam.build(name, seed=1).state_dict()).items()}
    src = hf_dir(name, hf, tmp_path / "hf")
    expected = from_hf(name, hf)
    ckptkit.convert(src, tmp_path / "titan", to="sharded", world_size=2, preset=_PRESETS[name])
    state = fam.build(name, seed=5).state_dict()  # torchtitan's whole model: a strict load
    dcp.load(state, checkpoint_id=str(tmp_path / "titan"))
    initial = fam.build(name, seed=5, perturb=False).state_dict()
    assert_same_tree(state, {k: expected.get(k, v) for k, v in initial.items()})
    ckptkit.export_hf(tmp_path / "titan", tmp_path / "back", hf_assets=src)
    assert_same_tree(load_hf(tmp_path / "back"), hf)


def test_export_hf_qwen3_5_moe_experts_compute_in_transformers_what_they_compute_in_torchtitan(saved, tmp_path):
    """The experts in transformers' layout are the same function: transformers' MoE block of each exported layer
    gives torchtitan's MoE output for the same input (the router's load-balancing bias, which HF has no tensor
    for and which only moves the expert choice, at zero on both sides)."""
    import transformers

    state = torch.load(saved / "qwen3_5_moe" / "expected.pt", weights_only=True)
    ckptkit.export_hf(saved / "qwen3_5_moe" / "step-0", tmp_path / "hf", hf_assets=saved / "qwen3_5_moe" / "assets")
    hf_model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    titan = fam.build("qwen3_5_moe", seed=5)
    titan.load_state_dict({k: torch.zeros_like(v) if k.endswith("expert_bias_E") else v for k, v in state.items()})
    x = torch.randn(2, 7, fam.DIM, generator=torch.Generator().manual_seed(0))
    for layer in range(2):
        with torch.no_grad():
            theirs = titan.layers[str(layer)].moe(x)
            ours = hf_model.model.language_model.layers[layer].mlp(x)
        # torchtitan's grouped experts multiply in bfloat16: agreement within its rounding (a transposed or
        # misordered layout is off by the output's own size)
        assert (ours - theirs).abs().max() <= 2e-2 * theirs.abs().max(), layer


def test_convert_hf_to_torchtitan_refuses_qwen3_5_moe_experts_in_torchtitan_0_3_0s_transposed_layout(tmp_path):
    from ckptkit.errors import UsageError

    config, adapter, _ = fam.family("qwen3_5_moe")
    hf = adapter(config, None).to_hf(fam.build("qwen3_5_moe", seed=1).state_dict())  # gate_up_proj [E, D, 2F]
    src = hf_dir("qwen3_5_moe", {k: v.contiguous() for k, v in hf.items()}, tmp_path / "hf")
    with pytest.raises(UsageError, match=r"gate_up_proj' has 64 along dim 1, but its parts .* take 24 \+ 24"):
        ckptkit.convert(src, tmp_path / "titan", to="sharded", world_size=2, preset="torchtitan-qwen3.5-moe")

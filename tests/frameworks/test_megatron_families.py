"""The Megatron tables beyond Llama and Qwen3: Qwen2 (q/k/v biases), Mixtral (MoE without q/k norms), Qwen2-MoE
(a gated shared expert, a dense first layer: per-layer keys) and DeepSeek-V3 (multi-latent attention, shared
experts, the router's expert bias, a dense first layer).

Each family's checkpoint is saved by megatron-core's own ``dist_checkpointing.save`` from its own GPTModel (local
spec, TP=2, or EP=2 for Mixtral, on 2 gloo ranks, ``_megatron.py``). Its HF export must equal a reference written
here from torch's own reading of the checkpoint, and load in transformers' class with nothing missing or
unexpected. ``convert --to megatron`` of that HF model must load in megatron-core (``dist_checkpointing.load``, at
TP=1) with every parameter equal to the original's, give the transformers model's logits in megatron-core's
forward (DeepSeek-V3's with plain softmax attention in place of TE's, ``_megatron._Attention``), and export back
to the same bytes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_dcp, load_hf
from _megatron import SEQ, VOCAB, loaded, megatron_lm_args, saved, tokens

pytest.importorskip("megatron.core")

PRESETS = {"qwen2": "megatron-qwen2", "mixtral": "megatron-mixtral", "qwen2_moe": "megatron-qwen2-moe",
           "deepseek_v3": "megatron-deepseek-v3"}


def _hf_config(family: str):
    """The HF config of ``_megatron.FAMILIES[family]``."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=SEQ * 2)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=48)
    if family == "qwen2":
        return transformers.Qwen2Config(**fields)
    if family == "mixtral":
        return transformers.MixtralConfig(**{**fields, "intermediate_size": 48}, num_local_experts=4,
                                          num_experts_per_tok=2)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**fields, **moe, num_experts=4, shared_expert_intermediate_size=40,
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])
    return transformers.DeepseekV3Config(**{**fields, "num_key_value_heads": 4, "head_dim": 4}, **moe,
                                         n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                         q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                         v_head_dim=8, n_group=1, topk_group=1, routed_scaling_factor=1.0)


def _hf_model(family: str, path: Path):
    """transformers' own class of ``family``, loaded from ``path``: nothing missing, unexpected or mismatched."""
    import transformers

    cls = {"qwen2": transformers.Qwen2ForCausalLM, "mixtral": transformers.MixtralForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM}[family]
    model, info = cls.from_pretrained(path, output_loading_info=True, torch_dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


class _Layers:
    """A megatron-core checkpoint's layer tensors by layer, in either spelling (layer-stacked or per layer)."""

    def __init__(self, megatron: dict[str, torch.Tensor]) -> None:
        self.megatron = megatron

    def get(self, n: int, name: str) -> torch.Tensor | None:
        per_layer = self.megatron.get(f"decoder.layers.{n}.{name}")
        stacked = self.megatron.get(f"decoder.layers.{name}")
        return per_layer if per_layer is not None else None if stacked is None else stacked[n]


def _qkv(fused: torch.Tensor, groups: int = 2, per_group: int = 2, head_dim: int = 8) -> list[torch.Tensor]:
    """q, k, v of megatron-core's fused tensor: per query group, its q rows, then its k rows, then its v rows."""
    grouped = fused.reshape(groups, (per_group + 2) * head_dim, *fused.shape[1:])
    return [p.reshape(-1, *fused.shape[1:]) for p in grouped.split([per_group * head_dim, head_dim, head_dim], 1)]


def _swiglu(out: dict, hf: str, fc1: torch.Tensor, fc2: torch.Tensor, names=("gate_proj", "up_proj", "down_proj")):
    gate, up = fc1.chunk(2)
    out[f"{hf}{names[0]}.weight"], out[f"{hf}{names[1]}.weight"], out[f"{hf}{names[2]}.weight"] = gate, up, fc2


def _reference(family: str, megatron: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core's names and layout turned into the HF family's by hand: the oracle for the tables."""
    out = {"model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"],
           "model.norm.weight": megatron["decoder.final_layernorm.weight"],
           "lm_head.weight": megatron["output_layer.weight"]}
    layers = _Layers(megatron)
    for n in range(2):
        h, get = f"model.layers.{n}.", lambda name, n=n: layers.get(n, name)
        if family == "deepseek_v3":
            out[h + "input_layernorm.weight"] = get("input_layernorm.weight")
            out[h + "post_attention_layernorm.weight"] = get("pre_mlp_layernorm.weight")
            lora = (("q_a_proj", "linear_q_down_proj"), ("q_a_layernorm", "q_layernorm"),
                    ("q_b_proj", "linear_q_up_proj"))
            q = (("q_proj", "linear_q_proj"),) if get("self_attention.linear_q_proj.weight") is not None else lora
            for hf, mg in (*q, ("kv_a_proj_with_mqa", "linear_kv_down_proj"),
                           ("kv_a_layernorm", "kv_layernorm"), ("kv_b_proj", "linear_kv_up_proj"),
                           ("o_proj", "linear_proj")):
                out[f"{h}self_attn.{hf}.weight"] = get(f"self_attention.{mg}.weight")
        else:
            out[h + "input_layernorm.weight"] = get("self_attention.linear_qkv.layer_norm_weight")
            out[h + "post_attention_layernorm.weight"] = get("mlp.linear_fc1.layer_norm_weight")
            for x, part in zip("qkv", _qkv(get("self_attention.linear_qkv.weight")), strict=True):
                out[f"{h}self_attn.{x}_proj.weight"] = part
            if family in ("qwen2", "qwen2_moe"):
                for x, part in zip("qkv", _qkv(get("self_attention.linear_qkv.bias")), strict=True):
                    out[f"{h}self_attn.{x}_proj.bias"] = part
            out[h + "self_attn.o_proj.weight"] = get("self_attention.linear_proj.weight")
        if get("mlp.linear_fc1.weight") is not None:
            _swiglu(out, h + "mlp.", get("mlp.linear_fc1.weight"), get("mlp.linear_fc2.weight"))
            continue
        moe = h + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        out[moe + "gate.weight"] = get("mlp.router.weight")
        fc1, fc2 = get("mlp.experts.experts.linear_fc1.weight"), get("mlp.experts.experts.linear_fc2.weight")
        for e in range(4):
            _swiglu(out, f"{moe}experts.{e}.", fc1[e], fc2[e], ("w1", "w3", "w2") if family == "mixtral" else
                    ("gate_proj", "up_proj", "down_proj"))
        shared = get("mlp.shared_experts.linear_fc1.weight")
        if family == "qwen2_moe":
            _swiglu(out, h + "mlp.shared_expert.", shared, get("mlp.shared_experts.linear_fc2.weight"))
            out[h + "mlp.shared_expert_gate.weight"] = get("mlp.shared_experts.gate_weight")
        if family == "deepseek_v3":
            _swiglu(out, h + "mlp.shared_experts.", shared, get("mlp.shared_experts.linear_fc2.weight"))
            out[h + "mlp.gate.e_score_correction_bias"] = get("mlp.router.expert_bias")
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron-families")


@pytest.fixture(scope="module", params=list(PRESETS))
def family(request, tmp) -> dict:
    """``family``'s checkpoint saved by megatron-core at TP=2, read by torch; its HF export by ckptkit; that export
    converted back by ckptkit, and megatron-core's own load of the conversion at TP=1 (with its forward)."""
    name = request.param
    root = tmp / name
    root.mkdir()
    ckpt = saved(root, name, 1 if name == "mixtral" else 2, with_args=False)  # Mixtral: at EP=2 instead
    assets = root / "assets"
    _hf_config(name).save_pretrained(assets)
    hf = root / "hf"
    ckptkit.export_hf(ckpt, hf, preset=PRESETS[name], hf_assets=assets)
    ckptkit.convert(hf, root / "mcore", to="megatron", world_size=2)
    result = loaded(root, name, 1, root / "mcore", forward=True)
    return {"name": name, "ckpt": ckpt, "oracle": load_dcp(ckpt, root / "oracle.pt"), "hf": hf, "loaded": result,
            "mcore": root / "mcore"}


def test_megatron_export_hf_of_each_family_equals_the_reference_and_loads_in_transformers(family):
    assert_same_tree(load_hf(family["hf"]), _reference(family["name"], family["oracle"]))
    _hf_model(family["name"], family["hf"])


def test_megatron_convert_to_megatron_of_each_family_loads_in_megatron_with_every_parameter_equal(family):
    params = family["loaded"]["params"]
    expected = {k: v for k, v in family["oracle"].items() if isinstance(v, torch.Tensor)}
    assert set(params) == set(expected)
    assert_same_tree(params, expected)


def test_megatron_convert_to_megatron_of_each_family_writes_megatrons_keys_and_layout(family):
    ours, theirs = ckptkit.inspect(family["mcore"]), ckptkit.inspect(family["ckpt"])
    assert {t.key: t.shape for t in ours.tensors} == {t.key: t.shape for t in theirs.tensors}
    assert {o.key for o in ours.objects} == {o.key for o in theirs.objects} | {"checkpoint_version", "iteration"}
    per_layer = any(t.key.startswith("decoder.layers.0.") for t in theirs.tensors)
    assert per_layer == (family["name"] in ("qwen2_moe", "deepseek_v3"))  # dense, then MoE: megatron-core's choice


def test_megatron_forward_of_each_converted_family_gives_transformers_logits(family):
    model = _hf_model(family["name"], family["hf"])
    with torch.no_grad():
        logits = model(tokens()).logits
    difference = (logits - family["loaded"]["logits"]).abs().max().item()
    print(f"{family['name']}: largest logit difference, transformers vs megatron-core: {difference:.3g}")
    assert difference < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "mixtral"], indirect=True)
def test_megatron_export_hf_without_assets_makes_the_familys_config_from_megatron_args(family, tmp_path):
    """No --hf-assets: the config.json comes from Megatron-LM's arguments (given here as --megatron-args, the
    checkpoint holding none), and transformers' class loads the export with nothing missing and gives
    megatron-core's logits."""
    import json

    name = family["name"]
    args = {k: v for k, v in vars(megatron_lm_args(name, 2)).items() if isinstance(v, (bool, int, float, str))}
    report = ckptkit.export_hf(family["ckpt"], tmp_path / "hf", preset=PRESETS[name], megatron_args=args)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == name and any(n.startswith(f"config.json ({name}) made from --megatron-args")
                                                for n in report.notes), report.notes
    with torch.no_grad():
        logits = _hf_model(name, tmp_path / "hf")(tokens()).logits
    difference = (logits - family["loaded"]["logits"]).abs().max().item()
    print(f"{name}, config.json from Megatron's arguments: largest logit difference vs megatron-core: {difference:.3g}")
    assert difference < 1e-5


def test_megatron_export_hf_of_each_converted_family_gives_the_same_bytes_back(family, tmp_path):
    ckptkit.export_hf(family["mcore"], tmp_path / "back", preset=PRESETS[family["name"]], hf_assets=family["hf"])
    for f in family["hf"].iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name


def test_megatron_convert_to_megatron_of_mistral_uses_the_llama_table_and_megatron_gives_its_logits(tmp_path):
    import transformers

    torch.manual_seed(5)
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                                        rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=SEQ * 2,
                                        sliding_window=None)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():  # norms random too: a mapping that swapped two of them would not show with ones
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(tmp_path / "hf")
    report = ckptkit.convert(tmp_path / "hf", tmp_path / "mcore", to="megatron", world_size=2)
    assert any("--preset megatron-llama" in n for n in report.notes), report.notes
    result = loaded(tmp_path, "llama", 2, tmp_path / "mcore", forward=True)  # megatron-core's Llama GPTModel
    assert_same_tree(_reference("llama", result["params"]), model.state_dict())
    with torch.no_grad():
        difference = (model(tokens()).logits - result["logits"]).abs().max().item()
    print(f"mistral: largest logit difference, transformers vs megatron-core: {difference:.3g}")
    assert difference < 1e-5
    ckptkit.export_hf(tmp_path / "mcore", tmp_path / "back", preset="megatron-llama", hf_assets=tmp_path / "hf")
    for f in (tmp_path / "hf").iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("model_type", ["gemma3"])
def test_megatron_convert_to_megatron_refuses_a_family_without_a_table_by_name(model_type, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import save_file

    from ckptkit.cli import cli

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, tmp_path / "hf" / "model.safetensors")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "megatron"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert f"model_type '{model_type}': " in result.output and "has no Megatron table" in result.output
    assert not (tmp_path / "out").exists()


def test_megatron_reshard_of_each_family_keeps_every_tensor_as_torch_reads_it(family, tmp_path):
    ckptkit.reshard(family["ckpt"], tmp_path / "r3", world_size=3)
    assert_same_tree(load_dcp(tmp_path / "r3", tmp_path / "r3.pt"), family["oracle"])


def _joined(singletons: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core's ``singleton_local_shards`` spelling turned into its per-layer one by hand: each gated
    ``linear_fc1``'s ``weight_w`` (gate) and ``weight_v`` (up) rows joined, each layer's experts stacked."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in singletons.items():
        if not isinstance(value, torch.Tensor) or key.endswith("_v"):
            continue
        if key.endswith("_w"):
            key, value = key[:-2], torch.cat([value, singletons[key[:-2] + "_v"]])
        m = re.fullmatch(r"(.*\.experts\.experts)\.(\d+)\.(.*)", key)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = value
        else:
            out[key] = value
    return {**out, **{k: torch.stack([found[e] for e in sorted(found)]) for k, found in experts.items()}}


@pytest.fixture(scope="module")
def singletons(tmp) -> dict:
    """Qwen2-MoE saved by megatron-core with ``singleton_local_shards`` (read by torch), and its HF export."""
    ckpt = saved(tmp, "qwen2_moe_singletons", 2, with_args=False)
    assets = tmp / "singletons-assets"
    _hf_config("qwen2_moe").save_pretrained(assets)
    ckptkit.export_hf(ckpt, tmp / "singletons-hf", preset="megatron-qwen2-moe", hf_assets=assets)
    return {"ckpt": ckpt, "oracle": load_dcp(ckpt, tmp / "singletons.pt"), "hf": tmp / "singletons-hf"}


def test_megatron_export_hf_reads_the_singleton_local_shards_spelling(singletons):
    assert "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_v" in singletons["oracle"]
    assert_same_tree(load_hf(singletons["hf"]), _reference("qwen2_moe", _joined(singletons["oracle"])))
    _hf_model("qwen2_moe", singletons["hf"])


def test_megatron_convert_to_megatron_writes_the_singleton_local_shards_spelling_when_asked(singletons, tmp_path):
    report = ckptkit.convert(singletons["hf"], tmp_path / "mcore", to="megatron", world_size=2,
                             megatron_args={"singleton_local_shards": True})
    assert any(n.startswith("singleton_local_shards True (--megatron-args)") for n in report.notes), report.notes
    ours, theirs = ckptkit.inspect(tmp_path / "mcore"), ckptkit.inspect(singletons["ckpt"])
    assert {t.key: t.shape for t in ours.tensors} == {t.key: t.shape for t in theirs.tensors}
    assert {o.key for o in ours.objects} == {o.key for o in theirs.objects} | {"checkpoint_version", "iteration"}
    # megatron-core's own load of a model asked for that spelling: every parameter, and transformers' logits.
    result = loaded(tmp_path, "qwen2_moe_singletons", 1, tmp_path / "mcore", forward=True)
    expected = _joined(singletons["oracle"])
    assert set(result["params"]) == set(expected)
    assert_same_tree(result["params"], expected)
    with torch.no_grad():
        logits = _hf_model("qwen2_moe", singletons["hf"])(tokens()).logits
    assert (logits - result["logits"]).abs().max().item() < 1e-5


def test_megatron_export_hf_refuses_keys_that_mix_stacked_and_per_layer_spellings(tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import save_file

    from ckptkit.cli import cli

    _hf_config("qwen2_moe").save_pretrained(tmp_path / "assets")
    save_file({"decoder.layers.self_attention.linear_qkv.weight": torch.zeros(2, 64, 32),
               "decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(128, 32)}, tmp_path / "mixed.safetensors")
    result = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "mixed.safetensors"), str(tmp_path / "hf"),
                                      "--preset", "megatron-qwen2-moe", "--hf-assets", str(tmp_path / "assets")])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "the keys mix two spellings of Megatron's layers: 'decoder.layers.self_attention.linear_qkv.weight' and " \
           "'decoder.layers.0.mlp.linear_fc1.weight'" in result.output
    assert not (tmp_path / "hf").exists()


def test_megatron_deepseek_v3_without_a_q_low_rank_exports_and_converts_as_megatron_saves_it(tmp):
    ckpt = saved(tmp, "deepseek_v3_q", 2, with_args=False)
    oracle = load_dcp(ckpt, tmp / "deepseek-q.pt")
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in oracle
    assets = tmp / "deepseek-q-assets"
    config = _hf_config("deepseek_v3")
    config.q_lora_rank = None
    config.save_pretrained(assets)
    ckptkit.export_hf(ckpt, tmp / "deepseek-q-hf", preset="megatron-deepseek-v3", hf_assets=assets)
    assert_same_tree(load_hf(tmp / "deepseek-q-hf"), _reference("deepseek_v3", oracle))
    _hf_model("deepseek_v3", tmp / "deepseek-q-hf")
    ckptkit.convert(tmp / "deepseek-q-hf", tmp / "deepseek-q-mcore", to="megatron", world_size=2)
    ours, theirs = ckptkit.inspect(tmp / "deepseek-q-mcore"), ckptkit.inspect(ckpt)
    assert {t.key: t.shape for t in ours.tensors} == {t.key: t.shape for t in theirs.tensors}
    assert {o.key for o in ours.objects} == {o.key for o in theirs.objects} | {"checkpoint_version", "iteration"}
    back = load_dcp(tmp / "deepseek-q-mcore", tmp / "deepseek-q-back.pt")  # torch's reading of both: equal tensors
    assert_same_tree({k: v for k, v in back.items() if isinstance(v, torch.Tensor)},
                     {k: v for k, v in oracle.items() if isinstance(v, torch.Tensor)})

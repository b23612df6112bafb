"""megatron-core 0.16.1's ``torch_dist`` checkpoints, written by its own ``dist_checkpointing.save`` from tiny
GPTModels on 2 gloo ranks (``_megatron.py``), read by ckptkit, and loaded back by megatron-core's own
``dist_checkpointing.load``. torch's ``dcp_to_torch_save`` is the oracle for the DCP part."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, leftovers, load_dcp, load_hf
from _megatron import SEQ, VOCAB, loaded, saved, tokens
from ckptkit.cli import cli

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def llama_tp2(tmp) -> Path:
    """Llama-style at TP=2, with Megatron-LM's common state (args, iteration) in common.pt."""
    return saved(tmp, "llama", 2)


@pytest.fixture(scope="module")
def llama_tp1(tmp) -> Path:
    """Llama-style at TP=1, as megatron-core alone saves a model: an empty common.pt."""
    return saved(tmp, "llama", 1, with_args=False)


def _common(ckpt: Path) -> dict:
    # The test's own files: megatron-core pickles an argparse.Namespace and its own enum there.
    return torch.load(ckpt / "common.pt", weights_only=False)


def _run(*args) -> tuple[int, str]:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def test_megatron_inspect_lists_the_dcp_tensors_and_common_state(llama_tp2, tmp_path):
    manifest = ckptkit.inspect(llama_tp2)
    oracle = load_dcp(llama_tp2, tmp_path / "oracle.pt")
    tensors = {t.key: (t.dtype.name, t.shape) for t in manifest.tensors}
    assert tensors == {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape))
                       for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    assert tensors["decoder.layers.self_attention.linear_qkv.weight"] == ("float32", (2, 64, 32))  # (4 + 2·2)·8
    assert {o.key for o in manifest.objects if o.sidecar == "common.pt"} == {"args", "checkpoint_version", "iteration"}
    details = dict(manifest.details)
    assert details["metadata.json"] == "megatron-core torch_dist (version 1)"
    assert details["common.pt"].startswith("megatron-core's common state: 3 entries (args, ")
    code, out = _run("inspect", llama_tp2)
    assert code == 0 and "metadata.json: megatron-core torch_dist" in out and "iteration = 0  (common.pt)" in out


@pytest.mark.parametrize("which", ["llama_tp2", "llama_tp1"])
def test_megatron_convert_full_is_dcp_to_torch_save_plus_common_state_as_megatron_load_merges_it(
        which, request, tmp_path):
    ckpt = request.getfixturevalue(which)
    ckptkit.convert(ckpt, tmp_path / "full.pt", to="full")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    expected = {**load_dcp(ckpt, tmp_path / "oracle.pt"), **_common(ckpt)}
    assert_same_tree(full, expected)
    if which == "llama_tp2":
        assert full["args"].num_query_groups == 2 and full["iteration"] == 0
    assert ckptkit.verify(ckpt, tmp_path / "full.pt").ok  # ckptkit reads its own output back, args included


def test_megatron_export_hf_with_preset_none_keeps_megatron_names_and_bytes(llama_tp2, tmp_path):
    ckptkit.export_hf(llama_tp2, tmp_path / "hf", preset=None)
    oracle = load_dcp(llama_tp2, tmp_path / "oracle.pt")
    assert_same_tree(load_hf(tmp_path / "hf"), {k: v for k, v in oracle.items() if isinstance(v, torch.Tensor)})


@pytest.fixture(scope="module")
def llama_resharded(llama_tp2, tmp) -> tuple[Path, dict]:
    """llama_tp2 resharded to 3 ranks by ckptkit, and megatron-core's own load of it at TP=2, with its forward."""
    ckptkit.reshard(llama_tp2, tmp / "r3", world_size=3)
    return tmp / "r3", loaded(tmp, "llama", 2, tmp / "r3", forward=True)


def test_megatron_reshard_relays_files_and_megatron_loads_the_output(llama_tp2, llama_resharded, tmp_path):
    out, result = llama_resharded
    assert sorted(p.name for p in out.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "common.pt", "metadata.json"]
    assert (out / "metadata.json").read_bytes() == (llama_tp2 / "metadata.json").read_bytes()
    assert_same_tree(_common(out), _common(llama_tp2))
    oracle = load_dcp(llama_tp2, tmp_path / "oracle.pt")
    assert_same_tree(result["params"], {k: oracle[k] for k in result["params"]})
    assert set(result["params"]) == {k for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    assert result["common"]["args"] == _common(llama_tp2)["args"] and result["common"]["iteration"] == 0
    assert ckptkit.verify(llama_tp2, out).ok


# ----------------------------------------------------------------------------------------- Megatron <-> HF


def _hf_config(family: str):
    """The HF config of the tiny models in ``_megatron.FAMILIES``."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=SEQ * 2, attention_bias=False)
    if family == "llama":
        return transformers.LlamaConfig(**fields)
    if family == "qwen3":
        return transformers.Qwen3Config(**fields)
    return transformers.Qwen3MoeConfig(**fields, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _hf_model(family: str, path: Path):
    """transformers' own class of ``family``, loaded from ``path``: nothing missing, unexpected or mismatched."""
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM}[family]
    model, info = cls.from_pretrained(path, output_loading_info=True, torch_dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).logits


def _as_hf(megatron: dict[str, torch.Tensor], groups: int = 2, per_group: int = 2, head_dim: int = 8) -> dict:
    """megatron-core's names and layout turned into HF's by hand, for the tensors a dense model has: the oracle
    for the tables' splits (q, k, v per query group; gate and up)."""
    out = {"model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"],
           "model.norm.weight": megatron["decoder.final_layernorm.weight"],
           "lm_head.weight": megatron["output_layer.weight"]}
    m = "decoder.layers."
    for n in range(megatron[m + "self_attention.linear_qkv.weight"].shape[0]):
        h = f"model.layers.{n}."
        qkv = megatron[m + "self_attention.linear_qkv.weight"][n].reshape(groups, (per_group + 2) * head_dim, -1)
        q, k, v = qkv.split([per_group * head_dim, head_dim, head_dim], dim=1)
        out[h + "self_attn.q_proj.weight"] = q.reshape(-1, q.shape[-1])
        out[h + "self_attn.k_proj.weight"] = k.reshape(-1, k.shape[-1])
        out[h + "self_attn.v_proj.weight"] = v.reshape(-1, v.shape[-1])
        out[h + "self_attn.o_proj.weight"] = megatron[m + "self_attention.linear_proj.weight"][n]
        out[h + "input_layernorm.weight"] = megatron[m + "self_attention.linear_qkv.layer_norm_weight"][n]
        out[h + "post_attention_layernorm.weight"] = megatron[m + "mlp.linear_fc1.layer_norm_weight"][n]
        if m + "mlp.linear_fc1.weight" in megatron:
            gate, up = megatron[m + "mlp.linear_fc1.weight"][n].chunk(2)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = megatron[m + "mlp.linear_fc2.weight"][n]
        for x in "qk":
            if f"{m}self_attention.{x}_layernorm.weight" in megatron:
                out[h + f"self_attn.{x}_norm.weight"] = megatron[f"{m}self_attention.{x}_layernorm.weight"][n]
    return out


def test_megatron_export_hf_llama_loads_in_transformers_and_matches_megatrons_forward(
        llama_tp2, llama_resharded, tmp_path):
    assets = tmp_path / "assets"
    _hf_config("llama").save_pretrained(assets)
    ckptkit.export_hf(llama_tp2, tmp_path / "hf", preset="megatron-llama", hf_assets=assets)
    oracle = load_dcp(llama_tp2, tmp_path / "oracle.pt")
    assert_same_tree(load_hf(tmp_path / "hf"), _as_hf(oracle))
    model = _hf_model("llama", tmp_path / "hf")
    megatron_logits = llama_resharded[1]["logits"]
    difference = (_hf_logits(model) - megatron_logits).abs().max().item()
    print(f"llama: largest logit difference, transformers vs megatron-core: {difference:.3g}")
    assert difference < 1e-5


def test_megatron_export_hf_preset_auto_picks_the_family_and_transformers_loads_every_weight(llama_tp2, tmp_path):
    assets = tmp_path / "assets"
    _hf_config("llama").save_pretrained(assets)
    code, out = _run("export-hf", llama_tp2, tmp_path / "auto", "--hf-assets", assets)  # --preset auto, the default
    assert code == 0, out
    assert "--preset auto: megatron-llama (model_type 'llama' in " in out
    ckptkit.export_hf(llama_tp2, tmp_path / "named", preset="megatron-llama", hf_assets=assets)
    for f in (tmp_path / "named").iterdir():
        assert (tmp_path / "auto" / f.name).read_bytes() == f.read_bytes(), f.name
    _hf_model("llama", tmp_path / "auto")  # nothing missing, unexpected or mismatched
    ckptkit.convert(llama_tp2, tmp_path / "converted", to="hf", hf_assets=assets)  # convert --to hf: the same
    assert_same_tree(load_hf(tmp_path / "converted"), load_hf(tmp_path / "named"))


def test_megatron_export_hf_preset_auto_tells_the_family_by_its_keys_without_a_config(moe_tp2, tmp_path):
    report = ckptkit.export_hf(moe_tp2, tmp_path / "auto")  # no --hf-assets: common.pt's args give the counts
    assert "--preset auto: megatron-qwen3-moe (Megatron names of --preset megatron-qwen3-moe's table)" in report.notes
    ckptkit.export_hf(moe_tp2, tmp_path / "named", preset="megatron-qwen3-moe")
    assert (tmp_path / "auto" / "model.safetensors").read_bytes() == \
        (tmp_path / "named" / "model.safetensors").read_bytes()


def test_megatron_export_hf_refusal_of_a_bias_never_offers_to_leave_the_weight_out(llama_tp2, tmp_path):
    ckptkit.convert(llama_tp2, tmp_path / "full.pt", to="full")
    state = torch.load(tmp_path / "full.pt", weights_only=False)  # the test's own file
    state["decoder.layers.self_attention.linear_qkv.bias"] = torch.zeros(2, 64)  # a Qwen2-shaped attention
    torch.save(state, tmp_path / "qwen2ish.pt")
    _hf_config("llama").save_pretrained(tmp_path / "assets")
    code, out = _run("export-hf", tmp_path / "qwen2ish.pt", tmp_path / "hf", "--preset", "megatron-llama",
                     "--hf-assets", tmp_path / "assets")
    assert code == 2 and out.count("\n") == 1, out
    # The bias is Qwen2's, whose table maps it: the refusal names that preset, and never offers to leave it out.
    assert "the keys are --preset megatron-qwen2's family, not megatron-llama's" in out and "null" not in out, out
    assert not (tmp_path / "hf").exists()
    # Leaving the bias out anyway, for a Qwen2, under the Llama table: refused, naming Qwen2's preset.
    import transformers

    fields = _hf_config("llama").to_dict()
    transformers.Qwen2Config(**{k: fields[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "num_key_value_heads", "tie_word_embeddings")}
                             ).save_pretrained(tmp_path / "qwen2")
    code, out = _run("export-hf", tmp_path / "qwen2ish.pt", tmp_path / "hf", "--preset", "megatron-llama",
                     "--hf-assets", tmp_path / "qwen2", "--key-map",
                     '{"decoder.layers.self_attention.linear_qkv.bias": null}')
    assert code == 2 and "config.json says model_type 'qwen2', which is --preset megatron-qwen2's family" in out, out
    assert not (tmp_path / "hf").exists()


def test_megatron_export_hf_reads_head_counts_from_common_pt_args(llama_tp2, tmp_path):
    report = ckptkit.export_hf(llama_tp2, tmp_path / "hf", preset="megatron-llama")  # no --hf-assets
    assert_same_tree(load_hf(tmp_path / "hf"), _as_hf(load_dcp(llama_tp2, tmp_path / "oracle.pt")))
    assert "--preset megatron-llama: 21 keys mapped, Megatron names -> HF names" in report.notes


def test_megatron_export_hf_without_args_needs_hf_assets(llama_tp1, tmp_path):
    code, out = _run("export-hf", llama_tp1, tmp_path / "hf", "--preset", "megatron-llama")
    assert code == 2 and "--hf-assets" in out and not (tmp_path / "hf").exists(), out
    assets = tmp_path / "assets"
    _hf_config("llama").save_pretrained(assets)
    ckptkit.export_hf(llama_tp1, tmp_path / "hf", preset="megatron-llama", hf_assets=assets)
    assert_same_tree(load_hf(tmp_path / "hf"), _as_hf(load_dcp(llama_tp1, tmp_path / "oracle.pt")))


@pytest.fixture(scope="module")
def moe_tp2(tmp) -> Path:
    return saved(tmp, "qwen3_moe", 2)


def test_megatron_export_hf_qwen3_moe_splits_experts_per_layer_and_expert(moe_tp2, tmp_path):
    assets = tmp_path / "assets"
    _hf_config("qwen3_moe").save_pretrained(assets)
    ckptkit.export_hf(moe_tp2, tmp_path / "hf", preset="megatron-qwen3-moe", hf_assets=assets)
    oracle = load_dcp(moe_tp2, tmp_path / "oracle.pt")
    expected = _as_hf(oracle)
    fc1, fc2 = (oracle[f"decoder.layers.mlp.experts.experts.linear_fc{i}.weight"] for i in (1, 2))
    for n in range(2):
        expected[f"model.layers.{n}.mlp.gate.weight"] = oracle["decoder.layers.mlp.router.weight"][n]
        for e in range(4):
            x = f"model.layers.{n}.mlp.experts.{e}."
            expected[x + "gate_proj.weight"], expected[x + "up_proj.weight"] = fc1[n, e].chunk(2)
            expected[x + "down_proj.weight"] = fc2[n, e]
    assert_same_tree(load_hf(tmp_path / "hf"), expected)
    _hf_model("qwen3_moe", tmp_path / "hf")  # every weight found, none left over


def test_megatron_export_hf_refuses_a_qkv_that_does_not_divide_into_query_groups(llama_tp2, tmp_path):
    assets = tmp_path / "assets"
    _hf_config("llama").save_pretrained(assets)
    config = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3, "head_dim": 8}))
    code, out = _run("export-hf", llama_tp2, tmp_path / "hf", "--preset", "megatron-llama", "--hf-assets", assets)
    assert code == 2 and out.count("\n") == 1, out
    assert "'decoder.layers.self_attention.linear_qkv.weight[0]' has 64 rows, but its parts" in out
    assert not (tmp_path / "hf").exists()


def test_megatron_export_hf_refuses_a_layer_count_that_disagrees_with_the_stacked_dim(llama_tp2, tmp_path):
    assets = tmp_path / "assets"
    _hf_config("llama").save_pretrained(assets)
    config = json.loads((assets / "config.json").read_text())
    (assets / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    code, out = _run("export-hf", llama_tp2, tmp_path / "hf", "--preset", "megatron-llama", "--hf-assets", assets)
    assert code == 2 and out.count("\n") == 1, out
    assert "stacks num_hidden_layers along dim 0, but" in out or "stacks layers along dim 0, but" in out
    assert not (tmp_path / "hf").exists()


def _copy(ckpt: Path, to: Path) -> Path:
    shutil.copytree(ckpt, to)
    return to


def test_megatron_common_pt_with_a_class_off_the_allow_list_exits_2(llama_tp2, tmp_path):
    bad = _copy(llama_tp2, tmp_path / "bad")
    torch.save({"args": datetime.timedelta(days=1)}, bad / "common.pt")
    code, out = _run("export-hf", bad, tmp_path / "out")
    assert code == 2 and out.count("\n") == 1, out
    assert "common.pt: the pickle asks for datetime.timedelta, which is not on ckptkit's allow-list" in out
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_megatron_metadata_json_naming_another_backend_exits_2(llama_tp2, tmp_path):
    bad = _copy(llama_tp2, tmp_path / "bad")
    config = json.loads((bad / "metadata.json").read_text())
    (bad / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    code, out = _run("convert", bad, tmp_path / "out.pt", "--to", "full")
    assert code == 2 and out.count("\n") == 1, out
    assert "metadata.json: megatron-core checkpoint with sharded_backend 'zarr'" in out
    assert not (tmp_path / "out.pt").exists()


# ----------------------------------------------------------------------------------------- HF -> torch_dist


@pytest.fixture(scope="module")
def qwen3_hf(tmp) -> tuple[Path, object]:
    """A random tiny Qwen3 saved by transformers' own save_pretrained, and the model."""
    import transformers

    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(_hf_config("qwen3")).eval()
    with torch.no_grad():  # norms random too: a mapping that swapped two of them would not show with ones
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    model.save_pretrained(tmp / "qwen3-hf")
    return tmp / "qwen3-hf", model


@pytest.fixture(scope="module")
def qwen3_mcore(qwen3_hf, tmp) -> Path:
    ckptkit.convert(qwen3_hf[0], tmp / "qwen3-mcore", to="megatron", world_size=2)
    return tmp / "qwen3-mcore"


def test_megatron_convert_to_megatron_writes_what_megatron_writes(qwen3_mcore, llama_tp1):
    assert sorted(p.name for p in qwen3_mcore.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    assert (qwen3_mcore / "metadata.json").read_bytes() == (llama_tp1 / "metadata.json").read_bytes()
    assert _common(qwen3_mcore) == {"checkpoint_version": 3.0, "iteration": 0}  # the model only, at step 0


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_convert_to_megatron_loads_in_megatron_with_the_hf_weights_and_logits(qwen3_hf, qwen3_mcore, tp,
                                                                                        tmp_path):
    hf_dir, model = qwen3_hf
    result = loaded(tmp_path, "qwen3", tp, qwen3_mcore, forward=True)  # megatron-core's own load and forward
    assert_same_tree(_as_hf(result["params"]), model.state_dict())
    difference = (_hf_logits(model) - result["logits"]).abs().max().item()
    print(f"qwen3 at TP={tp}: largest logit difference, megatron-core vs transformers: {difference:.3g}")
    assert difference < 1e-5


def test_megatron_export_hf_of_a_converted_checkpoint_gives_the_original_files_back(qwen3_hf, qwen3_mcore, tmp_path):
    hf_dir, _ = qwen3_hf
    ckptkit.export_hf(qwen3_mcore, tmp_path / "back", preset="megatron-qwen3", hf_assets=hf_dir)
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    for f in hf_dir.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name
    _hf_model("qwen3", tmp_path / "back")


def test_megatron_convert_to_megatron_qwen3_moe_joins_experts_as_megatron_stacks_them(moe_tp2, tmp_path):
    import transformers

    torch.manual_seed(4)
    transformers.Qwen3MoeForCausalLM(_hf_config("qwen3_moe")).save_pretrained(tmp_path / "hf")
    ckptkit.convert(tmp_path / "hf", tmp_path / "mcore", to="megatron", world_size=2)
    ours, theirs = ckptkit.inspect(tmp_path / "mcore"), ckptkit.inspect(moe_tp2)
    # The same tensors and _extra_state objects as megatron-core's own save of the same model, by name and shape.
    assert {t.key: t.shape for t in ours.tensors} == {t.key: t.shape for t in theirs.tensors}
    assert {o.key for o in ours.objects} == {o.key for o in theirs.objects} - {"args"}
    ckptkit.export_hf(tmp_path / "mcore", tmp_path / "back", preset="megatron-qwen3-moe", hf_assets=tmp_path / "hf")
    for f in (tmp_path / "hf").iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name

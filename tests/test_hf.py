"""HF safetensors output: read by ``safetensors`` and ``transformers`` themselves; naming, casts, ties."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from _checks import assert_same_tree, assert_tensor_identical, hash_tree, load_dcp, load_full, load_hf
from ckptkit.errors import UsageError
from ckptkit.ops.convert import convert
from ckptkit.ops.export import export_hf
from ckptkit.ops.verify import verify


def test_convert_hf_output_read_by_safetensors(tmp_path, flat_full_ckpt, zoo):
    report = convert(flat_full_ckpt, tmp_path / "hf", to="hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    assert report.files == 1
    assert_same_tree(load_file(tmp_path / "hf" / "model.safetensors"), zoo)
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0  # tensor data starts 8-byte aligned, as the safetensors writer aligns it


def _big_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    sd = {f"layers.{i}.weight": torch.randn(10, 10, generator=g) for i in range(6)}  # 400 bytes each
    sd["embed.weight"] = torch.randn(30, 10, generator=g)                             # 1200 bytes: over the limit
    sd["layers.0.bias"] = torch.arange(10)                                            # int64, 80 bytes
    return sd


@pytest.mark.parametrize("how", [
    "export_hf",  # ckptkit.export_hf(..., max_shard_size=1000)
    "convert",    # ckptkit.convert(..., to="hf", max_shard_size="1000")
])
def test_export_hf_shards_with_index(tmp_path, how):
    model = _big_model()
    torch.save({"model": model, "step": 1}, tmp_path / "src.pt")
    if how == "export_hf":
        report = export_hf(tmp_path / "src.pt", tmp_path / "hf", max_shard_size=1000)
        expected = model
    else:
        torch.save(model, tmp_path / "flat.pt")
        report = convert(tmp_path / "flat.pt", tmp_path / "hf", to="hf", max_shard_size="1000")
        expected = model

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    files = sorted(set(weight_map.values()))
    assert len(files) >= 3 and report.files == len(files) + 1
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted([*files, "model.safetensors.index.json"])
    for name in files:
        assert name.startswith("model-") and name.endswith(f"-of-{len(files):05d}.safetensors")
        part = load_file(tmp_path / "hf" / name)
        assert set(part) == {k for k, v in weight_map.items() if v == name}
        data = sum(t.numel() * t.element_size() for t in part.values())
        assert data <= 1000 or len(part) == 1, f"{name} holds {data} bytes in {len(part)} tensors"
    assert_same_tree(load_hf(tmp_path / "hf"), expected)


def test_convert_reads_hf_shards_written_by_huggingface_hub(tmp_path):
    from huggingface_hub import save_torch_state_dict

    model = _big_model()
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(model, tmp_path / "hub", max_shard_size=1000)
    assert (tmp_path / "hub" / "model.safetensors.index.json").is_file()
    convert(tmp_path / "hub", tmp_path / "full.pt", to="full")
    assert_same_tree(load_full(tmp_path / "full.pt"), model)


WRAPPED = {
    "module._orig_mod.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.weight": torch.ones(2, 2),
    "module._orig_mod.layers.0._fsdp_wrapped_module.bias": torch.zeros(2),
    "module.norm.weight": torch.full((2,), 3.0),
}


def test_export_hf_strips_wrapper_prefixes_and_says_so(tmp_path):
    torch.save({"model": WRAPPED, "optimizer": {"state": {}}, "step": 3}, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf")
    out = load_hf(tmp_path / "hf")
    assert_same_tree(out, {"layers.0.weight": torch.ones(2, 2), "layers.0.bias": torch.zeros(2),
                           "norm.weight": torch.full((2,), 3.0)})
    assert report.notes == (
        "model taken from top-level key 'model'",
        "stripped '_checkpoint_wrapped_module.' from 1 keys",
        "stripped '_fsdp_wrapped_module.' from 2 keys",
        "stripped '_orig_mod.' from 2 keys",
        "stripped 'module.' from 3 keys",
        "left out: optimizer (1 other entry); step (a value)",
    )
    assert any("note: stripped 'module.' from 3 keys" in line for line in report.lines())


def test_export_hf_keep_wrapper_prefixes(tmp_path):
    torch.save(WRAPPED, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", strip_wrappers=False)
    assert set(load_hf(tmp_path / "hf")) == set(WRAPPED)
    assert report.notes == ("checkpoint is a flat model state dict",)


def test_export_hf_strip_prefixes(tmp_path):
    flat = {"model.layers.0.weight": torch.ones(2), "model.norm.weight": torch.zeros(2),
            "lm_head.weight": torch.ones(3)}
    torch.save(flat, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", strip_prefixes=("model.",))
    assert_same_tree(load_hf(tmp_path / "hf"),
                     {"layers.0.weight": torch.ones(2), "norm.weight": torch.zeros(2), "lm_head.weight": torch.ones(3)})
    assert "stripped 'model.' from 2 keys" in report.notes


def test_export_hf_refuses_keys_that_collide_after_stripping(tmp_path):
    torch.save({"module.w": torch.ones(1), "w": torch.zeros(1)}, tmp_path / "src.pt")
    with pytest.raises(UsageError, match=r"'module\.w' and 'w' both become 'w' after stripping prefixes"):
        export_hf(tmp_path / "src.pt", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("model_key, expected, rule", [
    # the first of model, state_dict, model_state_dict, module that holds tensors
    ("auto", "model", "model taken from top-level key 'model'"),
    # named explicitly
    ("ema", "ema", "model taken from key 'ema' (--model-key)"),
])
def test_export_hf_model_key(tmp_path, model_key, expected, rule):
    state = {"ema": {"w": torch.zeros(2)}, "model": {"w": torch.ones(2)}, "step": 1}
    torch.save(state, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", model_key=model_key)
    assert_same_tree(load_hf(tmp_path / "hf"), state[expected])
    assert report.notes[0] == rule


def test_export_hf_unknown_model_key_lists_top_level_keys(tmp_path, full_ckpt):
    with pytest.raises(UsageError, match=r"no model under key 'net'; top-level keys are "
                                         r"\['model', 'optimizer', 'step', 'name'\]"):
        export_hf(full_ckpt, tmp_path / "hf", model_key="net")


@pytest.mark.parametrize("dtype, torch_dtype", [
    ("bf16", torch.bfloat16),  # the usual export
    ("fp16", torch.float16),   # narrows fp32, widens float8
    ("fp32", torch.float32),   # widens bf16, fp16 and float8
])
def test_export_hf_dtype_casts_floating_tensors_only(tmp_path, full_ckpt, training_state, dtype, torch_dtype):
    # 64 bytes of memory budget: casts go row block by row block.
    report = export_hf(full_ckpt, tmp_path / "hf", dtype=dtype, max_memory=64)
    out = load_hf(tmp_path / "hf")
    model = training_state["model"]
    assert set(out) == set(model)
    for key, t in model.items():
        want = t.to(torch_dtype) if t.is_floating_point() else t  # int64 and bool keep their dtype
        assert_tensor_identical(out[key], want, key)
    n = sum(1 for t in model.values() if t.is_floating_point() and t.dtype != torch_dtype)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    assert f"cast {n} floating tensors to {dtype_name}; others kept their dtype" in report.notes


def test_export_hf_rejects_unknown_dtype(tmp_path, full_ckpt):
    with pytest.raises(UsageError, match=r"--dtype must be one of keep, bf16, fp16, fp32 \(or bfloat16, float16, "
                                         r"float32\); got 'int8'"):
        export_hf(full_ckpt, tmp_path / "hf", dtype="int8")


def test_convert_hf_refuses_dtype_safetensors_cannot_store(tmp_path):
    torch.save({"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}, tmp_path / "src.pt")
    with pytest.raises(UsageError, match=r"tensor 'z' has dtype complex128, which safetensors cannot store"):
        convert(tmp_path / "src.pt", tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf").exists()


def test_convert_hf_says_what_it_leaves_out(tmp_path):
    torch.save({"w": torch.ones(2), "step": 5, "rng": (torch.arange(3), 1)}, tmp_path / "src.pt")
    report = convert(tmp_path / "src.pt", tmp_path / "hf", to="hf")
    assert_same_tree(load_hf(tmp_path / "hf"), {"w": torch.ones(2)})
    assert report.notes == ("model taken from the top-level tensors beside the training state",
                            "left out: rng (a value); step (a value)")


def test_export_hf_cast_reads_strided_views(tmp_path):
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    views = {"t": base.t(), "cols": base[:, 1:7:2], "rows": base[2:5]}
    torch.save({"model": views}, tmp_path / "src.pt")
    export_hf(tmp_path / "src.pt", tmp_path / "hf", dtype="fp16", max_memory=8)  # one row a block
    assert_same_tree(load_hf(tmp_path / "hf"), {k: v.to(torch.float16) for k, v in views.items()})


def test_verify_of_a_training_checkpoint_and_its_hf_export_compares_the_model_part_and_says_so(tmp_path, full_ckpt):
    from safetensors.torch import save_file

    export_hf(full_ckpt, tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert verify(full_ckpt, tmp_path / "hf", model_only=True).ok
    for a, b in ((full_ckpt, tmp_path / "hf"), (tmp_path / "hf", full_ckpt)):
        report = verify(a, b)  # the optimizer and counters, only in the source, are not compared
        assert report.ok and report.tensors == len(model) and report.hint is None
        assert report.notes[0].startswith(f"{tmp_path / 'hf'} is a Hugging Face model folder: the model part of "
                                          f"{full_ckpt} is compared with it (as --model-only)")
    key = sorted(model)[0]
    save_file({**model, key: model[key] + 1}, tmp_path / "hf" / "model.safetensors")
    assert [d.key for d in verify(full_ckpt, tmp_path / "hf").differences] == [key]


# ------------------------------------------------------------------------------------------ hf_assets


def _assets(root: Path, tie: bool | None) -> Path:
    root.mkdir()
    # The Llama these tensors are: no layers (transformers' class of the config holds exactly these weights).
    config = {"model_type": "llama", "vocab_size": 6, "hidden_size": 4, "num_hidden_layers": 0,
              "num_attention_heads": 1, "intermediate_size": 8}
    if tie is not None:
        config["tie_word_embeddings"] = tie
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "README.md").write_text("a model card, copied too")
    return root


def _lm(head_equal: bool) -> dict[str, torch.Tensor]:
    embed = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    head = embed.clone() if head_equal else embed + 1
    return {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4), "lm_head.weight": head}


@pytest.mark.parametrize("tie, head_equal, head_kept", [
    (True, True, False),    # tied in config and equal: left out, as save_pretrained does
    (None, True, True),     # config silent: llama's default (LlamaConfig) is untied, so kept though equal
    (False, True, True),    # untied in config: kept even though equal
    (False, False, True),   # untied and different: kept
])
def test_export_hf_assets_tie_word_embeddings(tmp_path, tie, head_equal, head_kept):
    assets = _assets(tmp_path / "assets", tie)
    sd = _lm(head_equal)
    torch.save({"model": {"_orig_mod." + k: v for k, v in sd.items()}}, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", hf_assets=assets)
    out = load_file(tmp_path / "hf" / "model.safetensors")
    expected = dict(sd) if head_kept else {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert_same_tree(out, expected)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                                   "tokenizer.json"]
    for name in ("README.md", "config.json", "tokenizer.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (assets / name).read_bytes()
    tie_note = ("lm_head.weight left out: tied to model.embed_tokens.weight "
                "(config.json says tie_word_embeddings: true)")
    assert (tie_note in report.notes) == (not head_kept)
    assert "copied README.md, config.json, tokenizer.json" in report.notes


def test_export_hf_assets_refuse_tie_when_tensors_differ(tmp_path):
    assets = _assets(tmp_path / "assets", True)
    torch.save(_lm(head_equal=False), tmp_path / "src.pt")
    before = hash_tree(tmp_path / "src.pt")
    with pytest.raises(UsageError, match=r"config\.json says tie_word_embeddings: true, but lm_head\.weight and "
                                         r"model\.embed_tokens\.weight differ \(24 of 24 elements differ .* first "
                                         r"at \[0, 0\]: .*\); "
                                         r"refusing to drop lm_head\.weight"):
        export_hf(tmp_path / "src.pt", tmp_path / "hf", hf_assets=assets)
    assert not (tmp_path / "hf").exists()
    assert hash_tree(tmp_path / "src.pt") == before


def test_export_hf_assets_need_config_json(tmp_path, flat_full_ckpt):
    (tmp_path / "assets").mkdir()
    with pytest.raises(UsageError, match=r"--hf-assets .*assets: no config\.json there"):
        export_hf(flat_full_ckpt, tmp_path / "hf", hf_assets=tmp_path / "assets")


@pytest.mark.parametrize("tie", [
    False,  # LlamaConfig's default: lm_head.weight is exported
    True,   # tied: lm_head.weight is left out and transformers re-ties it on load
])
def test_export_hf_loads_in_transformers_llama(tmp_path, tie):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                         intermediate_size=64, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    state = model.state_dict()
    # As a torch.compile'd training loop saves it.
    torch.save({"model": {"_orig_mod." + k: v for k, v in state.items()}, "step": 10}, tmp_path / "train.pt")
    config.save_pretrained(tmp_path / "assets")

    report = export_hf(tmp_path / "train.pt", tmp_path / "hf", hf_assets=tmp_path / "assets")
    assert ("lm_head.weight" in load_hf(tmp_path / "hf")) != tie
    tie_note = ("lm_head.weight left out: tied to model.embed_tokens.weight "
                "(config.json says tie_word_embeddings: true)")
    assert (tie_note in report.notes) == tie

    loaded, info = LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_same_tree(loaded.state_dict(), state)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_tensor_identical(loaded(ids).logits, model(ids).logits, "logits")


def test_convert_reads_transformers_sharded_save_pretrained(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                                         intermediate_size=64))
    model.save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")
    assert len(list((tmp_path / "pretrained").glob("model-*.safetensors"))) > 1
    convert(tmp_path / "pretrained", tmp_path / "dcp", to="sharded", world_size=2)
    state = {k: v for k, v in model.state_dict().items()}
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "c.pt"), state)
    assert verify(tmp_path / "pretrained", tmp_path / "dcp").ok


def _tiny(kind: str, tie: bool | None):
    """A tiny transformers model and its config.json without ``tie_word_embeddings`` when ``tie`` is None."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64,
                                          intermediate_size=64, tie_word_embeddings=bool(tie))
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16,
                                         tie_word_embeddings=True if tie is None else tie)
        model = transformers.GPT2LMHeadModel(config)
    return model.eval(), config


@pytest.mark.parametrize("kind, tie, head_equals_embedding, dropped", [
    ("llama", None, True, False),   # llama's default is untied: lm_head kept although it equals the embedding
    ("llama", False, True, False),  # untied in config.json, equal by construction: kept
    ("gpt2", None, True, True),     # gpt2's default is tied: lm_head.weight left out, re-tied on load
    ("llama", True, True, True),    # tied in config.json
])
def test_export_hf_ties_by_the_models_semantics_and_loads_with_nothing_missing(tmp_path, kind, tie,
                                                                               head_equals_embedding, dropped):
    model, config = _tiny(kind, tie)
    if kind == "llama" and not tie and head_equals_embedding:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)  # untied, but equal (just after init)
    state = model.state_dict()
    torch.save({"model": state, "step": 1}, tmp_path / "train.pt")
    config.save_pretrained(tmp_path / "assets")
    saved = json.loads((tmp_path / "assets" / "config.json").read_text())
    if tie is None:
        saved.pop("tie_word_embeddings", None)
        (tmp_path / "assets" / "config.json").write_text(json.dumps(saved))

    report = export_hf(tmp_path / "train.pt", tmp_path / "hf", hf_assets=tmp_path / "assets")
    assert ("lm_head.weight" in load_hf(tmp_path / "hf")) != dropped, report.notes
    loaded, info = type(model).from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_same_tree(loaded.state_dict(), state)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_tensor_identical(loaded.eval()(ids).logits, model(ids).logits, "logits")


def test_tie_word_embeddings_without_transformers_uses_the_table(monkeypatch):
    from ckptkit.ops.export import tie_word_embeddings

    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import transformers -> ImportError
    assert tie_word_embeddings({"model_type": "gpt2"}) == (
        True, "config.json omits tie_word_embeddings; model_type 'gpt2' defaults to true (ckptkit's table of defaults)")
    assert tie_word_embeddings({"model_type": "llama"})[0] is False
    assert tie_word_embeddings({"model_type": "llama", "tie_word_embeddings": True})[0] is True


def test_tie_defaults_table_agrees_with_transformers():
    from transformers import AutoConfig

    from ckptkit.ops.export import TIE_DEFAULTS

    for model_type, tied in TIE_DEFAULTS.items():
        assert AutoConfig.for_model(model_type).tie_word_embeddings is tied, model_type


def test_export_hf_unknown_model_type_keeps_lm_head_and_says_so(tmp_path):
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "config.json").write_text(json.dumps({"model_type": "my-own-lm"}))
    torch.save(_lm(head_equal=True), tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", hf_assets=tmp_path / "assets")
    assert "lm_head.weight" in load_hf(tmp_path / "hf")
    assert ("lm_head.weight kept: config.json omits tie_word_embeddings and the default of model_type "
            "'my-own-lm' is unknown") in report.notes


@pytest.mark.parametrize("dtype, name", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_export_hf_cast_writes_the_dtype_into_config_json(tmp_path, dtype, name):
    from transformers import LlamaForCausalLM

    model, _ = _tiny("llama", False)
    model.save_pretrained(tmp_path / "pretrained")
    original = json.loads((tmp_path / "pretrained" / "config.json").read_text())
    assert original["dtype"] == "float32"
    report = export_hf(tmp_path / "pretrained", tmp_path / "hf", dtype=dtype, hf_assets=tmp_path / "pretrained")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["dtype"], written["torch_dtype"]) == (name, name)
    assert written == {**original, "dtype": name, "torch_dtype": name}  # nothing else changed
    assert f"config.json: dtype and torch_dtype set to {name}, the dtype written (it said float32)" in report.notes
    for kwargs in ({"dtype": "auto"}, {}):  # transformers 5 loads "auto" by default
        loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf", **kwargs)
        assert loaded.dtype == getattr(torch, name), kwargs
    assert_same_tree(load_hf(tmp_path / "hf"), {k: v.to(getattr(torch, name)) for k, v in model.state_dict().items()})


# ------------------------------------------------------------------------------------ precision control


def test_export_hf_fp16_keeps_what_t5_keeps_in_fp32_as_transformers_loads_it(tmp_path):
    # T5's class keeps its feed-forward output projections ("wo") in float32 under float16: the export writes
    # them so, config.json names float16, and from_pretrained holds the very values written.
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=2, decoder_start_token_id=0))
    model.save_pretrained(tmp_path / "t5")
    report = export_hf(tmp_path / "t5", tmp_path / "hf", dtype="float16", hf_assets=tmp_path / "t5")
    assert any(n.startswith("kept 2 floating tensors in float32 (T5ForConditionalGeneration._keep_in_fp32_modules "
                            "['wo'])") for n in report.notes), report.notes
    out = load_hf(tmp_path / "hf")
    for k, v in model.state_dict().items():
        if k in out:
            assert_tensor_identical(out[k], v if ".wo." in k else v.half(), k)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float16"
    loaded = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf")
    for k, v in loaded.state_dict().items():
        if k in out:
            assert_tensor_identical(v, out[k], k)
    # Under bfloat16 only the strict list applies, and T5 has none.
    report = export_hf(tmp_path / "t5", tmp_path / "bf", dtype="bf16", hf_assets=tmp_path / "t5")
    assert {t.dtype for t in load_hf(tmp_path / "bf").values()} == {torch.bfloat16}


def test_export_hf_keep_fp32_regex(tmp_path):
    state = {"model.norm.weight": torch.randn(4), "layers.0.input_layernorm.weight": torch.randn(4),
             "layers.0.proj.weight": torch.randn(4, 4), "steps": torch.arange(3)}
    torch.save(state, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", dtype="bf16", keep_fp32=["norm"])
    out = load_hf(tmp_path / "hf")
    assert {k: v.dtype for k, v in out.items()} == {"model.norm.weight": torch.float32,
                                                   "layers.0.input_layernorm.weight": torch.float32,
                                                   "layers.0.proj.weight": torch.bfloat16, "steps": torch.int64}
    assert "kept 2 floating tensors in float32 (--keep-fp32 'norm')" in report.notes
    assert "cast 1 floating tensors to bfloat16; others kept their dtype" in report.notes
    assert dict(report.cast) == {"layers.0.proj.weight": "bfloat16"}
    with pytest.raises(UsageError, match=r"--keep-fp32 keeps tensors in float32 under a cast: use it with --dtype"):
        export_hf(tmp_path / "src.pt", tmp_path / "x", keep_fp32=["norm"])
    with pytest.raises(UsageError, match=r"--keep-fp32 '\(': not a regular expression"):
        export_hf(tmp_path / "src.pt", tmp_path / "x", dtype="fp16", keep_fp32=["("])


def test_export_hf_report_casts_are_the_dtypes_safetensors_holds(tmp_path):
    # One rule decides the casts for the file and for the report: a kept key stored in half precision is widened
    # to float32, the others narrowed to the cast, integers left alone.
    state = {"norm.weight": torch.randn(4, dtype=torch.float16), "proj.weight": torch.randn(4, 4),
             "embed.weight": torch.randn(4, 4, dtype=torch.bfloat16), "steps": torch.arange(3)}
    torch.save(state, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", dtype="bf16", keep_fp32=["norm"])
    out = load_hf(tmp_path / "hf")
    changed = {k: str(v.dtype).removeprefix("torch.") for k, v in out.items() if v.dtype != state[k].dtype}
    assert dict(report.cast) == changed == {"norm.weight": "float32", "proj.weight": "bfloat16"}


# ------------------------------------------------------------------------------------ dry runs


@pytest.mark.parametrize("write, kwargs", [
    (export_hf, {"dtype": "bf16"}),                                 # a cast
    (convert, {"to": "sharded", "world_size": 3}),                  # rank files and .metadata
    (convert, {"to": "hf", "renames": ["^model\\.="]}),             # a rename
])
def test_dry_run_writes_nothing_and_lists_the_files_the_run_writes(tmp_path, full_ckpt, write, kwargs):
    before = hash_tree(tmp_path)
    dry = write(full_ckpt, tmp_path / "out", dry_run=True, **kwargs)
    assert hash_tree(tmp_path) == before and dry.dry_run
    assert str(dry).splitlines()[1].endswith("(dry run: nothing written)")
    done = write(full_ckpt, tmp_path / "out", **kwargs)
    on_disk = {str(p.relative_to(tmp_path / "out")): p.stat().st_size for p in (tmp_path / "out").rglob("*")}
    assert dict(dry.written) == on_disk == dict(done.written)
    assert (dry.renamed, dry.dropped, dry.cast) == (done.renamed, done.dropped, done.cast)


def test_dry_run_refuses_what_the_run_would_refuse(tmp_path, full_ckpt):
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match=r"already exists; pass --overwrite"):
        convert(full_ckpt, tmp_path / "out", to="full", dry_run=True)

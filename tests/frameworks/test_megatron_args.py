"""Megatron's run arguments that change what a checkpoint's weights mean, the HF ``config.json`` made from them,
and NeMo 2's checkpoint directories. The sources are megatron-core 0.16.1's own ``dist_checkpointing.save`` of
tiny GPTModels on 2 gloo ranks (``_megatron.py``); the oracles are megatron-core's own load and forward, and
transformers' ``from_pretrained`` with nothing missing.

NeMo itself does not install here, so its checkpoint is made as NeMo 2 lays one out: megatron-core's save of
the model with NeMo's ``module.`` key prefix under ``weights/``, and beside it ``context/model.yaml`` written
by hand in NeMo's layout (a ``config`` of megatron-core ``TransformerConfig`` fields; classes and dtypes as
``{_target_: ..., _call_: false}``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_dcp, load_hf
from _megatron import VOCAB, loaded, saved_with_logits, tokens
from ckptkit.cli import cli

pytest.importorskip("megatron.core")

HEAD_DIM, GROUPS, PER_GROUP = 8, 2, 2


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron-args")


@pytest.fixture(scope="module")
def interleaved(tmp) -> tuple[Path, torch.Tensor]:
    """A Llama trained with ``rotary_interleaved=True`` (so its args say), and megatron-core's logits."""
    return saved_with_logits(tmp, "llama_interleaved", 2)


@pytest.fixture(scope="module")
def qwen3(tmp) -> tuple[Path, torch.Tensor]:
    return saved_with_logits(tmp, "qwen3", 2)


def _run(*args) -> tuple[int, str]:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def _hf_model(path: Path):
    """transformers' class that ``path``'s config.json names, loaded from it: nothing missing or left over."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                   dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _difference(model, megatron_logits: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(tokens()).logits - megatron_logits).abs().max().item()


def _with_args(ckpt: Path, to: Path, **changes) -> Path:
    """A copy of ``ckpt`` whose common.pt ``args`` say ``changes`` (None: the argument is removed)."""
    shutil.copytree(ckpt, to)
    common = torch.load(to / "common.pt", weights_only=False)  # the test's own file
    for name, value in changes.items():
        if value is None:
            delattr(common["args"], name)
        else:
            setattr(common["args"], name, value)
    torch.save(common, to / "common.pt")
    return to


def _qkv(ckpt: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Layer 0's q, k and v rows of megatron-core's ``linear_qkv``, split per query group by hand."""
    qkv = load_dcp(ckpt, scratch)["decoder.layers.self_attention.linear_qkv.weight"][0]
    q, k, v = qkv.reshape(GROUPS, (PER_GROUP + 2) * HEAD_DIM, -1).split([PER_GROUP * HEAD_DIM, HEAD_DIM, HEAD_DIM], 1)
    return {x: t.reshape(-1, t.shape[-1]) for x, t in zip("qkv", (q, k, v), strict=True)}


def _even_then_odd(rows: torch.Tensor) -> torch.Tensor:
    """Each head's rows in the order even, then odd: an interleaved rotary head as HF's rotate_half pairs it."""
    heads = rows.reshape(-1, HEAD_DIM, rows.shape[-1])
    return torch.cat([heads[:, 0::2], heads[:, 1::2]], dim=1).reshape(rows.shape)


# ------------------------------------------------------------------------------------------ rotary_interleaved


@pytest.fixture(scope="module")
def interleaved_hf(interleaved, tmp) -> tuple[Path, ckptkit.Report]:
    """The interleaved Llama exported with --preset megatron-llama and no --hf-assets."""
    report = ckptkit.export_hf(interleaved[0], tmp / "interleaved-hf", preset="megatron-llama")
    return tmp / "interleaved-hf", report


def test_megatron_export_hf_of_rotary_interleaved_llama_matches_megatrons_forward(interleaved, interleaved_hf,
                                                                                    tmp_path):
    ckpt, megatron_logits = interleaved
    hf, report = interleaved_hf
    exported, megatron = load_hf(hf), _qkv(ckpt, tmp_path / "oracle.pt")
    layer = "model.layers.0.self_attn."
    assert torch.equal(exported[layer + "q_proj.weight"], _even_then_odd(megatron["q"]))
    assert torch.equal(exported[layer + "k_proj.weight"], _even_then_odd(megatron["k"]))
    assert torch.equal(exported[layer + "v_proj.weight"], megatron["v"])  # v is not rotated: its rows stay
    difference = _difference(_hf_model(hf), megatron_logits)
    print(f"rotary_interleaved llama: largest logit difference, transformers vs megatron-core: {difference:.3g}")
    assert difference < 1e-5
    assert any("rotary_interleaved True" in n for n in report.notes), report.notes
    assert any("q/k rows of 4 tensors reordered" in n for n in report.notes), report.notes
    # The same weights with the rows as Megatron keeps them: transformers' logits are far off.
    ckptkit.export_hf(ckpt, tmp_path / "as-stored", preset="megatron-llama",
                      megatron_args={"rotary_interleaved": False})
    wrong = _difference(_hf_model(tmp_path / "as-stored"), megatron_logits)
    print(f"rotary_interleaved llama exported without the reorder: largest logit difference {wrong:.3g}")
    assert wrong > 1e-3  # a hundred times the tolerance above


def test_megatron_convert_to_megatron_with_rotary_interleaved_gives_megatron_its_own_weights_back(
        interleaved, interleaved_hf, tmp_path):
    ckpt, megatron_logits = interleaved
    ckptkit.convert(interleaved_hf[0], tmp_path / "mcore", to="megatron", world_size=2,
                    megatron_args={"rotary_interleaved": True})
    result = loaded(tmp_path, "llama_interleaved", 2, tmp_path / "mcore", forward=True)
    oracle = load_dcp(ckpt, tmp_path / "oracle.pt")
    assert_same_tree(result["params"], {k: oracle[k] for k in result["params"]})
    assert torch.equal(result["logits"], megatron_logits)


@pytest.mark.parametrize(("arg", "value", "said"), [
    ("position_embedding_type", "learned_absolute", "position embeddings other than rotary ones"),
    ("rotary_percent", 0.5, "rotary embeddings over part of each head only"),
    ("normalization", "LayerNorm", "another norm than RMSNorm"),
    ("apply_layernorm_1p", True, "norm weights stored as weight - 1"),
    ("swiglu", False, "linear_fc1 without the gate and up rows of SwiGLU"),
    ("squared_relu", True, "a squared-ReLU MLP"),
    ("add_bias_linear", True, "biases on the linear layers"),
    ("softmax_type", "off-by-one", "attention with sinks"),
    ("mtp_num_layers", 1, "multi-token prediction layers"),
    ("add_qkv_bias", True, "the table maps no self_attention.linear_qkv.bias tensors"),
    ("qk_layernorm", True, "the table maps no self_attention.q_layernorm.weight tensors (--preset megatron-qwen3"),
    ("num_experts", 4, "the table maps no mlp.experts.experts.linear_fc1.weight tensors (--preset megatron-qwen3-moe"),
    ("multi_latent_attention", True, "the table maps no self_attention.linear_kv_down_proj.weight tensors"),
])
def test_megatron_export_hf_refuses_args_the_preset_does_not_map(interleaved, tmp_path, arg, value, said):
    ckpt = _with_args(interleaved[0], tmp_path / "ckpt", **{arg: value})
    code, out = _run("export-hf", ckpt, tmp_path / "hf", "--preset", "megatron-llama")
    assert code == 2 and out.count("\n") == 1, out
    assert f"--preset megatron-llama: {arg} {value!r} ({ckpt / 'common.pt'}'s args)" in out and said in out, out
    assert not (tmp_path / "hf").exists()


def test_megatron_export_hf_refuses_a_tie_the_args_contradict(interleaved, tmp_path):
    import transformers

    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, tie_word_embeddings=True).save_pretrained(tmp_path / "assets")
    code, out = _run("export-hf", interleaved[0], tmp_path / "hf", "--preset", "megatron-llama",
                     "--hf-assets", tmp_path / "assets")
    assert code == 2 and out.count("\n") == 1, out
    assert "untie_embeddings_and_output_weights True" in out and "says tie_word_embeddings true" in out, out


def test_megatron_export_hf_without_args_names_config_jsons_own_fields(interleaved, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(interleaved[0], bare)
    torch.save({}, bare / "common.pt")  # as megatron-core alone saves a model
    code, out = _run("export-hf", bare, tmp_path / "hf", "--preset", "megatron-llama")
    assert code == 2 and out.count("\n") == 1, out
    assert "num_hidden_layers, num_key_value_heads" in out and "n_kv_heads" not in out, out


def test_megatron_export_hf_takes_megatron_args_for_a_checkpoint_that_states_none(interleaved, interleaved_hf,
                                                                                  tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(interleaved[0], bare)
    torch.save({}, bare / "common.pt")  # megatron-core alone: nothing says the rotary layout is interleaved
    code, out = _run("export-hf", bare, tmp_path / "hf", "--preset", "megatron-llama", "--hf-assets",
                     interleaved_hf[0], "--megatron-args", '{"rotary_interleaved": true}')
    assert code == 0, out
    assert _difference(_hf_model(tmp_path / "hf"), interleaved[1]) < 1e-5
    code, out = _run("export-hf", bare, tmp_path / "hf2", "--preset", "none", "--megatron-args",
                     '{"rotary_interleaved": true}')
    assert code == 2 and "--megatron-args applies to a Megatron preset" in out, out


# ------------------------------------------------------------------------------- config.json from the args


def test_megatron_export_hf_makes_config_json_from_args_that_transformers_loads(interleaved_hf, qwen3, tmp_path):
    import json

    report = ckptkit.export_hf(qwen3[0], tmp_path / "hf", preset="megatron-qwen3")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    difference = _difference(_hf_model(tmp_path / "hf"), qwen3[1])
    print(f"qwen3, config.json from common.pt's args: largest logit difference vs megatron-core: {difference:.3g}")
    assert difference < 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["vocab_size"] == VOCAB and config["tie_word_embeddings"] is False
    assert any(n.startswith("config.json (qwen3) made from ") and "rms_norm_eps <- norm_epsilon" in n
               for n in report.notes), report.notes
    llama = json.loads((interleaved_hf[0] / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"] and llama["rope_parameters"]["rope_theta"] == 10000.0


def test_megatron_export_hf_makes_a_qwen3_moe_config_from_megatron_args(tmp_path):
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(5)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields)).eval()
    model.save_pretrained(tmp_path / "hf")
    ckptkit.convert(tmp_path / "hf", tmp_path / "mcore", to="megatron", world_size=2)  # common.pt: no args
    args = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, group_query_attention=True,
                num_query_groups=2, kv_channels=8, norm_epsilon=1e-6, max_position_embeddings=16, rotary_base=10000,
                untie_embeddings_and_output_weights=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                qk_layernorm=True, swiglu=True, moe_router_pre_softmax=False, params_dtype="float32")
    ckptkit.export_hf(tmp_path / "mcore", tmp_path / "back", preset="megatron-qwen3-moe", megatron_args=args)
    back = _hf_model(tmp_path / "back")
    assert type(back) is transformers.Qwen3MoeForCausalLM
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, model(tokens()).logits)


def test_megatron_export_hf_resolves_the_mapping_once_and_reads_the_run_arguments_once(qwen3, tmp_path, monkeypatch):
    """One export of a checkpoint with Megatron-LM's args and no config.json: one resolution of the mapping, one
    check of the run's arguments, and ``common.pt`` unpickled once (by the reader; the resolution takes the args
    it read)."""
    from ckptkit.formats.megatron import torch_dist
    from ckptkit.models import resolve
    from ckptkit.ops import _model

    calls = {"resolve": 0, "for_run": 0, "common.pt": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    read_archive = torch_dist.read_archive

    def read(file, *args, **kwargs):
        calls["common.pt"] += str(file).endswith(torch_dist.COMMON)
        return read_archive(file, *args, **kwargs)

    monkeypatch.setattr(_model, "resolve", counted("resolve", _model.resolve))
    monkeypatch.setattr(resolve, "for_run", counted("for_run", resolve.for_run))
    monkeypatch.setattr(torch_dist, "read_archive", read)
    report = ckptkit.export_hf(qwen3[0], tmp_path / "hf", preset="megatron-qwen3")
    assert any(n.startswith("config.json (qwen3) made from ") for n in report.notes), report.notes
    assert calls == {"resolve": 1, "for_run": 1, "common.pt": 1}


def test_megatron_export_hf_config_vocab_size_is_the_padded_embeddings_rows(qwen3, tmp_path):
    import json

    ckpt = _with_args(qwen3[0], tmp_path / "ckpt", vocab_size=50, padded_vocab_size=VOCAB)  # a 50-token tokenizer
    ckptkit.export_hf(ckpt, tmp_path / "hf", preset="megatron-qwen3")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == VOCAB
    _hf_model(tmp_path / "hf")


def test_megatron_export_hf_refuses_args_that_lack_a_config_field(qwen3, tmp_path):
    ckpt = _with_args(qwen3[0], tmp_path / "ckpt", norm_epsilon=None)
    code, out = _run("export-hf", ckpt, tmp_path / "hf", "--preset", "megatron-qwen3")
    assert code == 2 and out.count("\n") == 1, out
    assert "state no norm_epsilon; the generated config.json's rms_norm_eps needs it" in out, out
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------------------------------- NeMo 2

_MODEL_YAML = """\
_target_: nemo.collections.llm.gpt.model.llama.LlamaModel
config:
  _cpu_offloading_: false
  _target_: nemo.collections.llm.gpt.model.llama.LlamaConfig
  activation_func:
    _call_: false
    _target_: torch.nn.functional.silu
  add_bias_linear: false
  add_qkv_bias: false
  apply_query_key_layer_scaling: false
  bf16: false
  fp16: false
  ffn_hidden_size: 64
  gated_linear_unit: true
  hidden_size: 32
  kv_channels: 8
  layernorm_epsilon: 1.0e-06
  make_vocab_size_divisible_by: 128
  normalization: RMSNorm
  num_attention_heads: 4
  num_layers: 2
  num_moe_experts: null
  num_query_groups: 2
  params_dtype:
    _call_: false
    _target_: torch.float32
  position_embedding_type: rope
  qk_layernorm: false
  rotary_base: 10000
  rotary_interleaved: false
  rotary_percent: 1.0
  seq_length: 16
  share_embeddings_and_output_weights: false
  vocab_size: null
model_transform: null
optim:
  _target_: nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule
tokenizer:
  _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer
  pretrained_model_name: tiny-llama
"""


@pytest.fixture(scope="module")
def nemo2(tmp) -> tuple[Path, torch.Tensor]:
    """A NeMo 2 checkpoint of the tiny Llama (see the module docstring), and megatron-core's logits."""
    root = tmp / "nemo2"
    _, logits = saved_with_logits(tmp, "llama", 2, with_args=False, prefix="module.", out=root / "weights")
    (root / "context").mkdir()
    (root / "context" / "model.yaml").write_text(_MODEL_YAML)
    (root / "context" / "io.json").write_text('{"root": {}, "objects": {}}')
    return root, logits


def test_nemo2_top_directory_is_read_as_its_weights_on_every_command(nemo2, tmp_path):
    root = nemo2[0]
    oracle = load_dcp(root / "weights", tmp_path / "oracle.pt")
    tensors = {k: v for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    assert {t.key for t in ckptkit.inspect(root).tensors} == set(tensors)
    assert "module.decoder.layers.self_attention.linear_qkv.weight" in tensors
    code, out = _run("inspect", root)
    assert code == 0 and "weights/ of the NeMo 2 checkpoint" in out, out
    ckptkit.convert(root, tmp_path / "full.pt", to="full")
    assert_same_tree({k: v for k, v in torch.load(tmp_path / "full.pt").items() if k in tensors}, tensors)
    report = ckptkit.reshard(root, tmp_path / "r3", world_size=3)
    assert any("NeMo 2" in n for n in report.notes), report.notes
    assert_same_tree({k: v for k, v in load_dcp(tmp_path / "r3", tmp_path / "r3.pt").items() if k in tensors},
                     tensors)
    assert ckptkit.verify(root, root / "weights").ok and ckptkit.verify(root, tmp_path / "r3").ok


def test_nemo2_export_hf_takes_the_config_from_context_model_yaml(nemo2, tmp_path):
    import json

    root, megatron_logits = nemo2
    report = ckptkit.export_hf(root, tmp_path / "hf", preset="megatron-llama")  # no --hf-assets
    difference = _difference(_hf_model(tmp_path / "hf"), megatron_logits)
    print(f"NeMo 2 llama, config.json from model.yaml: largest logit difference vs megatron-core: {difference:.3g}")
    assert difference < 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["rms_norm_eps"]) == (2, 2, 1e-6)
    assert any(f"made from {root / 'context' / 'model.yaml'}" in n for n in report.notes), report.notes


def test_nemo2_model_yaml_with_a_gated_quick_gelu_is_refused_by_a_swiglu_table(nemo2, tmp_path):
    root = tmp_path / "nemo2"
    shutil.copytree(nemo2[0], root)
    yaml = root / "context" / "model.yaml"
    yaml.write_text(yaml.read_text().replace("torch.nn.functional.silu", "megatron.core.activations.quick_gelu"))
    code, out = _run("export-hf", root, tmp_path / "hf", "--preset", "megatron-llama")
    assert code == 2 and out.count("\n") == 1, out
    assert "--preset megatron-llama: quick_geglu True (" in out and "a gated quick-GELU MLP" in out, out
    assert not (tmp_path / "hf").exists()


def test_nemo2_model_yaml_that_says_interleaved_is_applied(nemo2, tmp_path):
    root = tmp_path / "nemo2"
    shutil.copytree(nemo2[0], root)
    yaml = root / "context" / "model.yaml"
    yaml.write_text(yaml.read_text().replace("rotary_interleaved: false", "rotary_interleaved: true"))
    report = ckptkit.export_hf(root, tmp_path / "hf", preset="megatron-llama")
    assert any(n.startswith("rotary_interleaved True (") for n in report.notes), report.notes
    yaml.write_text(yaml.read_text().replace("normalization: RMSNorm", "normalization: LayerNorm"))
    code, out = _run("export-hf", root, tmp_path / "hf2", "--preset", "megatron-llama")
    assert code == 2 and f"normalization 'LayerNorm' ({yaml})" in out, out

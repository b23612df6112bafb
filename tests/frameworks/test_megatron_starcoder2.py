"""StarCoder2, a family added as one module (``ckptkit/models/families/starcoder2.py``) and this test.

The source is megatron-core 0.16.1's own GPTModel of StarCoder2's shape (local spec: LayerNorm with biases,
biases on every linear layer, grouped-query attention, a GELU MLP whose bias and activation megatron-core fuses
into the tanh approximation, ``_megatron.py``'s CPU patches), saved by its own ``dist_checkpointing.save`` at
TP=2 on 2 gloo ranks with Megatron-LM's run arguments in ``common.pt``. ``export-hf`` with ``--preset auto`` and
no ``--hf-assets`` must take the family's table and write a ``config.json`` from the arguments that
transformers' ``Starcoder2ForCausalLM`` loads with nothing missing or unexpected, giving megatron-core's logits;
``convert --to megatron`` of that export must load in megatron-core (``dist_checkpointing.load`` at TP=1) with
every parameter equal to the original's, its forward giving the original's logits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

import _megatron as M
import ckptkit
from _checks import assert_same_tree, load_dcp

pytest.importorskip("megatron.core")


def _config(tp: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, kv_channels=8,
        normalization="LayerNorm", layernorm_epsilon=1e-5, gated_linear_unit=False, activation_func=F.gelu,
        add_bias_linear=True, bias_activation_fusion=True, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False)


def _args(tp: int) -> argparse.Namespace:
    """The run's arguments as Megatron-LM keeps them in ``common.pt`` (those of a StarCoder2 run, under its names)."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=8, padded_vocab_size=M.VOCAB, max_position_embeddings=M.SEQ * 2,
        normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False, squared_relu=False, apply_layernorm_1p=False,
        add_bias_linear=True, add_qkv_bias=True, bias_gelu_fusion=True, untie_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
        qk_layernorm=False, num_experts=None, apply_query_key_layer_scaling=False, tensor_model_parallel_size=tp,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto, make_vocab_size_divisible_by=M.VOCAB,
        bf16=False, fp16=False)


def _start(tp: int, seed: int):
    """This rank's StarCoder2 GPTModel at ``tp``, weights drawn from ``seed`` (norms and biases too)."""
    import torch._dynamo
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch._dynamo.config.disable = True  # megatron-core's fused bias-GELU, run as written rather than compiled
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    model = GPTModel(config=_config(tp), vocab_size=M.VOCAB, max_sequence_length=M.SEQ * 2,
                     transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=10000)
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _save(rank: int, world: int, out: str, logits: str) -> None:
    """megatron-core's save of the model with the run's arguments at TP=2; then its own load and forward."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    model = _start(2, 0)
    state = {**model.sharded_state_dict(), "args": _args(2), "checkpoint_version": 3.0, "iteration": 0}
    Path(out).mkdir(exist_ok=True)
    with M._cpu_save():
        dist_checkpointing.save(state, out, sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    M._stop_writer_manager()
    M._load_into(model, out)  # the ranks' replicated norms and biases differ until they load the one copy saved
    result = M._forward(model, 2)
    if rank == 0:
        torch.save(result, logits)
    M._done()


def _load(rank: int, world: int, ckpt: str, result: str) -> None:
    """megatron-core's load of ``ckpt`` into a fresh model at TP=1, its parameters and its forward."""
    model = _start(1, 1)
    M._load_into(model, ckpt)
    torch.save({"params": M._local(model), "logits": M._forward(model, 1)}, Path(result) / f"rank{rank}.pt")
    M._done()


@pytest.fixture(scope="module")
def starcoder2(tmp_path_factory) -> dict:
    from _spawn import spawn

    tmp = tmp_path_factory.mktemp("starcoder2")
    ckpt, logits, loaded = tmp / "megatron", tmp / "logits.pt", tmp / "loaded"
    spawn(_save, 2, str(ckpt), str(logits))
    report = ckptkit.export_hf(ckpt, tmp / "hf")
    ckptkit.convert(tmp / "hf", tmp / "back", to="megatron", world_size=2)
    loaded.mkdir()
    spawn(_load, 2, str(tmp / "back"), str(loaded))
    ranks = [torch.load(loaded / f"rank{r}.pt") for r in range(2)]
    return {"ckpt": ckpt, "logits": torch.load(logits), "report": report, "hf": tmp / "hf",
            "oracle": load_dcp(ckpt, tmp / "oracle.pt"), "params": M.assemble([r["params"] for r in ranks]),
            "back_logits": ranks[0]["logits"]}


def test_starcoder2_export_hf_by_preset_auto_loads_in_transformers_and_gives_megatrons_logits(starcoder2):
    import transformers

    notes = starcoder2["report"].notes
    assert any(n.startswith("--preset auto: megatron-starcoder2") for n in notes), notes
    assert any(n.startswith("config.json (starcoder2) made from ") and "hidden_act <- bias_gelu_fusion" in n
               for n in notes), notes
    config = json.loads((starcoder2["hf"] / "config.json").read_text())
    assert (config["hidden_act"], config["use_bias"], config["norm_epsilon"]) == ("gelu_pytorch_tanh", True, 1e-5)
    model, info = transformers.Starcoder2ForCausalLM.from_pretrained(starcoder2["hf"], output_loading_info=True,
                                                                      dtype=torch.float32)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(M.tokens()).logits
    difference = (logits - starcoder2["logits"]).abs().max().item()
    print(f"starcoder2: largest logit difference, transformers vs megatron-core: {difference:.3g}")
    assert difference < 1e-4


def test_starcoder2_convert_to_megatron_loads_in_megatron_core_with_every_parameter_and_its_logits(starcoder2):
    expected = {k: v for k, v in starcoder2["oracle"].items() if isinstance(v, torch.Tensor)}
    assert set(starcoder2["params"]) == set(expected)
    assert_same_tree(starcoder2["params"], expected)
    assert (starcoder2["back_logits"] - starcoder2["logits"]).abs().max().item() < 1e-5


def test_starcoder2_every_argument_of_its_run_is_honoured_refused_or_known_not_to_change_the_forward():
    from ckptkit.models.families.starcoder2 import FAMILY
    from ckptkit.models.megatron_args import unclassified

    assert unclassified(list(vars(_args(2))), FAMILY.megatron) == []


def test_starcoder2_export_hf_refuses_a_run_whose_gelu_the_config_json_states_otherwise(starcoder2, tmp_path):
    config = json.loads((starcoder2["hf"] / "config.json").read_text())
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ckptkit.UsageError, match=r"bias_gelu_fusion True \(.*common.pt's args\) means hidden_act "
                                                 r"'gelu_pytorch_tanh', but .*config.json says 'gelu'"):
        ckptkit.export_hf(starcoder2["ckpt"], tmp_path / "hf", hf_assets=tmp_path / "assets")
    assert not (tmp_path / "hf").exists()

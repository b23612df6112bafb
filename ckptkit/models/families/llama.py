"""Llama (HF ``llama``): torchtitan's Llama 3, Meta's original names (``consolidated.00.pth`` with
``params.json``, which Mistral's consolidated files and torchtitan <= 0.2 use too) and megatron-core's GPT,
each <-> HF Llama."""

from __future__ import annotations

from ..family import Family, HfModel
from ..megatron_args import MegatronRules
from ..preset import Preset
from ._mcore import gpt, megatron_preset
from ._mcore_config import GptConfig
from ._rows import META, TITAN, llama_shaped

__all__ = ["FAMILY"]

_INV_FREQ = "model.layers.{n}.self_attn.rotary_emb.inv_freq"

FAMILY = Family(
    "llama",
    presets=(
        Preset("torchtitan-llama", "torchtitan's Llama 3 (0.3 names; 0.1-0.2 names read too) <-> HF Llama, with the "
               "rotary q/k row order", "torchtitan",
               llama_shaped((TITAN + "wq", META + "wq"), (TITAN + "wk", META + "wk"), (TITAN + "wv", META + "wv"),
                            ("lm_head.weight", "output.weight"), "rotary"),
               dropped=("freqs_cis", _INV_FREQ), model_types=("llama",)),
        Preset("meta-llama", "Meta's original Llama names (consolidated.00.pth, params.json; also Mistral's "
               "consolidated files and torchtitan <= 0.2) <-> HF Llama, with the rotary q/k row order", "Meta",
               llama_shaped((META + "wq",), (META + "wk",), (META + "wv",), ("output.weight",), "rotary"),
               dropped=("rope.freqs", _INV_FREQ), single_file=True, model_types=("llama",)),
        megatron_preset("megatron-llama", "megatron-core GPT (torch_dist: layer-stacked or per-layer, fused QKV per "
                        "query group, fused gate/up) <-> HF Llama 3, Mistral", gpt(), "llama", "mistral"),
    ),
    hf=(HfModel("llama", "LlamaForCausalLM", tied=False), HfModel("llama4", tied=False)),
    megatron=MegatronRules(configs=(("llama", GptConfig("llama", "LlamaForCausalLM", extra=(("mlp_bias", False),))),)),
    model_parallel="convert the model with transformers' convert_llama_weights_to_hf.py, or use a single-file release "
                   "such as the 8B's",
    rank=0,
)

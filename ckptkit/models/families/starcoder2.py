"""StarCoder2 (HF ``starcoder2``): LayerNorm (a weight and a bias) before attention and before the MLP, biases on
every linear layer, grouped-query attention with rotary embeddings over whole heads, and a GELU MLP without a gate
(``c_fc``, ``c_proj``). megatron-core's GPT saved by a Megatron-LM run with ``--normalization LayerNorm``, linear
biases and no ``--swiglu`` <-> HF.

megatron-core's GELU MLP with biases computes the tanh approximation of GELU where the bias and the activation
are fused (``--bias-gelu-fusion``, Megatron-LM's default) and the exact GELU otherwise: the run's argument is
``config.json``'s ``hidden_act``.
"""

from __future__ import annotations

from ..family import Family, HfModel
from ..megatron_args import MegatronRules, Stated
from ._mcore import HF, MLP, common, gqa, megatron_preset, plain_mlp, post_attention_norm
from ._mcore_config import LAYER_NORM_FIELDS, GptConfig

__all__ = ["FAMILY"]

_ROWS = tuple(common(norm_bias=True) + gqa(False, True, norm_bias=True, linear_bias=True)
              + post_attention_norm(norm_bias=True) + plain_mlp(HF + "mlp.", MLP, ("c_fc", "c_proj"), bias=True))
_RUN = (("normalization", ("LayerNorm",)), ("swiglu", (False,)), ("add_bias_linear", (True,)))
"""The arguments of a StarCoder2 run whose values differ from the common ones."""
_GELU = Stated("bias_gelu_fusion", "hidden_act", ((True, "gelu_pytorch_tanh"), (False, "gelu")),
               default="gelu_pytorch_tanh", means="neither true nor false")

FAMILY = Family(
    "starcoder2",
    presets=(megatron_preset("megatron-starcoder2", "megatron-core GPT with LayerNorm, biases on every linear layer "
                             "and a GELU MLP <-> HF StarCoder2", _ROWS, "starcoder2", run_args=_RUN),),
    hf=(HfModel("starcoder2", "Starcoder2ForCausalLM", tied=True),),
    megatron=MegatronRules(
        configs=(("starcoder2", GptConfig("starcoder2", "Starcoder2ForCausalLM", fields=LAYER_NORM_FIELDS,
                                          hidden_act=None, attention_bias="use_bias", bias_args=("add_bias_linear",),
                                          states=(_GELU,))),),
        states=(_GELU,)),
)

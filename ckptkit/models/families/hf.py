"""HF's own names checked as they are: every key known, none missing (Qwen2's q/k/v biases included)."""

from __future__ import annotations

from ..preset import Preset
from ._llama import hf_names

__all__ = ["PRESETS"]

PRESETS = (
    Preset("qwen2", "HF Qwen2 names, checked: every key known, none missing (q/k/v biases included)", "Qwen2",
           hf_names(biases=True), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),
    Preset("mistral", "HF Mistral (and Llama) names, checked: every key known, none missing", "Mistral",
           hf_names(biases=False), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),
)

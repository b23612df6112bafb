"""Meta's original Llama names (``consolidated.00.pth`` with ``params.json``), which Mistral's consolidated
files and torchtitan <= 0.2 use too."""

from __future__ import annotations

from ..preset import Preset
from ._llama import META, llama_rows

__all__ = ["PRESETS"]

PRESETS = (
    Preset("meta-llama", "Meta's original Llama names (consolidated.00.pth, params.json; also Mistral's "
           "consolidated files and torchtitan <= 0.2) <-> HF Llama, with the rotary q/k row order", "Meta",
           llama_rows((META + "wq",), (META + "wk",), (META + "wv",), ("output.weight",), "rotary"),
           dropped=("rope.freqs", "model.layers.{n}.self_attn.rotary_emb.inv_freq"), single_file=True,
           model_types=("llama",)),
)

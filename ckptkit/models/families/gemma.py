"""Gemma (HF ``gemma``, ``gemma2``, ``gemma3``, ``gemma3_text``): no table yet. Its HF models tie the output head to
the embedding by default, and ``convert --to megatron`` refuses it by name."""

from __future__ import annotations

from ..family import Family, HfModel
from ..megatron_args import MegatronRules

__all__ = ["FAMILY"]

FAMILY = Family(
    "gemma",
    hf=(HfModel("gemma", tied=True), HfModel("gemma2", tied=True), HfModel("gemma3", tied=True),
        HfModel("gemma3_text", tied=True)),
    megatron=MegatronRules(no_table="Gemma has no Megatron table: megatron-core 0.16.1 has no layer with its embedding "
                           "scaling (nor Gemma 2 and 3's extra norms; Megatron-Bridge adds its own)"),
)

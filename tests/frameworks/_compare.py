"""Checks the framework tests share: the results read back by transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from _checks import assert_same_tree


def assert_loads_in_transformers(hf_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    """``from_pretrained`` finds every weight (nothing missing, unexpected or mismatched) and gets ``expected``."""
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_same_tree(model.state_dict(), expected)

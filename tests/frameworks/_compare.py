"""Checks the framework tests share: the results read back by transformers, and resumed by ``ckptkit.load``."""

from __future__ import annotations

from pathlib import Path

import torch

import ckptkit
from _checks import assert_same_tree


def assert_loads_in_transformers(hf_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    """``from_pretrained`` finds every weight (nothing missing, unexpected or mismatched) and gets ``expected``."""
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_same_tree(model.state_dict(), expected)


def _adamw_like(expected: dict):
    """A fresh model and an AdamW with the saved param groups (by parameter name)."""
    from _workers import tiny_llama

    model = tiny_llama()
    named = dict(model.named_parameters())
    groups = [{"params": [named[n] for n in g["params"]]} for g in expected["optimizer"]["param_groups"]]
    return model, torch.optim.AdamW(groups, lr=0.5)


def assert_resumes(ckpt: Path, expected: dict, step: int) -> None:
    """``ckptkit.load`` of ``ckpt`` gives the saved model, the optimizer's state and the step."""
    model, opt = _adamw_like(expected)
    result = ckptkit.load(ckpt, model, optimizer=opt)
    assert result.optimizer_loaded and result.step == step
    assert_same_tree(model.state_dict(), expected["model"])
    assert_same_tree({n: opt.state[p] for n, p in model.named_parameters()}, expected["optimizer"]["state"])


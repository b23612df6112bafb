"""What the model's tensors are called in a Hugging Face checkpoint.

Training checkpoints carry wrapper names in their keys (``module.`` from DDP, ``_orig_mod.`` from
``torch.compile``, ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.`` from FSDP1 and activation
checkpointing). Every rename is counted and reported; which tensors are the model is :mod:`.select`'s rule.
"""

from __future__ import annotations

import re
from collections import Counter

__all__ = ["RECOMPUTED", "WRAPPER_NAMES", "strip_names", "strip_wrapper_names"]

RECOMPUTED = re.compile(r"(^|\.)(inv_freq|freqs_cis|freqs|position_ids|masked_bias|_extra_state)$")
"""Names of what a checkpoint may hold beside the weights and a consumer rebuilds itself: rotary tables
(``rotary_emb.inv_freq``, ``freqs_cis``, Meta's ``rope.freqs``), position ids, attention masks and Transformer
Engine's ``_extra_state``. Only these may be left out of a model on a refusal's advice; a weight never is."""

WRAPPER_NAMES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Key segments that wrappers insert anywhere; ``module`` is stripped only as a leading segment (DDP)."""


def strip_wrapper_names(key: str, counts: Counter | None = None) -> str:
    """``key`` without leading ``module.`` segments and without :data:`WRAPPER_NAMES` segments; ``counts``
    tallies what was stripped."""
    counts = Counter() if counts is None else counts
    parts = key.split(".")
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
        counts["module."] += 1
    for p in parts:
        if p in WRAPPER_NAMES:
            counts[p + "."] += 1
    return ".".join(p for p in parts if p not in WRAPPER_NAMES)


def strip_names(key: str, prefixes: tuple[str, ...], wrappers: bool, counts: Counter) -> str:
    """``key`` without wrapper names (when ``wrappers``), then without each of ``prefixes`` that it starts
    with, in turn; ``counts`` tallies what was stripped."""
    if wrappers:
        key = strip_wrapper_names(key, counts)
    for prefix in prefixes:
        if key.startswith(prefix):
            key = key[len(prefix):]
            counts[prefix] += 1
    return key

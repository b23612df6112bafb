"""What the model's tensors are called in a Hugging Face checkpoint.

Training checkpoints carry wrapper names in their keys (``module.`` from DDP, ``_orig_mod.`` from
``torch.compile``, ``_fsdp_wrapped_module.`` and ``_checkpoint_wrapped_module.`` from FSDP1 and activation
checkpointing). Every rename is counted and reported; which tensors are the model is :mod:`.select`'s rule.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["WRAPPER_NAMES", "strip_names", "strip_wrapper_names"]

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

"""Which tensors are "the model", and what they are called in a Hugging Face checkpoint.

Training checkpoints nest the model (``{"model": ..., "optimizer": ...}``) and carry wrapper names in their
keys (``module.`` from DDP, ``_orig_mod.`` from ``torch.compile``, ``_fsdp_wrapped_module.`` and
``_checkpoint_wrapped_module.`` from FSDP1 and activation checkpointing). Every rename is counted and
reported; nothing is dropped silently, and two keys that would collide are an error.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from ..core.manifest import Manifest, TensorEntry
from ..errors import UsageError

__all__ = ["MODEL_KEYS", "WRAPPER_NAMES", "ModelSelection", "select_model", "strip_wrapper_names"]

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
"""Top-level keys tried, in order, when ``model_key="auto"``."""
WRAPPER_NAMES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Key segments that wrappers insert anywhere; ``module`` is stripped only as a leading segment (DDP)."""


@dataclass(frozen=True)
class ModelSelection:
    tensors: tuple[TensorEntry, ...]
    model_key: str | None
    """The top-level key the model was found under; None when the checkpoint is a flat model state dict."""
    renamed: tuple[tuple[str, int], ...]
    """(what was stripped, how many keys) pairs, for the report."""
    left_out: int
    """Entries outside the model part (optimizer state, step counters)."""


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


def _strip(key: str, prefixes: tuple[str, ...], wrappers: bool, counts: Counter) -> str:
    if wrappers:
        key = strip_wrapper_names(key, counts)
    for prefix in prefixes:
        if key.startswith(prefix):
            key = key[len(prefix):]
            counts[prefix] += 1
    return key


def select_model(manifest: Manifest, model_key: str = "auto", strip_prefixes: tuple[str, ...] = (),
                 strip_wrappers: bool = True) -> ModelSelection:
    tops = list(dict.fromkeys(str(e.path[0]) for e in manifest.entries))
    nested = {str(t.path[0]) for t in manifest.tensors if len(t.path) > 1}
    found: str | None
    if model_key == "auto":
        found = next((k for k in MODEL_KEYS if k in nested), None)
    elif model_key in nested:
        found = model_key
    else:
        raise UsageError(f"{manifest.root}: no model under top-level key {model_key!r}; "
                         f"top-level keys are {tops[:12]} (use --model-key, or 'auto')")
    if found is None:
        chosen = [(t, t.key) for t in manifest.tensors]
    else:
        chosen = [(t, ".".join(str(p) for p in t.path[1:])) for t in manifest.tensors if str(t.path[0]) == found]
    counts: Counter[str] = Counter()
    out: list[TensorEntry] = []
    origin: dict[str, str] = {}
    for t, key in chosen:
        new = _strip(key, strip_prefixes, strip_wrappers, counts)
        if new in origin:
            raise UsageError(f"{manifest.root}: {origin[new]!r} and {t.key!r} both become {new!r} "
                             "after stripping prefixes")
        origin[new] = t.key
        out.append(dataclasses.replace(t, key=new, path=(new,)))
    left_out = len(manifest.tensors) + len(manifest.objects) - len(out)
    return ModelSelection(tuple(out), found, tuple(sorted(counts.items())), left_out)

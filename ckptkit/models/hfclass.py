"""The keys that transformers' model class of a ``config.json`` loads, compared with the keys an HF output holds.

An HF folder whose ``model.safetensors`` holds names its ``config.json``'s class does not know loads with those
weights initialised afresh, and ``from_pretrained`` only logs it. So before an HF output is written, the class
the config names is built on the meta device (no memory, no weights), and each key to write is matched as
``from_pretrained`` matches it: through the class's own checkpoint conversions (transformers 5 joins per-expert
weights into fused ones on load) and its base-model prefix. What is left over either way is reported:
keys the class would not load, and weights of the class that no key gives. The class's own exceptions apply:
tied weights, the keys it ignores on load, the rotary tables and position ids older checkpoints carry.

Nothing is checked where transformers is not importable, the config names no class it has, or the class is
custom code (``auto_map``), which is not run.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from .classcache import remembered
from .completeness import listed
from .hfconfig import model_class
from .preset import Preset
from .registry import PRESETS

__all__ = ["CHECK_ENV", "ClassKeys", "check_asked", "check_class", "class_keys"]

CHECK_ENV = "CKPTKIT_CLASS_CHECK"
"""Set to ``0`` to skip the check: asking transformers the first time imports torch and its model code (seconds,
some 300 MB); the report then says the output was not checked."""


def check_asked() -> bool:
    """Whether the class check runs: unless ``$CKPTKIT_CLASS_CHECK`` is ``0`` (or ``off``, ``false``, ``no``)."""
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class ClassKeys:
    """How transformers' class of a config would load a set of keys."""

    name: str
    """The class, as transformers names it (as ``config.json``'s ``architectures`` does)."""
    unexpected: tuple[str, ...]
    """Keys to write that the class does not load."""
    missing: tuple[str, ...]
    """Parameters of the class that no key gives: initialised afresh on load."""
    buffers: tuple[str, ...]
    """Persistent buffers of the class that no key gives: the class computes them when it is built."""


_ALWAYS_UNEXPECTED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")
"""What ``from_pretrained`` ignores in any checkpoint of a class that holds such buffers (older releases saved
them)."""


def _meta_model(config: dict):
    """The config's class built on the meta device, or None (see the module docstring)."""
    if config.get("auto_map"):
        return None
    cls = model_class(config)
    if cls is None:
        return None
    import torch

    try:
        built = cls.config_class.from_dict(dict(config))
        with torch.device("meta"):
            return cls(built)
    except Exception:  # noqa: BLE001 - a config transformers cannot build its class from is not ours to judge
        return None


def _conversions(model) -> tuple[list, list, object | None]:
    """The class's checkpoint renamings and converters, and transformers' own key renaming (transformers 5);
    none on older releases, whose classes load the names they save."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return [], [], None
    mapping = get_model_conversion_mapping(model)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)], rename_source_key)


def _loaded_as(key: str, model, expected: dict, renamings: list, converters: list, rename) -> str:
    """The class's name for checkpoint key ``key``, as ``from_pretrained`` renames it."""
    prefix = model.base_model_prefix
    if rename is not None:
        renamed, _ = rename(key, renamings, converters, prefix, expected)
        if renamed not in expected and key in expected:
            renamed, _ = rename(key, [], [], prefix, expected)
        return renamed
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
        return key[len(prefix) + 1:]
    return f"{prefix}.{key}" if prefix and f"{prefix}.{key}" in expected else key


def _ignored(patterns) -> re.Pattern | None:
    patterns = [p for p in patterns or () if p]
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def class_keys(config: dict, keys: Sequence[str]) -> ClassKeys | None:
    """How transformers' class of ``config`` would load ``keys`` (see the module docstring); an answer given
    before for the same config, keys and transformers release is read from the cache
    (:mod:`ckptkit.models.classcache`) instead.

    Args:
        config: an HF ``config.json``, parsed.
        keys: the tensor names of the HF output.

    Returns:
        The class's name and what would be left over, or None where no class can be asked.
    """
    return remembered("class-keys", [config, list(keys)], lambda: _class_keys(config, keys), _encoded, _decoded)


def _encoded(found: ClassKeys | None) -> dict | None:
    return dataclasses.asdict(found) if found is not None else None


def _decoded(data: dict | None) -> ClassKeys | None:
    if data is None:
        return None
    return ClassKeys(str(data["name"]), *(tuple(map(str, data[f])) for f in ("unexpected", "missing", "buffers")))


def _class_keys(config: dict, keys: Sequence[str]) -> ClassKeys | None:
    model = _meta_model(config)
    if model is None:
        return None
    expected = model.state_dict()
    renamings, converters, rename = _conversions(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for key in keys:
        name = _loaded_as(key, model, expected, renamings, converters, rename)
        if name in expected:
            loaded.add(name)
        else:
            unexpected.append(key)
    buffers = {n for n, _ in model.named_buffers()}
    has_buffers = any(b.endswith(("inv_freq", "position_ids")) for b in buffers)
    skip_unexpected = _ignored([*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
                                *(_ALWAYS_UNEXPECTED if has_buffers else ())])
    skip_missing = _ignored(getattr(model, "_keys_to_ignore_on_load_missing", None))
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    if not tied and getattr(model.config, "tie_word_embeddings", False):  # transformers 4: a list of patterns
        tied = {k for k in expected for p in getattr(model, "_tied_weights_keys", None) or () if re.search(p, k)}
    missing = [k for k in expected if k not in loaded and k not in tied
               and not (skip_missing and skip_missing.search(k))]
    return ClassKeys(type(model).__name__,
                     tuple(k for k in unexpected if not (skip_unexpected and skip_unexpected.search(k))),
                     tuple(k for k in missing if k not in buffers), tuple(k for k in missing if k in buffers))


def check_class(config: dict, keys: Sequence[str], where: str, keep_names: bool, mapped_by: Preset | None = None
                ) -> tuple[str, ...]:
    """Refuses an HF output that transformers' class of ``config`` (read from ``where``) would load differently:
    keys it does not load, or weights of it that no key gives (:func:`class_keys`). ``keep_names``
    (``--preset none``): the names were asked for as they are, so keys it does not load are a note. Buffers the
    class computes itself are always a note. Keys that preset ``mapped_by`` wrote for the family the config names
    are not checked again: each table is tested against that family's class, and importing transformers' model
    code costs seconds.

    Returns:
        Notes for the report.

    Raises:
        UsageError: the keys and the class disagree.
    """
    if mapped_by is not None and config.get("model_type") in mapped_by.model_types:
        return ()
    if not check_asked():
        return (f"not checked against transformers' class of {where} ({CHECK_ENV}=0): keys it would not load, or "
                "weights it would initialise afresh, are not found",)
    found = class_keys(config, keys)
    if found is None:
        return ()
    notes = []
    if found.unexpected and keep_names:
        notes.append(f"--preset none: transformers' {found.name} ({where}) does not load {len(found.unexpected)} of "
                     f"the keys written: {listed(found.unexpected)}")
    elif found.unexpected or found.missing:
        said = [f"does not load {len(found.unexpected)} of the keys to write ({listed(found.unexpected)})"
                ] if found.unexpected else []
        said += [f"would initialise {len(found.missing)} of its weights afresh, which no key gives "
                 f"({listed(found.missing)})"] if found.missing else []
        advice = (f"the names need a --preset ({', '.join(PRESETS)}), or --hf-assets of the model these weights are; "
                  "--preset none writes the names as they are" if found.unexpected
                  else "--hf-assets of the model these weights are")
        raise UsageError(f"{where}: transformers' {found.name} {' and '.join(said)}: {advice}")
    if found.buffers:
        notes.append(f"transformers' {found.name} computes {len(found.buffers)} buffers the output does not hold: "
                     f"{listed(found.buffers)}")
    return tuple(notes) or (f"every key loads in transformers' {found.name} ({where}), and none of its weights is "
                            "missing",)

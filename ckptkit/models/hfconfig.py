"""What a Hugging Face ``config.json`` says about the model that a conversion must honour: whether ``lm_head`` is
tied to the input embedding, which modules transformers keeps in float32, and its transformers class.
transformers is asked where it is installed; otherwise tables of its defaults stand in, or the question goes
unanswered and the caller says so.
"""

from __future__ import annotations

import re

from ..core.dtypes import DType
from .registry import TIE_DEFAULTS as _FAMILIES_TIE_DEFAULTS

__all__ = ["INPUT_EMBEDDINGS", "TIE_DEFAULTS", "keep_in_fp32", "model_class", "tie_word_embeddings"]


INPUT_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "shared.weight")
"""How an HF model's input embedding's key ends: what a tied ``lm_head.weight`` is tied to."""

TIE_DEFAULTS = {
    "phi": False, "phi3": False, "gpt_neox": False, "olmo2": False, "gpt2": True, "opt": True, "t5": True,
    "falcon": True, **_FAMILIES_TIE_DEFAULTS,
}
"""``tie_word_embeddings`` when config.json omits it, per ``model_type`` (the config classes of transformers
5.23): each family's own (:attr:`ckptkit.models.family.HfModel.tied`), and those of model types no family module
holds yet; used where transformers is not installed to ask."""


def _transformers_default(model_type: str) -> bool | None:
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        value = getattr(AutoConfig.for_model(model_type), "tie_word_embeddings", None)
    except (KeyError, ValueError):  # a model type this transformers does not know
        return None
    return value if isinstance(value, bool) else None


def tie_word_embeddings(config: dict) -> tuple[bool | None, str]:
    """Whether the model ties ``lm_head`` to its input embedding, and why: as config.json states it; else the
    default of its ``model_type``, from transformers' config class when transformers is importable, else
    from :data:`TIE_DEFAULTS`; else None (unknown)."""
    stated = config.get("tie_word_embeddings")
    if isinstance(stated, bool):
        return stated, f"config.json says tie_word_embeddings: {str(stated).lower()}"
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None, "config.json states neither tie_word_embeddings nor a model_type"
    default, source = _transformers_default(model_type), "transformers' config class"
    if default is None:
        default, source = TIE_DEFAULTS.get(model_type), "ckptkit's table of defaults"
    if default is None:
        return None, f"config.json omits tie_word_embeddings and the default of model_type {model_type!r} is unknown"
    return default, (f"config.json omits tie_word_embeddings; model_type {model_type!r} defaults to "
                     f"{str(default).lower()} ({source})")


def model_class(config: dict):
    """The transformers class the config names (``architectures``, else its ``model_type``'s causal LM), or None
    where transformers is not installed or does not know it. Looked up lazily: no model is built."""
    try:
        import transformers
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    names = [a for a in config.get("architectures") or () if isinstance(a, str)]
    model_type = config.get("model_type")
    for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"):
        name = getattr(modeling_auto, table, {}).get(model_type) if isinstance(model_type, str) else None
        names += [name] if isinstance(name, str) else []
    for name in names:
        try:
            return getattr(transformers, name)
        except (AttributeError, ImportError, RuntimeError):  # a class whose optional dependencies are missing
            continue
    return None


def keep_in_fp32(config: dict, cast: DType | None) -> tuple[re.Pattern | None, str | None]:
    """The keys transformers keeps in float32 when it loads the config's model class in ``cast``, as it matches
    them (``*`` as ``.*``, searched anywhere in the key), and which attribute said so: the class's
    ``_keep_in_fp32_modules`` under float16, and its ``_keep_in_fp32_modules_strict`` under float16 or bfloat16.
    (None, None) where there is no such class or list. The class's lists are read from the cache
    (:mod:`ckptkit.models.classcache`) where transformers was asked before."""
    if cast is None or cast.name not in ("float16", "bfloat16"):
        return None, None
    from .classcache import remembered

    name, lists = remembered("keep-in-fp32", config, lambda: _fp32_lists(config), list, tuple)
    found: list[str] = []
    said: list[str] = []
    attributes = ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict") if cast.name == "float16" else \
        ("_keep_in_fp32_modules_strict",)
    for attribute in attributes:
        modules = lists.get(attribute) or []
        if modules:
            found += modules
            said.append(f"{name}.{attribute} {modules}")
    if not found:
        return None, None
    return re.compile("|".join(m.replace("*", ".*") for m in found)), "; ".join(said)


def _fp32_lists(config: dict) -> tuple[str | None, dict[str, list[str]]]:
    """The config's class's name and its ``_keep_in_fp32_modules`` lists (sorted), by attribute."""
    cls = model_class(config)
    if cls is None:
        return None, {}
    lists = {a: sorted(getattr(cls, a, None) or ()) for a in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")}
    return cls.__name__, lists

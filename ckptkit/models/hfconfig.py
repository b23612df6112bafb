"""What a Hugging Face ``config.json`` (or Meta's ``params.json``) says about the model that a conversion must
honour: whether ``lm_head`` is tied to the input embedding, which modules transformers keeps in float32, and
the head counts a key-mapping preset needs. transformers is asked where it is installed; otherwise tables of
its defaults stand in, or the question goes unanswered and the caller says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..core.dtypes import DType
from ..errors import FormatError, UsageError
from ..formats.megatron import COMMON, COMMON_STATE, config_of_args, hf_fields, legacy_args
from .mapping import read_json
from .megatron_args import args_config, run_args
from .preset import ModelShape, Preset, model_shape

__all__ = ["INPUT_EMBEDDINGS", "TIE_DEFAULTS", "ModelConfig", "check_single_file", "find_config", "keep_in_fp32",
           "model_class",
           "read_model_config", "tie_word_embeddings"]


INPUT_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "shared.weight")
"""How an HF model's input embedding's key ends: what a tied ``lm_head.weight`` is tied to."""

TIE_DEFAULTS = {
    "llama": False, "llama4": False, "mistral": False, "mixtral": False, "qwen2": False, "qwen2_moe": False,
    "qwen3": False, "qwen3_moe": False, "phi": False, "phi3": False, "gpt_neox": False, "deepseek_v3": False,
    "olmo2": False, "gemma": True, "gemma2": True, "gemma3": True, "gemma3_text": True, "gpt2": True, "opt": True,
    "t5": True, "falcon": True,
}
"""``tie_word_embeddings`` when config.json omits it, per ``model_type`` (the config classes of transformers
5.23); used where transformers is not installed to ask."""


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


@dataclass(frozen=True)
class ModelConfig:
    """A model's config file, parsed."""

    path: Path
    data: dict

    @property
    def is_hf(self) -> bool:
        return self.path.name != "params.json"

    def shape(self) -> ModelShape:
        """Head counts, layers and weight tying for a key-mapping preset."""
        tied = tie_word_embeddings(self.data)[0] if self.is_hf else None
        return model_shape(self.data, str(self.path), tied)


def read_model_config(path: Path) -> dict:
    """An HF ``config.json`` or Meta ``params.json`` as a dict."""
    data = read_json(path, "config")
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


_CONSOLIDATED = re.compile(r"consolidated\.(\d+)\.pth")


def check_single_file(p: Preset, src: Path) -> None:
    """Refuses a model-parallel checkpoint of a preset whose own checkpoints come one file per rank (Meta's
    ``consolidated.00.pth``, ``consolidated.01.pth`` ...): one rank's file holds a slice of each weight."""
    src = Path(src)
    if not p.single_file or not _CONSOLIDATED.fullmatch(src.name):
        return
    ranks = sorted(f.name for f in src.parent.iterdir() if _CONSOLIDATED.fullmatch(f.name))
    if len(ranks) > 1:
        raise UsageError(f"{src}: one of {len(ranks)} model-parallel files ({ranks[0]} ... {ranks[-1]}); "
                         f"--preset {p.name} reads a single-file checkpoint, and joining model-parallel slices "
                         "is not supported (convert the model with transformers' convert_llama_weights_to_hf.py, "
                         "or use a single-file release such as the 8B's)")


def find_config(src: Path, hf_assets: Path | str | None) -> ModelConfig | None:
    """The model's config: ``hf_assets/config.json``; else the source's own (an HF directory's
    ``config.json``); else a megatron-core checkpoint's ``args`` in its common state (``common.pt``, or 0.19's
    ``common_state`` object; a Megatron-LM legacy checkpoint's, in its rank files), or a NeMo 2 checkpoint's
    ``context/model.yaml``, under HF's field names; else Meta's ``params.json`` beside a ``consolidated.00.pth``
    or in its directory."""
    src = Path(src)
    home = src if src.is_dir() else src.parent
    candidates = [Path(hf_assets) / "config.json"] if hf_assets is not None else []
    candidates += [src / "config.json"] if src.is_dir() else []
    path = next((c for c in candidates if c.is_file()), None)
    if path is not None:
        return ModelConfig(path, read_model_config(path))
    args = args_config(src) if src.is_dir() else None  # a megatron-core checkpoint's own run arguments
    if args is not None:
        return ModelConfig(src / (COMMON if (src / COMMON).is_file() else COMMON_STATE), args)  # 0.19: in the DCP
    nemo = run_args(src) if src.is_dir() else None  # NeMo 2's context/model.yaml above its weights/
    if nemo is not None:
        return ModelConfig(Path(nemo.source), hf_fields(nemo.values))
    legacy = legacy_args(src)  # Megatron-LM's legacy checkpoint: the args in its rank files
    if legacy is not None and (args := config_of_args(legacy[1])) is not None:
        return ModelConfig(legacy[0], args)
    params = home / "params.json"
    return ModelConfig(params, read_model_config(params)) if params.is_file() else None


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

"""What a preset needs to know of the model: its head counts, layers, experts and weight tying, read from an HF
``config.json`` or Meta's ``params.json`` (:func:`model_shape`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from .preset import Count, Heads

__all__ = ["CONFIG_NAMES", "ModelShape", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """What a preset needs to know of the model, from its config."""

    head_dim: int
    n_heads: int | None = None
    n_kv_heads: int | None = None
    layers: int | None = None
    tied: bool | None = None
    """Whether ``lm_head`` is tied to the input embedding (``tie_word_embeddings``); None: not known."""
    source: str = "config"
    """Where these came from, for messages (``base/config.json``)."""
    experts: int | None = None
    """Routed experts per MoE layer (``num_experts``, ``num_local_experts`` or ``n_routed_experts``)."""
    fields: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    """Every positive integer of the config, by its own name, for table rows that count rows in them."""

    def heads(self, which: Heads) -> int | None:
        return self.n_heads if which == "n_heads" else self.n_kv_heads

    def value(self, name: str, why: str) -> int:
        """The shape field ``name`` (``head_dim``, ``n_heads``, ``n_kv_heads``, ``heads_per_group``, ``layers``,
        ``experts``, or any integer field of the config).

        Raises:
            UsageError: the config does not state it; the message names the field and ``why`` it is needed.
        """
        known: dict[str, int | None] = {"head_dim": self.head_dim, "n_heads": self.n_heads,
                                        "n_kv_heads": self.n_kv_heads, "layers": self.layers,
                                        "experts": self.experts, **dict(self.fields)}
        if self.n_heads and self.n_kv_heads:
            known["heads_per_group"] = self.n_heads // self.n_kv_heads
        value = known.get(name)
        if value is None:
            raise UsageError(f"{self.source}: states no {CONFIG_NAMES.get(name, name)}; {why} needs it "
                             "(pass --hf-assets DIR with the model's config.json)")
        return value

    def count(self, factors: Count, why: str) -> int:
        return math.prod(f if isinstance(f, int) else self.value(f, why) for f in factors)


CONFIG_NAMES = {"experts": "num_experts (or num_local_experts, n_routed_experts)", "layers": "num_hidden_layers",
                "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
                "heads_per_group": "num_attention_heads and num_key_value_heads"}
"""A shape field (:meth:`ModelShape.value`) -> the config.json field(s) that state it, for messages."""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_shape(config: dict, source: str, tied: bool | None = None) -> ModelShape:
    """Head counts from an HF ``config.json`` (its ``text_config`` for a composite model) or Meta's
    ``params.json`` (fields under ``model`` in some releases). ``head_dim`` is the config's own where it
    states one (some models' differs from ``hidden_size / num_attention_heads``). The integer fields of the
    config's sub-configs are fields too, by their dotted name (``vision_config.patch_size``), with a
    ``head_dim`` (width over heads) where a sub-config states none."""
    top = config
    if isinstance(config.get("text_config"), dict) and "num_attention_heads" not in config:
        config = config["text_config"]
    if isinstance(config.get("model"), dict) and "n_heads" not in config:
        config = config["model"]
    hf = "num_attention_heads" in config or "hidden_size" in config
    n_heads = _int(config.get("num_attention_heads" if hf else "n_heads"))
    width = _int(config.get("hidden_size" if hf else "dim"))
    n_kv = _int(config.get("num_key_value_heads" if hf else "n_kv_heads")) or n_heads
    head_dim = _int(config.get("head_dim")) or (width // n_heads if width and n_heads else None)
    if head_dim is None:
        fields = "head_dim, or hidden_size and num_attention_heads" if hf else "head_dim, or dim and n_heads"
        raise UsageError(f"{source}: states neither {fields}; the preset needs the model's head_dim")
    if head_dim % 2:
        raise UsageError(f"{source}: head_dim {head_dim} is odd; rotary embeddings pair the dimensions of a head")
    layers = _int(config.get("num_hidden_layers" if hf else "n_layers"))
    experts = next((n for k in ("num_experts", "num_local_experts", "n_routed_experts") if (n := _int(config.get(k)))),
                   None)
    integers = tuple((k, v) for k, v in config.items() if _int(v) is not None)
    integers += tuple((f"{k}.{k2}", v2) for k, sub in top.items() if isinstance(sub, dict)  # vision_config.patch_size
                      for k2, v2 in {**_head_dim(sub), **sub}.items() if _int(v2) is not None)
    return ModelShape(head_dim, n_heads, n_kv, layers, tied, source, experts, integers)


def _head_dim(sub: dict) -> dict[str, int]:
    """A sub-config's head size where it states none: its width over its head count."""
    width, heads = _int(sub.get("hidden_size")), _int(sub.get("num_attention_heads") or sub.get("num_heads"))
    return {"head_dim": width // heads} if width and heads and width % heads == 0 else {}

"""Named key mappings between another code base's parameter names and Hugging Face's, as declarative tables.

A :class:`Preset` is a table of :class:`Row`\\ s. Each row pairs an HF name with the other code base's name
(``{n}`` stands for a layer number) and may name a tensor transform from :data:`TRANSFORMS`. Nothing here
reads a file or imports torch: :func:`ckptkit.ops.mapping.map_keys` applies a preset to a manifest's keys,
and a transform is a row gather (:attr:`ckptkit.core.manifest.TensorEntry.rows`) that streams like a copy.

Call order: 1. :func:`preset` by name; 2. :func:`model_shape` from the model's config (HF ``config.json`` or
Meta's ``params.json``), which the rotary transform needs for ``head_dim``; 3. ``map_keys``.

The rotary transform. torchtitan and Meta's original Llama code rotate adjacent pairs ``(2i, 2i+1)`` of each
q/k head as complex numbers; Hugging Face's ``rotate_half`` rotates ``(i, i + head_dim/2)``. So the HF rows of
a head are the other code base's rows in the order even, then odd. With ``hd = head_dim``, ``half = hd/2``, HF
row ``r = h·hd + j`` is row ``h·hd + 2·(j mod half) + j // half`` of the other's, which is what torchtitan's
``Llama3StateDictAdapter._permute`` and transformers' ``convert_llama_weights_to_hf.permute`` compute; the
inverse, ``_reverse_permute``, takes HF row ``h·hd + (k mod 2)·half + k // 2`` to row ``h·hd + k``. Only
``head_dim`` enters, so the same map serves q (``num_attention_heads`` heads) and k (``num_key_value_heads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import UsageError

__all__ = ["PRESETS", "TRANSFORMS", "ModelShape", "Preset", "Row", "model_shape", "preset", "rotary_rows"]

Heads = Literal["n_heads", "n_kv_heads"]


@dataclass(frozen=True, slots=True)
class Row:
    """One tensor's names: ``hf`` and ``other`` (each with ``{n}`` for the layer number, if any)."""

    hf: str
    other: tuple[str, ...]
    """The other code base's spellings, newest first: the first is written, all are read."""
    transform: str | None = None
    """A name in :data:`TRANSFORMS`, applied on the way to HF and inverted on the way back."""
    heads: Heads | None = None
    """The head count the tensor's rows hold, ``head_dim`` rows each; checked against the config."""
    tied_to: str | None = None
    """The HF name of the tensor this one may be tied to (``lm_head`` to the input embedding): when the HF side
    lacks it and the config ties them, it is written from that tensor."""


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    """One line for ``--help`` and the README."""
    other_side: str
    """What the non-HF names are called in messages (``torchtitan``)."""
    rows: tuple[Row, ...]
    dropped: tuple[str, ...] = ()
    """Names, on either side, of buffers that are not weights (``freqs_cis``): left out, and reported."""
    single_file: bool = False
    """The other side's own checkpoints come as one file per model-parallel rank, which is not read here."""

    @property
    def identity(self) -> bool:
        """Both sides use HF's names: the preset checks a checkpoint's names rather than changing them."""
        return all(r.other == (r.hf,) and r.transform is None for r in self.rows)

    @property
    def needs_shape(self) -> bool:
        return any(r.transform for r in self.rows)


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

    def heads(self, which: Heads) -> int | None:
        return self.n_heads if which == "n_heads" else self.n_kv_heads


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_shape(config: dict, source: str, tied: bool | None = None) -> ModelShape:
    """Head counts from an HF ``config.json`` (its ``text_config`` for a composite model) or Meta's
    ``params.json`` (fields under ``model`` in some releases). ``head_dim`` is the config's own where it
    states one (Mistral-Nemo's differs from ``hidden_size / num_attention_heads``)."""
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
    return ModelShape(head_dim, n_heads, n_kv, layers, tied, source)


def rotary_rows(n_rows: int, head_dim: int, to_hf: bool) -> tuple[int, ...]:
    """The row gather of the rotary transform (see the module docstring) for a q/k weight or bias of ``n_rows``
    rows: HF rows from interleaved ones when ``to_hf``, else the inverse."""
    half = head_dim // 2
    if to_hf:
        return tuple((r // head_dim) * head_dim + 2 * (r % head_dim % half) + r % head_dim // half
                     for r in range(n_rows))
    return tuple((s // head_dim) * head_dim + (s % head_dim % 2) * half + s % head_dim // 2 for s in range(n_rows))


TRANSFORMS = {"rotary": rotary_rows}
"""Named tensor transforms: each gives the row gather for (rows, head_dim, towards HF)."""


def _llama_rows(q: tuple[str, ...], k: tuple[str, ...], v: tuple[str, ...], head: tuple[str, ...],
                rotary: str | None, biases: bool = False) -> tuple[Row, ...]:
    """The Llama family's table; the other side's attention names (``q``, ``k``, ``v``) and output head vary."""
    layer = "model.layers.{n}."
    rows = [
        Row("model.embed_tokens.weight", ("tok_embeddings.weight",) if rotary else ("model.embed_tokens.weight",)),
        Row(layer + "self_attn.q_proj.weight", tuple(n + ".weight" for n in q), rotary, "n_heads"),
        Row(layer + "self_attn.k_proj.weight", tuple(n + ".weight" for n in k), rotary, "n_kv_heads"),
        Row(layer + "self_attn.v_proj.weight", tuple(n + ".weight" for n in v), None, "n_kv_heads"),
    ]
    if biases:
        rows += [Row(layer + "self_attn.q_proj.bias", tuple(n + ".bias" for n in q), rotary, "n_heads"),
                 Row(layer + "self_attn.k_proj.bias", tuple(n + ".bias" for n in k), rotary, "n_kv_heads"),
                 Row(layer + "self_attn.v_proj.bias", tuple(n + ".bias" for n in v), None, "n_kv_heads")]
    names = (("self_attn.o_proj", "attention.wo"), ("mlp.gate_proj", "feed_forward.w1"),
             ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"),
             ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm"))
    for hf, other in names:
        name = layer + hf + ".weight"
        rows.append(Row(name, ("layers.{n}." + other + ".weight",) if rotary else (name,)))
    rows.append(Row("model.norm.weight", ("norm.weight",) if rotary else ("model.norm.weight",)))
    rows.append(Row("lm_head.weight", head, tied_to="model.embed_tokens.weight"))
    return tuple(rows)


def _hf_names(biases: bool) -> tuple[Row, ...]:
    layer = "model.layers.{n}.self_attn."
    return _llama_rows((layer + "q_proj",), (layer + "k_proj",), (layer + "v_proj",), ("lm_head.weight",), None,
                       biases)


_TITAN, _META = "layers.{n}.attention.qkv_linear.", "layers.{n}.attention."
PRESETS = {p.name: p for p in (
    Preset("torchtitan-llama", "torchtitan's Llama 3 (0.3 names; 0.1-0.2 names read too) <-> HF Llama, with the "
           "rotary q/k row order", "torchtitan",
           _llama_rows((_TITAN + "wq", _META + "wq"), (_TITAN + "wk", _META + "wk"), (_TITAN + "wv", _META + "wv"),
                       ("lm_head.weight", "output.weight"), "rotary"),
           dropped=("freqs_cis", "model.layers.{n}.self_attn.rotary_emb.inv_freq")),
    Preset("meta-llama", "Meta's original Llama names (consolidated.00.pth, params.json; also Mistral's "
           "consolidated files and torchtitan <= 0.2) <-> HF Llama, with the rotary q/k row order", "Meta",
           _llama_rows((_META + "wq",), (_META + "wk",), (_META + "wv",), ("output.weight",), "rotary"),
           dropped=("rope.freqs", "model.layers.{n}.self_attn.rotary_emb.inv_freq"), single_file=True),
    Preset("qwen2", "HF Qwen2 names, checked: every key known, none missing (q/k/v biases included)", "Qwen2",
           _hf_names(biases=True), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),
    Preset("mistral", "HF Mistral (and Llama) names, checked: every key known, none missing", "Mistral",
           _hf_names(biases=False), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),
)}
"""The presets by name."""


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"--preset {name!r}: unknown; expected one of {', '.join(PRESETS)}") from None

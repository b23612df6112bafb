"""Quantized releases read as values: the forms a cast dequantizes, and those it refuses.

A quantized release stores some weights as codes beside the scales that give them their values. A cast
(``--dtype bf16|fp16|fp32``) writes values, so it reads each weight with its scales, as transformers'
``from_pretrained`` does, and the scales are not written:

- FP8 blocks (the block-scaled FP8 releases): a float8 ``X.weight`` with ``X.weight_scale_inv``, one scale
  per 128x128 tile, becomes the float32 product of each value and its tile's scale
  (:func:`ckptkit.core.reshape.dequantized`), what torch's ``QuantizedHuggingFaceStorageReader`` and
  transformers' FP8 dequantization compute, then the cast's dtype;
- MXFP4 (released experts): ``X_blocks`` with ``X_scales`` becomes ``X`` in bf16 and HF's layout, what transformers'
  ``convert_moe_packed_tensors`` computes (:func:`ckptkit.core.reshape.dequantized_mxfp4`, transposed).

Any other tensor of a quantized form (per-tensor FP8 ``weight_scale``, GPTQ and AWQ's packed weights,
bitsandbytes' and compressed-tensors' scales), a float8 weight without its block scale among others with theirs,
or a scale without its weight has no value ckptkit computes: a cast refuses it by name. A float8 tensor of a
checkpoint with no block scales at all is a value of its own, cast as torch casts it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.dtypes import by_name
from ..core.manifest import TensorEntry
from ..core.reshape import dequantized, dequantized_mxfp4, transposed
from ..errors import UsageError

__all__ = ["QUANTIZED", "Dequantized", "as_values_against", "both_as_values", "dequantize", "refuse_other_forms"]

QUANTIZED = re.compile(r"(_scale_inv|weight_scale|_blocks|_scales|qweight|qzeros|\.SCB|absmax|quant_map|"
                       r"weight_packed|input_scale)$")
"""Names of the tensors a quantized release holds beside (or for) its weights: FP8 block scales, MXFP4's blocks
and scales, GPTQ/AWQ's packed weights, bitsandbytes' and compressed-tensors' scales."""
SCALE_INV = "_scale_inv"
"""An FP8 weight ``X.weight``'s block scales are ``X.weight_scale_inv``."""
BLOCKS, SCALES = "_blocks", "_scales"
"""An MXFP4 weight ``X`` is ``X_blocks`` with ``X_scales``."""


@dataclass(frozen=True)
class Dequantized:
    """Tensors with their quantized weights as values, and what was done for the report."""

    tensors: tuple[TensorEntry, ...]
    fp8: int = 0
    """FP8 weights dequantized."""
    mxfp4: int = 0
    """MXFP4 weights dequantized."""
    dropped: tuple[tuple[str, str], ...] = ()
    """(scale key, why) of each scale applied and not written."""

    def notes(self) -> tuple[str, ...]:
        """What was dequantized, in words, for the report."""
        out = []
        if self.fp8:
            out.append(f"dequantized {self.fp8} FP8 weights: each float8 value times its tile's weight_scale_inv, "
                       "in float32 (torch's QuantizedHuggingFaceStorageReader and transformers compute the same), "
                       "then written in the dtype asked for; the scales are not written")
        if self.mxfp4:
            out.append(f"dequantized {self.mxfp4} MXFP4 weights (_blocks times 2^(_scales - 127), as transformers' "
                       "convert_moe_packed_tensors computes them, in HF's layout); the blocks' scales are not "
                       "written")
        return tuple(out)


def _float8(t: TensorEntry) -> bool:
    return t.dtype.name.startswith("float8")


def dequantize(tensors: Sequence[TensorEntry], option: str) -> Dequantized:
    """``tensors`` with each FP8 and MXFP4 weight read as values with its scales, the scales left out.

    Args:
        tensors: A model's tensors under HF names.
        option: The option that asked for values (``--dtype bf16``), for messages.

    Returns:
        The tensors (FP8 weights as float32, MXFP4 ones as bf16, both computed tile by tile), and counts.

    Raises:
        UsageError: a tensor of a quantized form this module does not read (module docstring), naming it.
    """
    by_key = {t.key: t for t in tensors}
    release = any(_float8(t) and t.key + SCALE_INV in by_key for t in tensors)
    out: list[TensorEntry] = []
    dropped: list[tuple[str, str]] = []
    fp8 = mxfp4 = 0
    for t in tensors:
        key = t.key
        scaled = _scaled(key, by_key)
        if scaled is not None:
            dropped.append((key, f"the scales of {'its weight' if key.endswith(SCALE_INV) else 'its blocks'}, "
                                 "applied to them"))
        elif _float8(t) and key + SCALE_INV in by_key:
            out.append(dequantized(t, by_key[key + SCALE_INV], key, by_name("float32")))
            fp8 += 1
        elif _float8(t) and release:
            raise UsageError(f"{option}: {key!r} is {t.dtype} without {key + SCALE_INV!r} beside it, in a release "
                             "whose other float8 weights have theirs: its bytes are codes of a scale ckptkit does not "
                             "have; --dtype keep copies it as it is")
        elif key.endswith(BLOCKS) and key.removesuffix(BLOCKS) + SCALES in by_key:
            name = key.removesuffix(BLOCKS)
            values = dequantized_mxfp4(t, by_key[name + SCALES], name, by_name("bfloat16"))
            out.append(transposed(values, name))
            mxfp4 += 1
        elif QUANTIZED.search(key):
            raise UsageError(_other_form(option, t))
        else:
            out.append(t)
    return Dequantized(tuple(out), fp8, mxfp4, tuple(dropped))


def _scaled(key: str, by_key: dict[str, TensorEntry]) -> str | None:
    """The key of the weight whose FP8 or MXFP4 scales ``key`` holds, or None."""
    weight = by_key.get(key.removesuffix(SCALE_INV)) if key.endswith(SCALE_INV) else None
    if weight is not None and _float8(weight):
        return weight.key
    blocks = key.removesuffix(SCALES) + BLOCKS
    return blocks if key.endswith(SCALES) and blocks in by_key else None


def _other_form(option: str, t: TensorEntry) -> str:
    return (f"{option}: {t.key!r} ({t.dtype}, {list(t.shape)}) belongs to a quantized form ckptkit does not read "
            f"as values (it dequantizes FP8 weights with their weight{SCALE_INV} and MXFP4 {BLOCKS[1:]} with their "
            f"{SCALES[1:]}); --dtype keep copies it as it is")


def refuse_other_forms(tensors: Sequence[TensorEntry], option: str) -> frozenset[str]:
    """The keys of ``tensors``' FP8 weights and their block scales, which a quantization keeps as they are.

    Raises:
        UsageError: a tensor of any other quantized form (MXFP4 included), or an FP8 weight or scale alone,
            naming it: ``option`` would write it beside weights of another form.
    """
    by_key = {t.key: t for t in tensors}
    kept: set[str] = set()
    for t in tensors:
        if _float8(t) and t.key + SCALE_INV in by_key:
            kept.update((t.key, t.key + SCALE_INV))
    for t in tensors:
        if t.key not in kept and (_float8(t) or QUANTIZED.search(t.key)):
            raise UsageError(f"{option}: {t.key!r} ({t.dtype}, {list(t.shape)}) is already quantized, not as FP8 "
                             "weights with their weight_scale_inv; --dtype bf16 writes its values, --dtype keep "
                             "copies it as it is")
    return frozenset(kept)


_COMPUTED_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes a dequantization computes into."""


def as_values_against(side: dict[str, TensorEntry], other: dict[str, TensorEntry],
                      numeric: bool) -> tuple[dict[str, TensorEntry], int]:
    """``side`` (tensors by the names compared) with each FP8 or MXFP4 weight that ``other`` holds as values
    (the same name, a floating tensor, no scales beside it) read as values, its scales left out.

    Args:
        side: One checkpoint's tensors.
        other: The checkpoint it is compared with.
        numeric: Compared by value: FP8 weights as their float32 products, MXFP4 ones in bf16 (transformers'
            dtype); else in ``other``'s dtype, what a dequantizing cast writes, for a bit-for-bit compare.

    Returns:
        The tensors, and how many weights were read as values.
    """
    out, n = dict(side), 0
    for key, t in side.items():
        mxfp4 = key.endswith(BLOCKS)
        name = key.removesuffix(BLOCKS) if mxfp4 else key
        scale_key = name + SCALES if mxfp4 else key + SCALE_INV
        scale, target = side.get(scale_key), other.get(name)
        if (scale is None or target is None or not (mxfp4 or _float8(t)) or not target.dtype.is_floating
                or _float8(target) or scale_key in other):
            continue
        wanted = target.dtype if target.dtype.name in _COMPUTED_DTYPES and not numeric else None
        if mxfp4:
            out[name] = transposed(dequantized_mxfp4(t, scale, name, wanted or by_name("bfloat16")), name)
            del out[key]
        else:
            out[key] = dequantized(t, scale, key, wanted or by_name("float32"))
        del out[scale_key]
        n += 1
    return out, n


def both_as_values(ta: dict[str, TensorEntry], tb: dict[str, TensorEntry], names: tuple[str, str], numeric: bool
                   ) -> tuple[tuple[dict[str, TensorEntry], dict[str, TensorEntry]], tuple[str, ...]]:
    """Two compared checkpoints' tensors, each with the quantized weights the other holds as values read as values
    (:func:`as_values_against`), and notes saying so.

    Args:
        ta: One side's tensors by the names compared.
        tb: The other side's.
        names: The two sides' names, for the notes.
        numeric: Compared by value (see :func:`as_values_against`).

    Returns:
        Both sides' tensors, and one note per side that had weights read as values.
    """
    qa, na = as_values_against(ta, tb, numeric)
    qb, nb = as_values_against(tb, ta, numeric)
    how = ("FP8 ones as their float32 products, MXFP4 ones in bf16" if numeric else
           "in the other side's dtype, as a dequantizing cast writes them")
    notes = tuple(f"{n} quantized weights of {name} (FP8, MXFP4) compared as values, each with its scales, {how}; "
                  "the scales themselves are not compared" for n, name in ((na, names[0]), (nb, names[1])) if n)
    return (qa, qb), notes

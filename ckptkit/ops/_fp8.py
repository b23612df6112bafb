"""``export-hf --dtype fp8``: a model written back in the block-scaled FP8 form of FP8 releases.

Each linear layer's weight (a 2-D ``*_proj.weight``: attention and MLP projections, routed and shared experts)
becomes float8 e4m3 with a float32 ``weight_scale_inv`` per 128x128 tile, that tile's largest magnitude / 448;
every other floating tensor (embedding, norms, router, head) is written in bf16, as the release keeps them.
``config.json`` gets the ``quantization_config`` that transformers and torch's
``QuantizedHuggingFaceStorageReader`` read. The values and scales are computed tile by tile
(:mod:`ckptkit.io.compute`), within the memory setting.
"""

from __future__ import annotations

import re

from ..core.dtypes import by_name
from ..core.manifest import TensorEntry
from ..core.reshape import quantized_fp8
from ..errors import UsageError
from ..models.quantized import refuse_other_forms

__all__ = ["BLOCK", "QUANTIZED", "QUANTIZATION_CONFIG", "fp8_config", "quantize_fp8"]

BLOCK = 128
QUANTIZED = re.compile(r"_proj(_with_mqa)?\.weight$")
"""HF names of the linear layers' weights that the release quantizes."""
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}


def quantize_fp8(tensors: tuple[TensorEntry, ...]) -> tuple[tuple[TensorEntry, ...], frozenset[str], str]:
    """``tensors`` with each linear weight replaced by its float8 values and tile scales.

    Args:
        tensors: The model's tensors under HF names.

    Returns:
        The tensors to write, the keys of the float8 values and their scales (written as they are, whatever the
        cast), and a note for the report.

    Raises:
        UsageError: no tensor is a linear layer's weight.
    """
    out: list[TensorEntry] = []
    kept = refuse_other_forms(tensors, "--dtype fp8")
    _check_release_form([t for t in tensors if t.key in kept])
    exact: set[str] = set()
    float8, float32 = by_name("float8_e4m3fn"), by_name("float32")
    for t in tensors:
        if t.key not in kept and len(t.shape) == 2 and t.dtype.is_floating and QUANTIZED.search(t.key):
            values, scale = quantized_fp8(t, t.key, float8, float32, BLOCK)
            out += [values, scale]
            exact.update((values.key, scale.key))
        else:
            out.append(t)
    if not exact and not kept:
        raise UsageError("--dtype fp8: no tensor is a linear layer's weight (HF names ending in _proj.weight); "
                         "nothing to quantize")
    note = (f"quantized {len(exact) // 2} linear weights to float8_e4m3fn with {BLOCK}x{BLOCK} block scales "
            "(weight_scale_inv, float32); other floating tensors written in bfloat16")
    if kept:
        note += f"; {len(kept) // 2} weights already FP8 written as they are, with their block scales"
    return tuple(out), frozenset(exact | kept), note


def _check_release_form(pairs: list[TensorEntry]) -> None:
    """Refuse FP8 weights and scales already in the source unless they are in the form :data:`QUANTIZATION_CONFIG`
    names: float8_e4m3fn values, float32 scales of 128x128 tiles."""
    by_key = {t.key: t for t in pairs}
    for t in pairs:
        if t.key.endswith("_scale_inv"):
            continue
        scale = by_key[t.key + "_scale_inv"]
        grid = [-(-n // BLOCK) for n in t.shape]
        if t.dtype.name != "float8_e4m3fn" or scale.dtype.name != "float32" or list(scale.shape) != grid:
            raise UsageError(f"--dtype fp8: {t.key!r} is already FP8 ({t.dtype} {list(t.shape)}, scales "
                             f"{scale.dtype} {list(scale.shape)}), not in the form it writes (float8_e4m3fn, float32 "
                             f"scales of {BLOCK}x{BLOCK} tiles: {grid}); --dtype bf16 writes its values")


def fp8_config(config: dict | None, has_file: bool) -> dict:
    """``config`` naming the FP8 quantization (``quantization_config``).

    Args:
        config: ``config.json`` as it will be written, or None.
        has_file: whether the export writes a ``config.json``.

    Returns:
        The config with ``quantization_config``.

    Raises:
        UsageError: there is no ``config.json`` to name the quantization in.
    """
    if config is None or not has_file:
        raise UsageError("--dtype fp8 names the quantization in config.json's quantization_config: pass "
                         "--hf-assets DIR with the model's config.json")
    return {**config, "quantization_config": QUANTIZATION_CONFIG}

"""Float8 block (de)quantization in numpy (:mod:`.floats` converts, bit for bit as torch does).

A dequantized element is its float8 value times its tile's scale, both float32, cast to the output dtype; as
every element of a tile shares the scale, each tile's 256 possible results are computed once and the output
is gathered from that table, which is what makes dequantization cheap. A quantized tile is the weight in
float32 divided by the tile's largest magnitude / 448, cast to e4m3fn.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..core.reshape import FP8_MAX
from .floats import decode_table, e4m3_into, encode, to_float32

__all__ = ["dequantize", "quantize", "tile_scales"]


def dequantize(weight: np.ndarray, scales: np.ndarray, first: tuple[int, int], block: int, fmt: str,
               dtype: str) -> np.ndarray:
    """A box of a block-quantized weight, dequantized: each element's float8 value times its tile's scale.

    Args:
        weight: the box's float8 bytes, ``[rows, cols]`` uint8.
        scales: float32 scales of the tiles the box meets, ``[tile rows, tile cols]``, the first of them the
            tile holding the box's first element.
        first: the box's first element's row and column in the weight.
        block: the tiles' edge.
        fmt: the weight's float8 format (one of :data:`DECODES`).
        dtype: the output dtype (one of :data:`ENCODES`).

    Returns:
        The box in ``dtype``, as :data:`ENCODES` holds it.
    """
    (r0, c0), (rows, cols) = first, weight.shape
    products = np.ascontiguousarray(scales.reshape(-1, 1) * decode_table(fmt))  # float32, rounded once
    results = encode(products, dtype).reshape(*scales.shape, 256)
    out = np.empty(weight.shape, results.dtype)
    row_cuts, col_cuts = _cuts(r0, rows, block), _cuts(c0, cols, block)
    for i, (top, bottom) in enumerate(row_cuts):
        for j, (left, right) in enumerate(col_cuts):  # one gather a tile, by the codes themselves
            results[i, j].take(weight[top:bottom, left:right], out=out[top:bottom, left:right], mode="clip")
    return out


def _cuts(start: int, n: int, block: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, n)`` that fall in one tile each, for a box starting at ``start``."""
    edges = [0, *range(block - start % block, n, block), n]
    return [(a, b) for a, b in itertools.pairwise(edges) if a < b]


_CHUNK = 1024
"""Columns of a band computed at once: numpy's temporaries of a 128-row band stay in the CPU's cache (several
times faster than a whole band's, which stream through memory once per operation)."""
_MAGNITUDE = {"bfloat16": (np.uint16, 0x7FFF), "float16": (np.uint16, 0x7FFF), "float32": (np.uint32, 0x7FFFFFFF)}
"""For dtypes whose bits, sign cleared, order as their magnitudes do (NaN above infinity): the integer view and
the mask."""


def _column_maxima(bits: np.ndarray, name: str) -> np.ndarray:
    """The largest magnitude in each column of ``bits`` (dtype ``name`` as :data:`ENCODES` holds it), as
    float32; NaN where a column holds one."""
    if name not in _MAGNITUDE:
        return np.abs(to_float32(bits, name)).max(axis=0)
    view, mask = _MAGNITUDE[name]
    widest = np.bitwise_and(bits.view(view), view(mask)).max(axis=0)
    return to_float32(widest.view(bits.dtype), name)


def tile_scales(bits: np.ndarray, name: str, block: int) -> np.ndarray:
    """The scale of each ``block``-wide tile of a band of at most ``block`` rows (whole tiles of columns but for
    the weight's last) of dtype ``name`` (as :data:`ENCODES` holds it): its largest magnitude / 448, in float32,
    NaN where a tile holds one."""
    rows, cols = bits.shape
    padded = np.zeros(-(-cols // block) * block, np.float32)
    for c in range(0, cols, _CHUNK) if rows else ():
        padded[c:min(c + _CHUNK, cols)] = _column_maxima(bits[:, c:c + _CHUNK], name)
    return padded.reshape(-1, block).max(axis=1) / np.float32(FP8_MAX)


def quantize(bits: np.ndarray, name: str, scales: np.ndarray, block: int, out: np.ndarray | None = None
             ) -> np.ndarray:
    """A band (columns from a tile's first) of dtype ``name`` (as :data:`ENCODES` holds it) in float32, divided
    by its tiles' ``scales`` (an all-zero tile's scale is 0, and it is divided by 1) and cast to float8 e4m3fn as
    torch casts: its bytes, ``bits``' shape, into ``out`` where given.

    A few rows at a time (about :data:`_ELEMENTS`), through two buffers made once: a fresh array a pass costs
    more than the pass."""
    rows, cols = bits.shape
    divisors = np.repeat(np.where(scales > 0, scales, np.float32(1)), block)[:cols]
    out = np.empty(bits.shape, np.uint8) if out is None else out
    step = max(1, _ELEMENTS // max(cols, 1))
    size = min(rows, step) * cols
    work, keys = np.empty(size, np.uint32), np.empty(size, np.uint32)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN, and infinities over infinite scales, stay NaN
        for r in range(0, rows, step):
            chunk = bits[r:r + step]
            values, key = work[:chunk.size].reshape(chunk.shape), keys[:chunk.size].reshape(chunk.shape)
            _widen(chunk, name, values)
            wide = values.view(np.float32)
            np.divide(wide, divisors, out=wide)
            e4m3_into(values, key, out[r:r + step])
    return out


def _widen(bits: np.ndarray, name: str, into: np.ndarray) -> None:
    """``bits`` (dtype ``name`` as :data:`ENCODES` holds it) as float32 bits in ``into``, as torch widens."""
    if name == "bfloat16":
        np.left_shift(bits, 16, out=into, dtype=np.uint32)
    elif name == "float32":
        np.copyto(into, bits.view(np.uint32))
    else:
        np.copyto(into.view(np.float32), bits, casting="same_kind")


_ELEMENTS = 1 << 16
"""Elements quantized at once: the buffers (a few times this in bytes) stay in the CPU's cache."""

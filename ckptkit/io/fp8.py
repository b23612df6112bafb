"""Float8 block (de)quantization in numpy (:mod:`.floats` converts, bit for bit as torch does).

A dequantized element is its float8 value times its tile's scale, both float32, cast to the output dtype; as
every element of a tile shares the scale, each tile's 256 possible results are computed once and the output
is gathered from that table, which is what makes dequantization cheap. A quantized tile is the weight in
float32 divided by the tile's largest magnitude / 448, cast to e4m3fn.
"""

from __future__ import annotations

import numpy as np

from ..core.reshape import FP8_MAX
from .floats import decode_table, e4m3, encode, to_float32

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
    results = encode(np.ascontiguousarray(scales.reshape(-1, 1) * decode_table(fmt)), dtype).reshape(-1)
    tile_rows = ((np.arange(r0, r0 + rows) // block - r0 // block) * scales.shape[1] * 256).astype(np.uint32)
    tile_cols = ((np.arange(c0, c0 + cols) // block - c0 // block) * 256).astype(np.uint32)
    out = np.empty(weight.shape, results.dtype)
    step = max(1, _CHUNK * _CHUNK // 8 // max(cols, 1))  # rows a pass: about 128K elements, held in cache
    for r in range(0, rows, step):
        index = np.add(weight[r:r + step], tile_cols, dtype=np.uint32)
        index += tile_rows[r:r + step, None]
        results.take(index, out=out[r:r + step])
    return out


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


def quantize(bits: np.ndarray, name: str, scales: np.ndarray, block: int) -> np.ndarray:
    """A band (columns from a tile's first) of dtype ``name`` (as :data:`ENCODES` holds it) in float32, divided
    by its tiles' ``scales`` (an all-zero tile's scale is 0, and it is divided by 1) and cast to float8 e4m3fn as
    torch casts: its bytes, ``bits``' shape."""
    divisors = np.repeat(np.where(scales > 0, scales, np.float32(1)), block)
    out = np.empty(bits.shape, np.uint8)
    with np.errstate(invalid="ignore"):  # NaN, and infinities divided by infinite scales, stay NaN
        for c in range(0, bits.shape[1], _CHUNK):
            chunk = bits[:, c:c + _CHUNK]
            out[:, c:c + _CHUNK] = e4m3(to_float32(chunk, name) / divisors[c:c + chunk.shape[1]])
    return out



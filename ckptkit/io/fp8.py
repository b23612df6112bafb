"""Float8 block (de)quantization in numpy, giving the bits torch's own casts give.

A dequantization or an FP8 export computes in numpy rather than torch: importing torch costs about 225 MB and
one to three seconds, more than the arithmetic of a large model, and numpy's vector loops are as fast here.
numpy has no bfloat16 or float8 types, so those travel as their bit patterns (uint16, uint8) and are converted
the way torch converts them:

- a float8 byte to float32 through a table of its 256 values (float8 formats are all exact in float32);
- float32 to bfloat16 by rounding to nearest even, a NaN becoming ``0xFFFF`` (torch's vectorized CPU cast; its
  scalar loop, which casts the few elements past the last full vector, writes ``0x7FC0``);
- float32 to float8 e4m3fn as torch's CPU cast does: to nearest even, magnitudes under 2^-6 as subnormals,
  those beyond 448 (infinities too) saturated to 448, a NaN to ``0x7F`` with its sign.

A dequantized element is its float8 value times its tile's scale, both float32, cast to the output dtype; as
every element of a tile shares the scale, each tile's 256 possible results are computed once and the output
is gathered from that table, which is what makes dequantization cheap.
"""

from __future__ import annotations

import numpy as np

from ..core.reshape import FP8_MAX

__all__ = ["DECODES", "ENCODES", "decode_table", "dequantize", "encode", "quantize", "tile_scales", "to_float32"]

_BITS = {"float64": np.float64, "float32": np.uint32, "float16": np.float16, "bfloat16": np.uint16}
"""How each dtype a (de)quantization reads or writes is held in numpy: as itself, or as its bits."""
DECODES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
"""The float8 formats :func:`decode_table` knows."""
ENCODES = tuple(_BITS)
"""The dtypes :func:`encode` writes and :func:`to_float32` reads."""

_FORMATS = {  # exponent bits, mantissa bits, bias, NaN codes (of the 7 or 8 magnitude bits), signed zero
    "float8_e4m3fn": (4, 3, 7, (0x7F,), True),
    "float8_e5m2": (5, 2, 15, (), True),
    "float8_e4m3fnuz": (4, 3, 8, (), False),
    "float8_e5m2fnuz": (5, 2, 16, (), False),
}


def decode_table(name: str) -> np.ndarray:
    """The float32 value of each of the 256 bytes of float8 format ``name`` (one of :data:`DECODES`).

    Raises:
        KeyError: ``name`` is not one of :data:`DECODES`.
    """
    if name == "float8_e8m0fnu":  # an exponent alone: 2^(b - 127), 0xFF NaN
        return np.append(np.ldexp(np.float32(1), np.arange(255) - 127), np.nan).astype(np.float32)
    e_bits, m_bits, bias, nans, signed_zero = _FORMATS[name]
    codes = np.arange(128)
    exponent, mantissa = codes >> m_bits, codes & ((1 << m_bits) - 1)
    fraction = mantissa / (1 << m_bits)
    magnitude = np.where(exponent == 0, np.ldexp(fraction, 1 - bias), np.ldexp(1 + fraction, exponent - bias))
    if e_bits == 5 and signed_zero:  # e5m2 keeps IEEE's infinities and NaNs
        magnitude[exponent == 31] = np.where(mantissa[exponent == 31] == 0, np.inf, np.nan)
    magnitude[list(nans)] = np.nan
    table = np.concatenate([magnitude, -magnitude]).astype(np.float32)
    if not signed_zero:  # the fnuz formats spend -0 on their one NaN
        table[128] = np.nan
    return table


def to_float32(data: np.ndarray, name: str) -> np.ndarray:
    """``data`` (as :data:`ENCODES` holds dtype ``name``) as float32: exact, but for float64's rounding."""
    if name == "bfloat16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    if name == "float32":
        return data.view(np.float32)
    return data.astype(np.float32)


def encode(values: np.ndarray, name: str) -> np.ndarray:
    """float32 ``values`` as dtype ``name`` (one of :data:`ENCODES`), rounded to nearest even as torch rounds."""
    if name == "bfloat16":
        bits = values.view(np.uint32)
        rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
        return np.where(np.isnan(values), np.uint16(0xFFFF), rounded.astype(np.uint16))
    if name == "float32":
        return values.view(np.uint32)
    with np.errstate(over="ignore"):  # beyond float16's range is its infinity, as in torch
        return values.astype(_BITS[name])


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
            out[:, c:c + _CHUNK] = _e4m3(to_float32(chunk, name) / divisors[c:c + chunk.shape[1]])
    return out


def _e4m3(values: np.ndarray) -> np.ndarray:
    """float32 ``values`` (a fresh array, overwritten) as float8 e4m3fn bytes, looked up in :data:`_E4M3` by
    their sign, exponent, three mantissa bits, the next bit and whether any bit below it is set: all that
    rounding to nearest even decides by, in a few integer passes."""
    bits = values.view(np.uint32)
    key = bits >> 19
    key <<= 1
    bits &= np.uint32(0x7FFFF)
    bits += np.uint32(0x7FFFF)
    bits >>= 19
    key |= bits
    return _E4M3.take(key)


def _e4m3_rounded(values: np.ndarray) -> np.ndarray:
    """float32 ``values`` (a fresh array, overwritten) as float8 e4m3fn bytes, rounded as torch rounds."""
    nan = np.isnan(values)
    bits = values.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    np.copyto(values, 0, where=nan)  # (its bits would warn in the float additions below)
    bits &= np.uint32(0x7FFFFFFF)
    magnitude = bits.view(np.float32)
    small = magnitude < np.float32(2.0 ** -6)  # e4m3's subnormals: rounded in float32 at 2^14's unit, 2^-9
    subnormal = ((magnitude + np.float32(2.0 ** 14)).view(np.uint32) - np.uint32(141 << 23))
    bits += np.uint32((0x7FFFF - (120 << 23)) & 0xFFFFFFFF) + ((bits >> 20) & 1)
    bits >>= 20
    normal = np.minimum(bits, np.uint32(0x7E))  # from 464 up (rounding past 448), and inf: 448
    out = np.where(small, subnormal, normal).astype(np.uint8)
    out[nan] = 0x7F
    out |= sign
    return out


_KEYS = np.arange(1 << 14, dtype=np.uint32)
_E4M3 = _e4m3_rounded((((_KEYS >> 1) << 19) | (_KEYS & 1)).view(np.float32))
"""The e4m3fn byte of each float32 by sign, exponent, the first four mantissa bits and whether any later bit is
set (bit 0 standing for them all)."""

"""Floating-point conversions in numpy, giving the bits torch's own CPU casts give.

Casting between floating dtypes and (de)quantizing compute in numpy rather than torch: importing torch costs
about 225 MB and one to three seconds, more than the arithmetic of a large model, and numpy's vector loops are
as fast here. numpy has no bfloat16 or float8 types, so those travel as their bit patterns (uint16, uint8), and
every conversion goes through float32 as torch's do:

- a float8 byte to float32 through a table of its 256 values (float8 formats are all exact in float32);
- float32 to bfloat16 by rounding to nearest even, a NaN becoming ``0xFFFF`` (as torch's CPU cast writes it);
- float32 to float8 e4m3fn as torch's CPU cast does: to nearest even, magnitudes under 2^-6 as subnormals,
  those beyond 448 (infinities too) saturated to 448, a NaN to ``0x7F`` with its sign;
- float16 and float64 as numpy casts them, but NaNs into float16 as x86's conversion (torch's) makes them, and
  float64 to float16 through float32 as torch does. (A float16 NaN widened keeps its payload; torch's own
  widening writes it one way or another depending on where the element falls in its vector loop.)
"""

from __future__ import annotations

try:
    import numpy as np
except ModuleNotFoundError as e:  # installed without its dependencies, into an environment that lacks it
    raise ModuleNotFoundError("casts and (de)quantization compute with numpy, a dependency of ckptkit that is not "
                              "installed here: pip install numpy", name="numpy") from e

__all__ = ["DECODES", "ENCODES", "convert", "decode_table", "e4m3_into", "encode", "held", "to_float32"]

_BITS = {"float64": np.float64, "float32": np.uint32, "float16": np.float16, "bfloat16": np.uint16}
"""How each dtype a conversion reads or writes is held in numpy: as itself, or as its bits."""
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


def held(data: bytearray | memoryview, name: str) -> np.ndarray:
    """The bytes of a flat array of dtype ``name`` (one of :data:`ENCODES`) as numpy holds it, not copied."""
    return np.frombuffer(data, dtype=_BITS[name])


def to_float32(data: np.ndarray, name: str) -> np.ndarray:
    """``data`` (as :data:`ENCODES` holds dtype ``name``) as float32: exact, but for float64's rounding."""
    if name == "bfloat16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    if name == "float32":
        return data.view(np.float32)
    with np.errstate(over="ignore"):  # float64 beyond float32's range is its infinity, as in torch
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
        out = values.astype(_BITS[name])
    nan = np.isnan(values) if name == "float16" else None
    if nan is not None and nan.any():  # x86's conversion, which torch's is: quiet, the payload's top bits kept
        bits = values.view(np.uint32)[nan]
        out.view(np.uint16)[nan] = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)
    return out


_STEP = 1 << 16
"""Elements converted at once: numpy's temporaries (several times the elements' size) stay in the CPU's cache,
and within a few MB whatever the size of the block being cast."""


def convert(data: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``data`` (dtype ``src`` as :data:`ENCODES` holds it) as dtype ``dst``, through float32 unless both are
    float32 or wider."""
    if {src, dst} <= {"float32", "float64"}:
        real = {"float32": np.float32, "float64": np.float64}
        with np.errstate(over="ignore"):  # beyond float32's range is its infinity, as in torch
            return data.view(real[src]).astype(real[dst]).view(_BITS[dst])
    out = np.empty(data.shape, _BITS[dst])
    flat, into = data.reshape(-1), out.reshape(-1)
    for i in range(0, flat.size, _STEP):
        into[i:i + _STEP] = encode(to_float32(flat[i:i + _STEP], src), dst)
    return out


def e4m3_into(bits: np.ndarray, key: np.ndarray, out: np.ndarray) -> None:
    """float32 values, as their ``bits`` (uint32, overwritten), as float8 e4m3fn bytes in ``out``, looked up in
    :data:`_E4M3` by their sign, exponent, four mantissa bits and whether any bit below them is set: all that
    rounding to nearest even decides by, in four integer passes into ``key`` (a uint32 buffer of their shape)
    and one gather."""
    np.right_shift(bits, 18, out=key)  # sign, exponent, 5 mantissa bits (the fifth ORed with those below)
    np.left_shift(bits, 14, out=bits)  # the 18 bits below them
    ones = _ONES[:bits.size] if bits.size <= _ONES.size else np.ones(bits.size, np.uint32)
    np.minimum(bits, ones.reshape(bits.shape), out=bits)  # any of them set (against an array: numpy's fast loop)
    np.bitwise_or(key, bits, out=key)
    _E4M3.take(key, out=out, mode="clip")


_ONES = np.ones(1 << 16, np.uint32)


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

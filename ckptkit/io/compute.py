"""The bytes of a box of a computed tensor (:class:`~ckptkit.core.manifest.Derived`): a transpose, an FP8
dequantization. Each box is computed from the matching boxes of its inputs alone, so the executor computes a
tensor one row block at a time, within its memory setting, and never holds the model.

- ``transpose``: box ``(o, s)`` of the output is the transpose of the input's box with the last two dims of
  ``o`` and ``s`` swapped (the input's columns, read as strided rows);
- ``dequant_fp8``: the weight's box in float32 times each element's block scale (the scale rows and columns
  of the blocks the box meets, repeated ``block`` times and cropped), then cast: what torch's
  ``QuantizedHuggingFaceStorageReader._dequantize_tensor`` computes block by block;
- ``dequant_mxfp4``: the blocks and scales of the groups the box's last dim meets, each nibble looked up in
  the FP4 table in the output dtype and scaled by ``ldexp``, as transformers' ``convert_moe_packed_tensors``
  does, then cropped to the box;
- ``quant_fp8`` and ``fp8_scale``: the rows of whole 128x128 tiles the box meets, in float32, each tile's
  largest magnitude / 448 (the scale) and the weight divided by it (the float8 values), cropped to the box;
- ``interleave``: for the box's columns, the columns of both halves of the input they come from, taken in
  turn and cropped; ``deinterleave``: for the part of the box in each half, the input's columns from its first
  to its last (twice as many), every other one;
- ``zeros``: zeros of the box's size, read from nothing;
- ``rows`` and ``stack``: the rows of several inputs, one after another.

All but the MXFP4 dequantization compute in numpy (:mod:`.floats`, :mod:`.fp8`), giving the bits torch gives:
importing torch costs more memory and time than the work. transformers' MXFP4 dequantization computes in the
output dtype (bfloat16), and is followed in torch.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

from ..core.manifest import Derived, TensorEntry
from ..core.plan import Region
from ..errors import FormatError

Read = Callable[[Region], "bytearray | memoryview"]
"""The row-major bytes of a region of a stored tensor (:func:`ckptkit.io.sources.read_region` over open files)."""

__all__ = ["COMPUTE_MEMORY", "WORKING_BYTES", "block_budget", "compute_region", "tensor_bytes", "working_bytes"]

WORKING_BYTES = 12
"""Bytes per output element alive while a box is computed, beyond the output's own: the input's, a float32
copy, the product. The executor sizes its blocks by it."""


def tensor_bytes(t: Any) -> memoryview:
    """The bytes of contiguous CPU tensor ``t``, without a copy, and without numpy (which the CPU torch wheel
    does not bring): a ctypes view of its memory that holds ``t`` alive as long as the view is."""
    n = t.numel() * t.element_size()
    if not n:
        return memoryview(b"")
    view = (ctypes.c_char * n).from_address(t.data_ptr())
    view.owner = t  # the memory is t's: freeing t would free it under the view
    return memoryview(view).cast("B")


def _tensor(region: Region, read: Read) -> Any:
    import torch

    data = read(region)
    dtype = getattr(torch, region.entry.dtype.name)
    flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return flat.view(region.sizes)


def compute_region(region: Region, read: Read) -> memoryview:
    """The row-major bytes of ``region`` of a computed entry, in the entry's dtype (``region.cast`` is not
    applied here); ``read`` reads its inputs' regions."""
    derived = region.entry.derived
    assert derived is not None
    if derived.op == "dequant_mxfp4":
        return tensor_bytes(_mxfp4(region, derived, read))
    if derived.op == "transpose":
        box = _swap(region.offsets), _swap(region.sizes)
        array = _elements(Region(derived.inputs[0], *box), read).swapaxes(-1, -2)
    elif derived.op in ("rows", "stack"):
        array = _rows(region, derived, read)
    elif derived.op == "interleave":
        array = _interleave(region, derived.inputs[0], read)
    elif derived.op == "deinterleave":
        array = _deinterleave(region, derived.inputs[0], read)
    elif derived.op == "zeros":
        import numpy as np

        array = np.zeros(region.sizes, _opaque(region.entry.dtype.itemsize))
    elif derived.op == "dequant_fp8":
        array = _dequantized(region, derived, read)
    elif derived.op in ("quant_fp8", "fp8_scale"):
        array = _fp8(region, derived, read)
    else:
        raise FormatError(f"{region.entry.key!r}: no computation {derived.op!r}")
    return _bytes(array)


def _opaque(itemsize: int) -> Any:
    """A numpy dtype of ``itemsize`` bytes for elements only moved, never computed with."""
    import numpy as np

    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(itemsize) or np.dtype(f"V{itemsize}")


def _elements(region: Region, read: Read) -> Any:
    """The region's elements as opaque numpy values of its shape (for moving, not computing)."""
    import numpy as np

    return np.frombuffer(read(region), _opaque(region.entry.dtype.itemsize)).reshape(region.sizes)


def _bytes(array: Any) -> memoryview:
    """The row-major bytes of numpy ``array`` (copied only where it is a strided view)."""
    import numpy as np

    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data if array.size else memoryview(b"")


def _rows(region: Region, derived: Derived, read: Read) -> Any:
    """Rows of the region from each input that holds some: a ``rows`` entry's ranges, or a ``stack``'s
    inputs, one row (of the output) each."""
    import numpy as np

    ranges = derived.ranges or tuple((i, 0, 1) for i in range(len(derived.inputs)))
    first, end = region.offsets[0], region.offsets[0] + region.sizes[0]
    parts, row = [], 0
    for i, a, b in ranges:
        top, bottom = max(first, row), min(end, row + b - a)
        if top < bottom:
            source = derived.inputs[i]
            if derived.op == "stack":
                box = Region(source, region.offsets[1:], region.sizes[1:])
                parts.append(_elements(box, read)[None])
            else:
                box = Region(source, (a + top - row, *region.offsets[1:]), (bottom - top, *region.sizes[1:]))
                parts.append(_elements(box, read))
        row += b - a
    return np.concatenate(parts) if parts else np.zeros(region.sizes, _opaque(region.entry.dtype.itemsize))


def _columns(source: Any, region: Region, start: int, stop: int, read: Read) -> Any:
    """Columns ``[start, stop)`` of ``source`` over the rest of ``region``'s box."""
    box = Region(source, (*region.offsets[:-1], start), (*region.sizes[:-1], stop - start))
    return _elements(box, read)


def _interleave(region: Region, source: Any, read: Read) -> Any:
    """Output column ``c`` is column ``(c % 2) * half + c // 2`` of the input."""
    import numpy as np

    half, c0, n = source.shape[-1] // 2, region.offsets[-1], region.sizes[-1]
    if n == 0:
        return np.zeros(region.sizes, _opaque(region.entry.dtype.itemsize))
    i0, i1 = c0 // 2, (c0 + n - 1) // 2 + 1
    pairs = np.stack([_columns(source, region, i0, i1, read),
                      _columns(source, region, half + i0, half + i1, read)], -1)
    return pairs.reshape(*pairs.shape[:-2], -1)[..., c0 - 2 * i0:c0 - 2 * i0 + n]


def _deinterleave(region: Region, source: Any, read: Read) -> Any:
    """Output column ``t * half + i`` is column ``2i + t`` of the input."""
    import numpy as np

    half, c0, n = source.shape[-1] // 2, region.offsets[-1], region.sizes[-1]
    parts = [np.zeros((*region.sizes[:-1], 0), _opaque(region.entry.dtype.itemsize))]
    for t in (0, 1):
        a, b = max(c0, t * half) - t * half, min(c0 + n, (t + 1) * half) - t * half
        if a < b:
            parts.append(_columns(source, region, 2 * a, 2 * b, read)[..., t::2])
    return np.concatenate(parts, -1)


def _swap(t: tuple[int, ...]) -> tuple[int, ...]:
    return (*t[:-2], t[-1], t[-2])


def _array(region: Region, read: Read) -> Any:
    """The region's bytes as a numpy array of its shape, as :mod:`.floats` holds its dtype (float8 as bytes)."""
    from .floats import ENCODES, held

    name = region.entry.dtype.name
    if name in ENCODES:
        return held(read(region), name).reshape(region.sizes)
    if name == "uint8" or name.startswith("float8"):
        return _elements(region, read)
    raise FormatError(f"{region.entry.key!r}: {name} is not a dtype FP8 (de)quantization reads "
                      f"({', '.join(ENCODES)}, float8)")


def _dequantized(region: Region, derived: Derived, read: Read) -> Any:
    from .floats import DECODES, ENCODES
    from .fp8 import dequantize

    weight, scale = derived.inputs
    b = derived.block
    (r0, c0), (rows, cols) = region.offsets, region.sizes
    out = region.entry.dtype.name
    if weight.dtype.name not in DECODES or out not in ENCODES:
        raise FormatError(f"{region.entry.key!r}: dequantizing {weight.dtype} into {out}; FP8 dequantization reads "
                          f"{', '.join(DECODES)} into {', '.join(ENCODES)}")
    br, bc = r0 // b, c0 // b
    grid = ((r0 + rows - 1) // b - br + 1, (c0 + cols - 1) // b - bc + 1) if rows * cols else (0, 0)
    scales = _scale_values(Region(scale, (br, bc), grid), read)
    return dequantize(_array(Region(weight, (r0, c0), (rows, cols)), read), scales, (r0, c0), b, weight.dtype.name,
                      out)


def _scale_values(region: Region, read: Read) -> Any:
    """A region of block scales as float32 values: a float8 scale decoded by its format (an e8m0 byte ``b`` is
    2^(b - 127)), as torch's ``.float()`` decodes it; a wider float widened (float64 rounded)."""
    from .floats import DECODES, ENCODES, decode_table, to_float32

    name = region.entry.dtype.name
    if name in DECODES:
        return decode_table(name)[_elements(region, read)]
    if name in ENCODES:
        return to_float32(_array(region, read), name)
    raise FormatError(f"{region.entry.key!r}: {name} is not a dtype of block scales FP8 dequantization reads "
                      f"({', '.join(ENCODES + DECODES)})")


FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit code (e2m1), the table transformers' MXFP4 dequantization indexes."""


def _mxfp4(region: Region, derived: Derived, read: Read):
    import torch

    blocks, scales = derived.inputs
    width = 2 * blocks.shape[-1]
    *lead, c0 = region.offsets
    *counts, cols = region.sizes
    dtype = getattr(torch, region.entry.dtype.name)
    if math.prod(region.sizes) == 0:
        return torch.empty(region.sizes, dtype=dtype)
    g0, g1 = c0 // width, (c0 + cols - 1) // width + 1
    blk = _tensor(Region(blocks, (*lead, g0, 0), (*counts, g1 - g0, blocks.shape[-1])), read)
    codes = _elements(Region(scales, (*lead, g0), (*counts, g1 - g0)), read)  # e8m0 exponents: the bytes
    exp = torch.from_numpy(codes.astype("int32")) - 127
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty((*blk.shape[:-1], width), dtype=dtype)
    out[..., 0::2] = lut[(blk & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blk >> 4).to(torch.int)]
    torch.ldexp(out, exp.unsqueeze(-1), out=out)
    if scales.dtype.name == "float8_e8m0fnu":  # its code 0xFF is NaN, where a uint8 exponent 255 is 2^128
        out.masked_fill_((exp == 128).unsqueeze(-1), math.nan)
    flat = out.reshape(*counts, (g1 - g0) * width)
    return flat[..., c0 - g0 * width:c0 - g0 * width + cols].contiguous()


def _fp8(region: Region, derived: Derived, read: Read) -> Any:
    """A box of a weight's float8 values or of its tile scales, one band of whole tiles (``block`` rows of the
    weight) at a time, so that only a band's float32 copy is alive beside the output."""
    import numpy as np

    from .fp8 import quantize

    (weight,), b = derived.inputs, derived.block
    scales = derived.op == "fp8_scale"
    (r0, c0), (nr, nc) = region.offsets, region.sizes
    out = np.empty((nr, nc), np.float32 if scales else np.uint8)
    unit = 1 if scales else b  # the scales' box counts tiles, the values' box elements
    left = c0 // unit * b
    right = min(-(-(c0 + nc) // unit) * b, weight.shape[1])
    for tile in range(r0 // unit, -(-(r0 + nr) // unit) if nr else 0):
        top, bottom = tile * b, min((tile + 1) * b, weight.shape[0])
        box = Region(weight, (top, left), (bottom - top, right - left))
        key = (weight, tile, left, right)
        if scales:
            out[tile - r0] = _scales_of(key, box, read, b)[c0 - left // b:c0 - left // b + nc]
            continue
        band = _array(box, read)
        a, z = max(top, r0), min(bottom, r0 + nr)
        scale = _scales_of(key, box, read, b, band)
        if c0 == left:  # the box's columns start at a tile's: quantized straight into the output
            quantize(band[a - top:z - top, :nc], weight.dtype.name, scale, b, out[a - r0:z - r0])
            continue
        values = quantize(band[a - top:z - top, :c0 - left + nc], weight.dtype.name, scale, b)
        out[a - r0:z - r0] = values[:, c0 - left:]
    return out


_SCALES: dict[tuple[TensorEntry, int, int, int], Any] = {}
"""The tile scales of the bands last quantized (weight, band, columns): a weight's scales are written after its
values, and computing them again would read the weight twice."""
_SCALES_KEPT = 4096


def _scales_of(key: tuple[TensorEntry, int, int, int], box: Region, read: Read, b: int, band: Any = None) -> Any:
    """The tile scales of band ``key`` (weight, band, first and end column) unless kept from before, computed
    from ``band`` (``box``'s bytes), read where not given."""
    from .fp8 import tile_scales

    scale = _SCALES.get(key)
    if scale is None:
        if len(_SCALES) >= _SCALES_KEPT:  # a few KB a weight: dropped once many weights have passed
            _SCALES.clear()
        scale = _SCALES[key] = tile_scales(_array(box, read) if band is None else band, key[0].dtype.name, b)
    return scale


COMPUTE_MEMORY = 32 << 20
"""The most memory one box of a computed tensor takes, whatever ``--max-memory`` allows: computing in boxes
larger than this is no faster, and a box's working copies are several times its size."""


def working_bytes(derived: Derived) -> int:
    """Bytes alive per output element while a box of ``derived`` is computed, beyond the output's own: a
    tile scale is computed from a whole tile of the weight in float32, other ops from about one element each."""
    if derived.op == "fp8_scale":
        return derived.block * derived.block * WORKING_BYTES
    return WORKING_BYTES


def block_budget(region: Region, max_memory: int) -> int:
    """The bytes of one row block of a region to cast or compute: a block's source bytes and their cast copy
    are alive at once, so a row costs its size in both dtypes (and a computed one its working copies too);
    row_blocks counts the block in the written dtype alone."""
    out = region.dtype.itemsize
    if region.entry.derived is None:
        return max(1, max_memory * out // (region.entry.dtype.itemsize + out))
    derived = region.entry.derived
    per_element = region.entry.dtype.itemsize + out + working_bytes(derived)
    budget = max(1, min(max_memory, COMPUTE_MEMORY) * out // per_element)
    if derived.op == "quant_fp8" and region.sizes and region.sizes[0]:  # whole bands of tiles: each read once
        row = region.nbytes // region.sizes[0] or 1
        budget = max(derived.block, budget // row // derived.block * derived.block) * row
    return budget

"""The bytes of a box of a computed tensor (:class:`~ckptkit.core.manifest.Derived`): a transpose, an FP8
dequantization. Each box is computed from the matching boxes of its inputs alone, so the executor computes a
tensor one row block at a time, within its memory setting, and never holds the model.

- ``transpose``: box ``(o, s)`` of the output is the transpose of the input's box with the last two dims of
  ``o`` and ``s`` swapped (the input's columns, read as strided rows);
- ``dequant_fp8``: the weight's box in float32 times each element's block scale (the scale rows and columns
  of the blocks the box meets, repeated ``block`` times and cropped), then cast: what torch's
  ``QuantizedHuggingFaceStorageReader._dequantize_tensor`` computes block by block.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from ..core.manifest import Derived
from ..core.plan import Region

Read = Callable[[Region], bytearray]
"""The row-major bytes of a region of a stored tensor (:func:`ckptkit.io.sources.read_region` over open files)."""

__all__ = ["WORKING_BYTES", "block_budget", "compute_region", "tensor_bytes"]

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
    import torch

    derived = region.entry.derived
    assert derived is not None
    if derived.op == "transpose":
        box = _swap(region.offsets), _swap(region.sizes)
        out = _tensor(Region(derived.inputs[0], *box), read).transpose(-1, -2).contiguous()
    elif derived.op in ("rows", "stack"):
        out = _rows(region, derived, read)
    else:
        out = _dequantized(region, derived, read).to(getattr(torch, region.entry.dtype.name))
    return tensor_bytes(out)


def _rows(region: Region, derived: Derived, read: Read) -> Any:
    """Rows of the region from each input that holds some: a ``rows`` entry's ranges, or a ``stack``'s
    inputs, one row (of the output) each."""
    import torch

    ranges = derived.ranges or tuple((i, 0, 1) for i in range(len(derived.inputs)))
    first, end = region.offsets[0], region.offsets[0] + region.sizes[0]
    parts, row = [], 0
    for i, a, b in ranges:
        top, bottom = max(first, row), min(end, row + b - a)
        if top < bottom:
            source = derived.inputs[i]
            if derived.op == "stack":
                box = Region(source, region.offsets[1:], region.sizes[1:])
                parts.append(_tensor(box, read).unsqueeze(0))
            else:
                box = Region(source, (a + top - row, *region.offsets[1:]), (bottom - top, *region.sizes[1:]))
                parts.append(_tensor(box, read))
        row += b - a
    dtype = getattr(torch, region.entry.dtype.name)
    return torch.cat(parts) if parts else torch.empty(region.sizes, dtype=dtype)


def _swap(t: tuple[int, ...]) -> tuple[int, ...]:
    return (*t[:-2], t[-1], t[-2])


def _dequantized(region: Region, derived: Derived, read: Read):
    import torch

    weight, scale = derived.inputs
    b = derived.block
    (r0, c0), (rows, cols) = region.offsets, region.sizes
    if rows * cols == 0:
        return torch.empty((rows, cols), dtype=torch.float32)
    w = _tensor(Region(weight, region.offsets, region.sizes), read).to(torch.float32)
    br, bc = r0 // b, c0 // b
    grid = ((r0 + rows - 1) // b - br + 1, (c0 + cols - 1) // b - bc + 1)
    s = _tensor(Region(scale, (br, bc), grid), read).to(torch.float32)
    expanded = s.repeat_interleave(b, 0).repeat_interleave(b, 1)
    return w * expanded[r0 - br * b:r0 - br * b + rows, c0 - bc * b:c0 - bc * b + cols]


def block_budget(region: Region, max_memory: int) -> int:
    """The bytes of one row block of a region to cast or compute: a block's source bytes and their cast copy
    are alive at once, so a row costs its size in both dtypes (and a computed one its working copies too);
    row_blocks counts the block in the written dtype alone."""
    out = region.dtype.itemsize
    working = WORKING_BYTES if region.entry.derived is not None else 0
    return max(1, max_memory * out // (region.entry.dtype.itemsize + out + working))

"""Tensors made of rows of other tensors, as pure arithmetic on chunks: splits, joins, row gathers.

A chunk in row-major order holds its rows one after another, so any range of a tensor's rows along dim 0 is,
in each chunk it meets, one contiguous byte range: a :class:`~ckptkit.core.manifest.Chunk` of its own. A
tensor made of row ranges of other tensors is therefore a :class:`~ckptkit.core.manifest.TensorEntry` whose
chunks are those cropped chunks, moved to their new rows. Nothing is read or computed here: the planner and
the executor stream such an entry as they stream any other, across chunk boundaries and with casts.

- :func:`take_rows` is the one primitive: the rows ``[a, b)`` of each of several tensors, one after another;
- :func:`split_rows` (stacked experts into per-expert weights, a fused projection into its parts, per query
  group), :func:`join_rows` (the reverse);
- :func:`squeeze0`/:func:`unsqueeze0` drop or add a leading dimension of size 1, so that
  :func:`unstack` (a leading expert or layer dimension into one tensor each) and :func:`stack` (the reverse)
  are a split and a join;
- :func:`join_along` and :func:`split_along` do the same along dim 1 of a tensor with a leading (expert)
  dim, one leading index at a time; :func:`reshaped` regroups the dims past the first (a convolution's
  kernel as one flat row), which moves no byte;
- :func:`materialize_rows` turns a row gather (:attr:`TensorEntry.rows`, the rotary order) into chunks, so
  gathered tensors split and join too;
- :func:`transposed`, :func:`interleaved` (a last dim's two halves taken in turn, or back), :func:`dequantized`
  (FP8), :func:`dequantized_mxfp4`, :func:`quantized_fp8` and :func:`zeros` describe computed tensors
  (:class:`~ckptkit.core.manifest.Derived`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ..errors import UsageError
from .boxes import extent
from .dtypes import DType
from .manifest import Chunk, Derived, Span, TensorEntry

__all__ = ["COMPUTED_IN_ANY_DTYPE", "FP8_MAX", "FP8_SCALE_DTYPES", "MXFP4_BLOCK", "computed_in", "dequantized",
           "dequantized_mxfp4", "interleaved", "join_along", "join_rows", "materialize_rows", "quantized_fp8",
           "reshaped", "split_along", "split_rows", "squeeze0", "stack", "take_rows", "transposed", "unsqueeze0",
           "unstack", "zeros"]


def _crop(c: Chunk, a: int, b: int, shift: int, itemsize: int) -> Chunk | None:
    """Chunk ``c`` cropped to the tensor's rows ``[a, b)`` and moved ``shift`` rows; None where it has none."""
    top, bottom = max(a, c.offsets[0]), min(b, c.offsets[0] + c.sizes[0])
    if top >= bottom:
        return None
    sizes = (bottom - top, *c.sizes[1:])
    row_stride = c.strides[0] if c.strides is not None else _row_elements(c.sizes)
    skip = (top - c.offsets[0]) * row_stride * itemsize
    length = extent(sizes, c.strides) * itemsize
    return Chunk((top + shift, *c.offsets[1:]), sizes, Span(c.span.file, c.span.offset + skip, length), c.strides)


def _row_elements(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes[1:]:
        n *= s
    return n


def materialize_rows(entry: TensorEntry) -> TensorEntry:
    """``entry`` with its row gather (if any) written into its chunks: each run of rows whose source rows follow
    on is the source chunks' crop to those rows. The bytes are the same; only the description changes."""
    if entry.rows is None:
        return entry
    source = dataclasses.replace(entry, rows=None)
    chunks: list[Chunk] = []
    first = 0
    while first < len(entry.rows):
        end = first + 1
        while end < len(entry.rows) and entry.rows[end] == entry.rows[end - 1] + 1:
            end += 1
        start = entry.rows[first]
        chunks += _cropped(source, start, start + end - first, first - start)
        first = end
    return dataclasses.replace(source, chunks=tuple(chunks))


def _cropped(entry: TensorEntry, a: int, b: int, shift: int) -> list[Chunk]:
    seen: set[tuple] = set()
    out = []
    for c in entry.chunks:
        if (c.offsets, c.sizes) in seen:  # a replica (HSDP): the first serves
            continue
        seen.add((c.offsets, c.sizes))
        cropped = _crop(c, a, b, shift, entry.dtype.itemsize)
        if cropped is not None:
            out.append(cropped)
    return out


def take_rows(key: str, pieces: Sequence[tuple[TensorEntry, int, int]]) -> TensorEntry:
    """A tensor named ``key`` whose rows are rows ``[a, b)`` of each ``(entry, a, b)`` of ``pieces``, in order.

    Raises:
        UsageError: the pieces differ in dtype or in their shape past dim 0, or a range is not within its tensor.
    """
    if not pieces:
        raise UsageError(f"{key!r}: made of no rows")
    first = pieces[0][0]
    dtype, tail = first.dtype, first.shape[1:]
    for entry, a, b in pieces:
        if not entry.shape or entry.dtype != dtype or entry.shape[1:] != tail:
            raise UsageError(f"{key!r}: cannot join {entry.key!r} ({entry.dtype}, {list(entry.shape)}) to "
                             f"{first.key!r} ({dtype}, {list(first.shape)}): dtype and shape past dim 0 must agree")
        if not 0 <= a <= b <= entry.shape[0]:
            raise UsageError(f"{key!r}: rows [{a}, {b}) are not within {entry.key!r}'s {entry.shape[0]} rows")
    rows = sum(b - a for _, a, b in pieces)
    if any(entry.derived is not None for entry, _, _ in pieces):  # computed: no byte ranges to take
        inputs = tuple(dict.fromkeys(entry for entry, _, _ in pieces))
        ranges = tuple((inputs.index(entry), a, b) for entry, a, b in pieces)
        return TensorEntry(key, (key,), dtype, (rows, *tail), (), derived=Derived("rows", inputs, ranges=ranges))
    chunks: list[Chunk] = []
    row = 0
    for entry, a, b in pieces:
        chunks += _cropped(materialize_rows(entry), a, b, row - a)
        row += b - a
    return TensorEntry(key, (key,), dtype, (rows, *tail), tuple(chunks))


def split_rows(entry: TensorEntry, counts: Sequence[int], keys: Sequence[str]) -> list[TensorEntry]:
    """``entry`` cut along dim 0 into parts of ``counts`` rows, named ``keys``.

    Raises:
        UsageError: the counts do not add up to the tensor's rows.
    """
    if not entry.shape or sum(counts) != entry.shape[0]:
        raise UsageError(f"{entry.key!r}: has {entry.shape[0] if entry.shape else 0} rows, not the "
                         f"{' + '.join(map(str, counts))} of its parts ({', '.join(keys)})")
    out, a = [], 0
    for n, key in zip(counts, keys, strict=True):
        out.append(take_rows(key, [(entry, a, a + n)]))
        a += n
    return out


def join_rows(key: str, entries: Sequence[TensorEntry]) -> TensorEntry:
    """``entries`` one after another along dim 0, named ``key``."""
    return take_rows(key, [(e, 0, e.shape[0] if e.shape else 0) for e in entries])


def join_along(key: str, entries: Sequence[TensorEntry], dim: int) -> TensorEntry:
    """``entries`` one after another along ``dim`` (0, or 1 under a leading dim they share), named ``key``."""
    if dim == 0:
        return join_rows(key, entries)
    count = entries[0].shape[0] if entries[0].shape else 0
    pieces = [unstack(e, [f"{e.key}[{i}]" for i in range(count)]) for e in entries]
    return stack(key, [join_rows(f"{key}[{i}]", [p[i] for p in pieces]) for i in range(count)])


def split_along(entry: TensorEntry, counts: Sequence[int], keys: Sequence[str], dim: int) -> list[TensorEntry]:
    """``entry`` cut along ``dim`` (0, or 1 under a leading dim) into parts of ``counts``, named ``keys``."""
    if dim == 0:
        return split_rows(entry, counts, keys)
    count = entry.shape[0] if entry.shape else 0
    per_index = [split_rows(e, counts, [f"{k}[{i}]" for k in keys])
                 for i, e in enumerate(unstack(entry, [f"{entry.key}[{i}]" for i in range(count)]))]
    return [stack(key, [parts[j] for parts in per_index]) for j, key in enumerate(keys)]


def reshaped(entry: TensorEntry, key: str, tail: tuple[int, ...]) -> TensorEntry:
    """``entry`` with its dims past the first regrouped as ``tail`` (the same elements), named ``key``: each
    chunk holds whole rows in row-major order, so it keeps its bytes and takes the new row shape.

    Raises:
        UsageError: ``tail`` holds another number of elements; a chunk holds part of a row, or is computed.
    """
    entry = materialize_rows(entry)
    old = entry.shape[1:]
    if not entry.shape or math.prod(old) != math.prod(tail):
        raise UsageError(f"{entry.key!r}: shape {list(entry.shape)} does not regroup as "
                         f"{[entry.shape[0] if entry.shape else 0, *tail]}")
    chunks = []
    for c in entry.chunks:
        if c.sizes[1:] != old or any(c.offsets[1:]) or (c.strides is not None and c.strides != _contiguous(c.sizes)):
            raise UsageError(f"{entry.key!r}: a chunk of shape {list(c.sizes)} at {list(c.offsets)} holds part of a "
                             f"row; regrouping {list(old)} as {list(tail)} needs whole rows")
        chunks.append(Chunk((c.offsets[0], *(0 for _ in tail)), (c.sizes[0], *tail), c.span))
    if entry.derived is not None:
        raise UsageError(f"{entry.key!r}: a computed tensor ({entry.derived.op}) is not regrouped")
    return TensorEntry(key, (key,), entry.dtype, (entry.shape[0], *tail), tuple(chunks))


def _contiguous(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(sizes[i + 1:]) for i in range(len(sizes)))


def squeeze0(entry: TensorEntry, key: str) -> TensorEntry:
    """``entry`` of shape ``(1, *rest)`` as a tensor of shape ``rest`` named ``key``."""
    if not entry.shape or entry.shape[0] != 1 or entry.derived is not None:
        raise UsageError(f"{entry.key!r}: shape {list(entry.shape)} has no leading dimension of size 1 to drop"
                         + (" (a computed tensor)" if entry.derived is not None else ""))
    entry = materialize_rows(entry)
    chunks = tuple(Chunk(c.offsets[1:], c.sizes[1:], c.span, None if c.strides is None else c.strides[1:])
                   for c in entry.chunks)
    return TensorEntry(key, (key,), entry.dtype, entry.shape[1:], chunks)


def unsqueeze0(entry: TensorEntry, key: str | None = None) -> TensorEntry:
    """``entry`` with a leading dimension of size 1."""
    if entry.derived is not None:
        raise UsageError(f"{entry.key!r}: a computed tensor takes no leading dimension; stack() it")
    entry = materialize_rows(entry)
    key = entry.key if key is None else key
    chunks = tuple(Chunk((0, *c.offsets), (1, *c.sizes), c.span,
                         None if c.strides is None else (extent(c.sizes, c.strides), *c.strides))
                   for c in entry.chunks)
    return TensorEntry(key, (key,), entry.dtype, (1, *entry.shape), chunks)


def unstack(entry: TensorEntry, keys: Sequence[str]) -> list[TensorEntry]:
    """``entry`` of shape ``(len(keys), *rest)`` as one tensor of shape ``rest`` per index of dim 0.

    Raises:
        UsageError: dim 0 does not have one index per key.
    """
    if not entry.shape or entry.shape[0] != len(keys):
        raise UsageError(f"{entry.key!r}: shape {list(entry.shape)} does not stack {len(keys)} tensors along dim 0")
    if entry.derived is not None:
        raise UsageError(f"{entry.key!r}: a computed tensor ({entry.derived.op}) is not unstacked; unstack its input")
    return [squeeze0(part, key) for part, key in zip(split_rows(entry, [1] * len(keys), keys), keys, strict=True)]


def stack(key: str, entries: Sequence[TensorEntry]) -> TensorEntry:
    """``entries`` (of one shape) stacked along a new leading dimension."""
    if any(e.derived is not None for e in entries):
        shapes = {(e.dtype, e.shape) for e in entries}
        if len(shapes) != 1:
            raise UsageError(f"{key!r}: cannot stack tensors of different dtypes or shapes: {sorted(map(str, shapes))}")
        first = entries[0]
        return TensorEntry(key, (key,), first.dtype, (len(entries), *first.shape), (),
                           derived=Derived("stack", tuple(entries)))
    return join_rows(key, [unsqueeze0(e) for e in entries])


def transposed(entry: TensorEntry, key: str) -> TensorEntry:
    """``entry``'s last two dimensions swapped, computed tile by tile (:mod:`ckptkit.io.compute`)."""
    if len(entry.shape) not in (2, 3):
        raise UsageError(f"{entry.key!r}: shape {list(entry.shape)}: only a 2-D or 3-D tensor is transposed")
    if entry.derived is not None and entry.derived.op == "transpose":  # a transpose's transpose is its input
        return dataclasses.replace(entry.derived.inputs[0], key=key, path=(key,))
    shape = (*entry.shape[:-2], entry.shape[-1], entry.shape[-2])
    return TensorEntry(key, (key,), entry.dtype, shape, (), derived=Derived("transpose", (entry,)))


def interleaved(entry: TensorEntry, key: str, inverse: bool = False) -> TensorEntry:
    """``entry``'s last dim, two halves one after the other, as their elements taken in turn (first half's
    ``i``, second half's ``i``, ...); ``inverse``: the reverse. Computed box by box (:mod:`ckptkit.io.compute`).

    Raises:
        UsageError: the last dim is not even.
    """
    if not entry.shape or entry.shape[-1] % 2:
        raise UsageError(f"{entry.key!r}: shape {list(entry.shape)}: the last dim does not hold two equal halves")
    if entry.derived is not None and entry.derived.op == ("interleave" if inverse else "deinterleave"):
        return dataclasses.replace(entry.derived.inputs[0], key=key, path=(key,))
    derived = Derived("deinterleave" if inverse else "interleave", (entry,))
    return TensorEntry(key, (key,), entry.dtype, entry.shape, (), derived=derived)


def dequantized(weight: TensorEntry, scale: TensorEntry, key: str, dtype: DType, block: int = 128) -> TensorEntry:
    """FP8 ``weight`` times ``scale`` (its ``weight_scale_inv``: one float per ``block`` x ``block`` tile), as
    ``dtype``; torch's ``QuantizedHuggingFaceStorageReader`` and transformers' fine-grained FP8 compute the same.

    Raises:
        UsageError: the weight is not a 2-D float8 tensor, or the scale's block grid does not cover it.
    """
    if len(weight.shape) != 2 or not weight.dtype.name.startswith("float8"):
        raise UsageError(f"{weight.key!r}: {weight.dtype} {list(weight.shape)}; FP8 dequantization takes a 2-D "
                         "float8 weight")
    grid = tuple(-(-n // block) for n in weight.shape)
    if scale.shape != grid:
        raise UsageError(f"{scale.key!r}: shape {list(scale.shape)} ({scale.dtype}); the {block}x{block} block grid "
                         f"of {weight.key!r} {list(weight.shape)} is {list(grid)} floats")
    if scale.dtype.name not in FP8_SCALE_DTYPES:
        raise UsageError(f"{scale.key!r}: {scale.dtype}; an FP8 block scale is read by value from one of "
                         f"{', '.join(FP8_SCALE_DTYPES)}")
    return TensorEntry(key, (key,), dtype, weight.shape, (), derived=Derived("dequant_fp8", (weight, scale), block))


FP8_SCALE_DTYPES = ("float32", "bfloat16", "float16", "float64", "float8_e8m0fnu", "float8_e4m3fn", "float8_e5m2",
                    "float8_e4m3fnuz", "float8_e5m2fnuz")
"""The dtypes of a ``weight_scale_inv`` that FP8 dequantization decodes by value, as torch's ``.float()`` does
(a float64 scale rounded to float32, as torch's float32 product rounds it)."""
COMPUTED_IN_ANY_DTYPE = ("dequant_fp8",)
"""Computations whose result in a narrower dtype is computed straight into it (each tile's 256 results are
float32 products, rounded once), bit for bit the float32 result cast."""
_MOVES_ONLY = ("rows", "stack", "transpose", "interleave", "deinterleave")
"""Computations that move their inputs' elements and compute none."""


def computed_in(entry: TensorEntry, dtype: DType | None) -> TensorEntry:
    """``entry`` computed straight into ``dtype`` (a cast of it), where it is a computation of
    :data:`COMPUTED_IN_ANY_DTYPE` or moves elements of such computations alone: the same bits as computing it
    and casting, without the wider copy. Any other entry, or no ``dtype``, is returned as it is."""
    derived = entry.derived
    if dtype is None or derived is None or dtype == entry.dtype or not dtype.is_floating:
        return entry
    if derived.op in COMPUTED_IN_ANY_DTYPE:
        return dataclasses.replace(entry, dtype=dtype)
    if derived.op not in _MOVES_ONLY or not derived.inputs:
        return entry
    inputs = tuple(computed_in(i, dtype) for i in derived.inputs)
    if any(i.dtype != dtype for i in inputs):
        return entry
    return dataclasses.replace(entry, dtype=dtype, derived=dataclasses.replace(derived, inputs=inputs))


MXFP4_BLOCK = 32
"""FP4 values per MXFP4 block (16 bytes, two values a byte), which share one e8m0 scale."""


def dequantized_mxfp4(blocks: TensorEntry, scales: TensorEntry, key: str, dtype: DType) -> TensorEntry:
    """MXFP4 ``blocks`` (``[..., rows, groups, 16]`` uint8, two FP4 values a byte, low nibble first) times
    2^(``scales`` - 127) (``[..., rows, groups]`` e8m0 exponents: uint8 as released, or ``float8_e8m0fnu``,
    whose NaN code gives NaN), as ``dtype`` ``[..., rows, groups x 32]``: what transformers'
    ``convert_moe_packed_tensors`` computes in ``dtype`` before its final transpose.

    Raises:
        UsageError: the blocks are not uint8 with 16 bytes a block, or the scales do not match them.
    """
    if blocks.dtype.name != "uint8" or len(blocks.shape) < 3 or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise UsageError(f"{blocks.key!r}: {blocks.dtype} {list(blocks.shape)}; MXFP4 blocks are uint8 "
                         f"[..., rows, groups, {MXFP4_BLOCK // 2}]")
    if scales.dtype.name not in ("uint8", "float8_e8m0fnu") or scales.shape != blocks.shape[:-1]:
        raise UsageError(f"{scales.key!r}: {scales.dtype} {list(scales.shape)}; the scales of {blocks.key!r} "
                         f"{list(blocks.shape)} are e8m0 exponents, uint8 or float8_e8m0fnu "
                         f"{list(blocks.shape[:-1])}")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK)
    return TensorEntry(key, (key,), dtype, shape, (), derived=Derived("dequant_mxfp4", (blocks, scales)))


FP8_MAX = 448.0
"""The largest float8 e4m3 value: a block's largest magnitude is scaled to it."""


def quantized_fp8(weight: TensorEntry, key: str, float8: DType, scale_dtype: DType,
                  block: int = 128) -> tuple[TensorEntry, TensorEntry]:
    """``weight`` as DeepSeek-V3 releases its linear layers: the float8 e4m3 weight ``key`` and its
    ``key + "_scale_inv"``, one float per ``block`` x ``block`` tile, that tile's largest magnitude / 448 (the
    weight is the float8 value times its tile's scale; an all-zero tile has scale 0 and zeros).

    Raises:
        UsageError: the weight is not a 2-D floating tensor.
    """
    if len(weight.shape) != 2 or not weight.dtype.is_floating or weight.dtype.name.startswith("float8"):
        raise UsageError(f"{weight.key!r}: {weight.dtype} {list(weight.shape)}; FP8 quantization takes a 2-D "
                         "floating weight")
    grid = tuple(-(-n // block) for n in weight.shape)
    values = TensorEntry(key, (key,), float8, weight.shape, (), derived=Derived("quant_fp8", (weight,), block))
    scale_key = key + "_scale_inv"
    scale = TensorEntry(scale_key, (scale_key,), scale_dtype, grid, (), derived=Derived("fp8_scale", (weight,), block))
    return values, scale


def zeros(key: str, dtype: DType, shape: tuple[int, ...]) -> TensorEntry:
    """A tensor of ``shape`` whose every element is zero, computed box by box: read from nothing."""
    return TensorEntry(key, (key,), dtype, shape, (), derived=Derived("zeros", ()))

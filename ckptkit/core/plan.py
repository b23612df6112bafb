"""Pure planning: what bytes each output file is made of, and which source byte ranges fill a tensor region.

Nothing here opens a file. Writers describe their output as :class:`WritePlan` (files made of
:class:`Bytes` framing bytes and :class:`Region` tensor boxes); :func:`plan_copies` turns a region into the
list of source byte ranges that produce its row-major bytes. The executor then moves the bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import IncompleteCheckpointError
from .boxes import row_major
from .dtypes import DType
from .manifest import Chunk, Span, TensorEntry

__all__ = ["Copy", "FilePlan", "Bytes", "Part", "Region", "Strided", "WritePlan", "gather_copies", "plan_copies",
           "plan_strided", "row_blocks", "row_runs"]


@dataclass(frozen=True, slots=True)
class Bytes:
    """Bytes a writer computed itself: headers, pickles, zip directories."""

    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass(frozen=True, slots=True)
class Region:
    """The row-major bytes of box ``offsets``/``sizes`` of tensor ``entry``, cast to ``cast`` if set."""

    entry: TensorEntry
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    cast: DType | None = None

    @classmethod
    def whole(cls, entry: TensorEntry, cast: DType | None = None) -> Region:
        return cls(entry, (0,) * len(entry.shape), entry.shape, cast)

    @property
    def dtype(self) -> DType:
        return self.cast or self.entry.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


Part = Bytes | Region


@dataclass(frozen=True, slots=True)
class FilePlan:
    relpath: str
    parts: tuple[Part, ...]
    nbytes: int = field(init=False, compare=False)
    """Summed once: a reshard to 512 ranks asks each file's size several times, over ~100 parts each."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum([p.nbytes for p in self.parts]))


@dataclass(frozen=True)
class WritePlan:
    files: tuple[FilePlan, ...]
    single_file: bool = False
    """The destination is one file (``files`` has one entry) rather than a directory."""
    commit: str | None = None
    """The file whose presence makes the output a checkpoint (DCP's ``.metadata``, an index): where the store
    cannot rename a directory into place (object stores), it is written last, after every other file."""
    kept: tuple[str, ...] = ()
    """Files and folders of the destination this output replaces that it keeps as they are, beside its own
    (paths relative to it, a folder ending in ``/``): an overwrite of a model folder keeps its tokenizer."""
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", sum(f.nbytes for f in self.files))


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``src`` to byte ``dst`` of the region's row-major buffer."""

    src: Span
    dst: int


_INDEX_FROM = 16  # chunks; fewer are scanned


def _candidates(entry: TensorEntry, offset: int, size: int) -> tuple[Chunk, ...] | list[Chunk]:
    """The chunks of ``entry`` that may meet rows ``[offset, offset + size)``, in their order in its chunks
    where boxes repeat. A reshard to N ranks plans N regions per tensor; scanning every chunk for each would
    cost ranks x ranks per tensor, so the chunks are sorted along dim 0 once per entry
    (:attr:`TensorEntry.by_row`) and found by bisection."""
    chunks = entry.chunks
    if len(chunks) < _INDEX_FROM:
        return chunks
    known = entry.by_row
    if known is None:
        order = sorted(chunks, key=lambda c: c.offsets[0])  # stable: replicas keep their order
        known = ([c.offsets[0] for c in order], order, max(c.sizes[0] for c in order))
        object.__setattr__(entry, "by_row", known)  # a cache, not a field: see TensorEntry.by_row
    starts, order, tallest = known
    return order[bisect.bisect_left(starts, offset - tallest + 1):bisect.bisect_left(starts, offset + size)]


class Strided(NamedTuple):
    """``rows`` copies of ``src.length`` bytes: the i-th from ``src.offset + i * src_step`` of ``src.file`` to
    byte ``dst + i * dst_step`` of the region's row-major buffer. The rows of a column chunk (``Shard(1)``) are
    one of these rather than one :class:`Copy` each; a plain copy has ``rows`` 1 and steps 0.

    A tuple, not a frozen dataclass: the executor makes one or more per region (a million in a large reshard),
    and a frozen dataclass takes three times as long to make."""

    src: Span
    dst: int
    rows: int = 1
    src_step: int = 0
    dst_step: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.src.length

    def copies(self) -> list[Copy]:
        src = self.src
        return [Copy(Span(src.file, src.offset + i * self.src_step, src.length), self.dst + i * self.dst_step)
                for i in range(self.rows)]


def plan_copies(region: Region) -> tuple[Copy, ...]:
    """Source byte ranges that make up ``region`` (in the entry's own dtype), coalesced, ordered by ``dst``."""
    if region.entry.rows is not None:
        return gather_copies(region)
    strided = plan_strided(region)
    if all(s.rows == 1 for s in strided):  # already ordered and coalesced
        return tuple(Copy(s.src, s.dst) for s in strided)
    singles = sorted((Strided(cp.src, cp.dst) for s in strided for cp in s.copies()), key=lambda s: s.dst)
    return tuple(Copy(s.src, s.dst) for s in _merged(singles))


def plan_strided(region: Region) -> tuple[Strided, ...]:
    """:func:`plan_copies` with the rows of a chunk that the region takes in part as one :class:`Strided` each,
    for the executor, which reads them with one system call rather than one per row. Ordered by ``dst``; only
    plain copies are coalesced."""
    entry, ro, rs = region.entry, region.offsets, region.sizes
    if entry.rows is not None:
        return tuple(s._replace(dst=s.dst + shift) for shift, box in _gathered_boxes(region)
                     for s in plan_strided(box))
    isz, n = entry.dtype.itemsize, len(entry.shape)
    size = math.prod(rs) * isz
    if size == 0:
        return ()
    # Whole rows of the tensor (a Shard(0) region): a chunk of whole rows gives one run, its rows in the region.
    rows = n and rs[1:] == entry.shape[1:]
    row = math.prod(rs[1:]) * isz
    if rows:
        fast = _shard0_runs(_candidates(entry, ro[0], rs[0]), ro[0], ro[0] + rs[0], row, rs[1:])
        if fast is not None:
            return fast
    out: list[Strided] = []
    seen: set[tuple] = set()
    ordered = True  # whether the pieces come in the order of dst, as Shard(0) chunks in order do
    for c in (_candidates(entry, ro[0], rs[0]) if n else entry.chunks):
        box = (c.offsets, c.sizes)
        if box in seen:  # a replica (HSDP without de-duplication): the first copy serves
            continue
        seen.add(box)
        if rows and c.strides is None and c.sizes[1:] == rs[1:]:
            a, b = max(ro[0], c.offsets[0]), min(ro[0] + rs[0], c.offsets[0] + c.sizes[0])
            if a < b:
                dst = (a - ro[0]) * row
                ordered = ordered and (not out or out[-1].dst < dst)
                out.append(Strided(Span(c.span.file, c.span.offset + (a - c.offsets[0]) * row, (b - a) * row), dst))
            continue
        ordered = False
        out += _chunk_strided(c, ro, rs, isz)
    if not ordered:
        out.sort(key=lambda s: s.dst)
    merged = _merged(out)
    covered = sum(s.nbytes for s in merged)
    if covered != size:
        raise IncompleteCheckpointError(
            f"tensor {entry.key!r}: chunks supply {covered} of the {size} bytes of box "
            f"{list(ro)}+{list(rs)} (a rank file or chunk is missing)")
    return tuple(merged)


def _shard0_runs(chunks: Iterable[Chunk], first: int, end: int, row: int,
              tail: tuple[int, ...]) -> tuple[Strided, ...] | None:
    """Rows ``[first, end)`` (``row`` bytes each) from ``chunks`` of whole rows that follow one another down
    dim 0, as ``Shard(0)`` chunks in order do: a copy each, those that follow on in one file joined. None where
    the chunks are anything else (a gap, a replica, other strides): the general walk sorts that out."""
    out: list[Strided] = []
    done = first
    for c in chunks:
        if c.strides is not None or c.sizes[1:] != tail:
            return None
        top = c.offsets[0]
        bottom = top + c.sizes[0]
        if bottom <= first or top >= end or top == bottom:
            continue
        a = max(first, top)
        if a != done:
            return None
        done = min(end, bottom)
        span = c.span
        src, length = span.offset + (a - top) * row, (done - a) * row
        last = out[-1].src if out else None
        if last is not None and last.file == span.file and last.offset + last.length == src:
            out[-1] = Strided(Span(last.file, last.offset, last.length + length), out[-1].dst)
        else:  # a whole chunk (nearly always in a reshard of small chunks) is its own span
            whole = src == span.offset and length == span.length
            out.append(Strided(span if whole else Span(span.file, src, length), (a - first) * row))
    return tuple(out) if done == end else None


def _chunk_strided(c: Chunk, ro: tuple[int, ...], rs: tuple[int, ...], isz: int) -> list[Strided]:
    """The part of box ``ro``/``rs`` that chunk ``c`` holds, as strided copies along the last dim that is not
    whole (one for a column chunk of a matrix; one per index of the dims before it for more dims)."""
    n = len(rs)
    lo = tuple(max(r_off, c_off) for r_off, c_off in zip(ro, c.offsets, strict=True))
    hi = tuple(min(r_off + r_size, c_off + c_size)
               for r_off, r_size, c_off, c_size in zip(ro, rs, c.offsets, c.sizes, strict=True))
    if any(high <= low for low, high in zip(lo, hi, strict=True)):
        return []
    isizes = tuple(high - low for low, high in zip(lo, hi, strict=True))
    cstrides = c.strides or row_major(c.sizes)
    rstrides = row_major(rs)
    # Widen the contiguous run leftwards while every dim to its right is whole in chunk and region alike.
    if n == 0:
        k = 0
    elif cstrides[-1] != 1:
        k = n
    else:
        k = n - 1
        while k > 0 and isizes[k] == c.sizes[k] == rs[k] and cstrides[k - 1] == cstrides[k] * c.sizes[k]:
            k -= 1
    run = math.prod(isizes[k:]) * isz
    base_src = sum((lo[d] - c.offsets[d]) * cstrides[d] for d in range(k, n))
    base_dst = sum((lo[d] - ro[d]) * rstrides[d] for d in range(k, n))
    if k == 0:
        return [Strided(Span(c.span.file, c.span.offset + base_src * isz, run), base_dst * isz)]
    # Dim k - 1 is the stride; the dims before it are walked one index at a time.
    last = k - 1
    rows = isizes[last]
    src_step, dst_step = (cstrides[last] * isz, rstrides[last] * isz) if rows > 1 else (0, 0)
    out = []
    for idx in itertools.product(*(range(lo[d], lo[d] + 1 if d == last else hi[d]) for d in range(k))):
        s = base_src + sum((i - c.offsets[d]) * cstrides[d] for d, i in enumerate(idx))
        t = base_dst + sum((i - ro[d]) * rstrides[d] for d, i in enumerate(idx))
        out.append(Strided(Span(c.span.file, c.span.offset + s * isz, run), t * isz, rows, src_step, dst_step))
    return out


def _merged(pieces: list[Strided]) -> list[Strided]:
    """``pieces`` (ordered by ``dst``) with plain copies that follow on in source and destination joined."""
    merged: list[Strided] = []
    for s in pieces:
        last = merged[-1] if merged else None
        if (last is not None and last.rows == s.rows == 1 and last.src.file == s.src.file
                and last.src.offset + last.src.length == s.src.offset and last.dst + last.src.length == s.dst):
            merged[-1] = Strided(Span(s.src.file, last.src.offset, last.src.length + s.src.length), last.dst)
        else:
            merged.append(s)
    return merged


def row_runs(rows: tuple[int, ...], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Rows ``[start, stop)`` of a gather as ``(first, end, source first)`` runs whose source rows follow on."""
    runs: list[tuple[int, int, int]] = []
    for i in range(start, stop):
        if runs and rows[i] == runs[-1][2] + (i - runs[-1][0]):
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, rows[i]))
    return runs


def _gathered_boxes(region: Region) -> list[tuple[int, Region]]:
    """A row-gathered region as boxes of its source tensor, each with where its bytes go in the region: each
    run of rows whose source rows follow on is one box."""
    entry, ro, rs = region.entry, region.offsets, region.sizes
    assert entry.rows is not None
    source = dataclasses.replace(entry, rows=None)
    row_bytes = math.prod(rs[1:]) * entry.dtype.itemsize
    return [((first - ro[0]) * row_bytes, Region(source, (src, *ro[1:]), (end - first, *rs[1:])))
            for first, end, src in row_runs(entry.rows, ro[0], ro[0] + rs[0])]


def gather_copies(region: Region) -> tuple[Copy, ...]:
    """:func:`plan_copies` of a row-gathered entry (:attr:`TensorEntry.rows`): each run of rows whose source
    rows follow on is a box of the source tensor, planned as any box is and moved to its place in the region."""
    if region.entry.rows is None:
        return plan_copies(region)
    return tuple(Copy(c.src, c.dst + shift) for shift, box in _gathered_boxes(region) for c in plan_copies(box))


def row_blocks(region: Region, budget: int) -> list[Region]:
    """Split ``region`` along dim 0 into boxes of at most ``budget`` bytes (one row at least)."""
    if not region.sizes or region.nbytes <= budget:
        return [region]
    row = region.nbytes // region.sizes[0] or 1
    step = max(1, budget // row)
    out = []
    for a in range(0, region.sizes[0], step):
        b = min(a + step, region.sizes[0])
        out.append(Region(region.entry, (region.offsets[0] + a, *region.offsets[1:]), (b - a, *region.sizes[1:]),
                          region.cast))
    return out


"""Pure planning: what bytes each output file is made of, and which source byte ranges fill a tensor region.

Nothing here opens a file. Writers describe their output as :class:`WritePlan` (files made of
:class:`Bytes` framing bytes and :class:`Region` tensor boxes); :func:`plan_copies` turns a region into the
list of source byte ranges that produce its row-major bytes. The executor then moves the bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field

from ..errors import IncompleteCheckpointError
from .boxes import row_major
from .dtypes import DType
from .manifest import Chunk, Span, TensorEntry

__all__ = ["Copy", "FilePlan", "Bytes", "Part", "Region", "WritePlan", "gather_copies", "plan_copies", "row_blocks",
           "row_runs", "split_files"]


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
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", sum(f.nbytes for f in self.files))


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``src`` to byte ``dst`` of the region's row-major buffer."""

    src: Span
    dst: int


_INDEX_FROM = 16  # chunks; fewer are scanned
_INDEX_LIMIT = 1 << 16  # indexed tensors remembered
_index: dict[int, tuple[tuple[Chunk, ...], list[int], list[Chunk], int]] = {}


def _candidates(chunks: tuple[Chunk, ...], offset: int, size: int) -> tuple[Chunk, ...] | list[Chunk]:
    """The chunks that may meet rows ``[offset, offset + size)``, in their order in ``chunks`` where boxes
    repeat. A reshard to N ranks plans N regions per tensor; scanning every chunk for each would cost
    ranks x ranks per tensor, so chunks are kept sorted along dim 0 (one index per tensor, remembered by the
    identity of its chunks) and found by bisection."""
    if len(chunks) < _INDEX_FROM:
        return chunks
    known = _index.get(id(chunks))
    if known is None or known[0] is not chunks:
        if len(_index) >= _INDEX_LIMIT:
            _index.clear()
        order = sorted(chunks, key=lambda c: c.offsets[0])  # stable: replicas keep their order
        known = _index[id(chunks)] = (chunks, [c.offsets[0] for c in order], order, max(c.sizes[0] for c in order))
    _, starts, order, tallest = known
    return order[bisect.bisect_left(starts, offset - tallest + 1):bisect.bisect_left(starts, offset + size)]


def plan_copies(region: Region) -> tuple[Copy, ...]:
    """Source byte ranges that make up ``region`` (in the entry's own dtype), coalesced, ordered by ``dst``."""
    if region.entry.rows is not None:
        return gather_copies(region)
    entry, ro, rs = region.entry, region.offsets, region.sizes
    isz, n = entry.dtype.itemsize, len(entry.shape)
    if math.prod(rs) == 0:
        return ()
    rstrides = row_major(rs)
    copies: list[Copy] = []
    seen: set[tuple] = set()
    # Whole rows of the tensor (a Shard(0) region): a chunk of whole rows gives one run, its rows in the region.
    rows = n and rs[1:] == entry.shape[1:]
    row = math.prod(rs[1:]) * isz
    for c in (_candidates(entry.chunks, ro[0], rs[0]) if n else entry.chunks):
        box = (c.offsets, c.sizes)
        if box in seen:  # a replica (HSDP without de-duplication): the first copy serves
            continue
        seen.add(box)
        if rows and c.strides is None and c.sizes[1:] == rs[1:]:
            a, b = max(ro[0], c.offsets[0]), min(ro[0] + rs[0], c.offsets[0] + c.sizes[0])
            if a < b:
                copies.append(Copy(Span(c.span.file, c.span.offset + (a - c.offsets[0]) * row, (b - a) * row),
                                   (a - ro[0]) * row))
            continue
        lo = tuple(max(r_off, c_off) for r_off, c_off in zip(ro, c.offsets, strict=True))
        hi = tuple(min(r_off + r_size, c_off + c_size)
                   for r_off, r_size, c_off, c_size in zip(ro, rs, c.offsets, c.sizes, strict=True))
        if any(high <= low for low, high in zip(lo, hi, strict=True)):
            continue
        isizes = tuple(high - low for low, high in zip(lo, hi, strict=True))
        cstrides = c.strides or row_major(c.sizes)
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
        if k == 1:  # runs are rows (columns of a 2-D tensor, a Shard(1) chunk): no index tuples
            src, step_src = c.span.offset + (base_src + (lo[0] - c.offsets[0]) * cstrides[0]) * isz, cstrides[0] * isz
            dst, step_dst = (base_dst + (lo[0] - ro[0]) * rstrides[0]) * isz, rstrides[0] * isz
            copies += [Copy(Span(c.span.file, src + i * step_src, run), dst + i * step_dst)
                       for i in range(hi[0] - lo[0])]
            continue
        for idx in itertools.product(*(range(lo[d], hi[d]) for d in range(k))):
            s = base_src + sum((i - c.offsets[d]) * cstrides[d] for d, i in enumerate(idx))
            t = base_dst + sum((i - ro[d]) * rstrides[d] for d, i in enumerate(idx))
            copies.append(Copy(Span(c.span.file, c.span.offset + s * isz, run), t * isz))
    copies.sort(key=lambda cp: cp.dst)
    merged: list[Copy] = []
    for cp in copies:
        last = merged[-1] if merged else None
        if (last and last.src.file == cp.src.file and last.src.offset + last.src.length == cp.src.offset
                and last.dst + last.src.length == cp.dst):
            merged[-1] = Copy(Span(cp.src.file, last.src.offset, last.src.length + cp.src.length), last.dst)
        else:
            merged.append(cp)
    covered = sum(cp.src.length for cp in merged)
    if covered != math.prod(rs) * isz:
        raise IncompleteCheckpointError(
            f"tensor {entry.key!r}: chunks supply {covered} of the {math.prod(rs) * isz} bytes of box "
            f"{list(ro)}+{list(rs)} (a rank file or chunk is missing)")
    return tuple(merged)


def row_runs(rows: tuple[int, ...], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Rows ``[start, stop)`` of a gather as ``(first, end, source first)`` runs whose source rows follow on."""
    runs: list[tuple[int, int, int]] = []
    for i in range(start, stop):
        if runs and rows[i] == runs[-1][2] + (i - runs[-1][0]):
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, rows[i]))
    return runs


def gather_copies(region: Region) -> tuple[Copy, ...]:
    """:func:`plan_copies` of a row-gathered entry (:attr:`TensorEntry.rows`): each run of rows whose source
    rows follow on is a box of the source tensor, planned as any box is and moved to its place in the region."""
    entry, ro, rs = region.entry, region.offsets, region.sizes
    if entry.rows is None:
        return plan_copies(region)
    source = dataclasses.replace(entry, rows=None)
    row_bytes = math.prod(rs[1:]) * entry.dtype.itemsize
    copies: list[Copy] = []
    for first, end, src in row_runs(entry.rows, ro[0], ro[0] + rs[0]):
        shift = (first - ro[0]) * row_bytes
        box = Region(source, (src, *ro[1:]), (end - first, *rs[1:]))
        copies += [Copy(c.src, c.dst + shift) for c in plan_copies(box)]
    return tuple(copies)


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


def split_files(files: tuple[FilePlan, ...], n: int) -> tuple[tuple[FilePlan, ...], ...]:
    """``files`` in ``n`` shares of about equal bytes, for ``n`` processes to write one share each.

    The largest file goes first, to the share with the fewest bytes so far (the lowest-numbered on a tie);
    within a share, files keep their order in ``files``. The same files give the same shares in every
    process, which is what lets ranks that plan on their own agree on who writes what.
    """
    if n < 1:
        raise ValueError(f"cannot split files over {n} processes")
    loads = [(0, i) for i in range(n)]
    shares: list[list[int]] = [[] for _ in range(n)]
    for index in sorted(range(len(files)), key=lambda i: -files[i].nbytes):
        nbytes, share = heapq.heappop(loads)
        shares[share].append(index)
        heapq.heappush(loads, (nbytes + files[index].nbytes, share))
    return tuple(tuple(files[i] for i in sorted(share)) for share in shares)

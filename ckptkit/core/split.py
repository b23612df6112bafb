"""A write plan cut into shares for several writers: whole files, and large files cut into byte ranges.

The byte layout of every output file is fixed by its plan (framing is :class:`~.plan.Bytes`, a tensor
:class:`~.plan.Region` has a known size), so bytes ``[a, b)`` of a file can be written by one process while
another writes ``[b, c)``: each writes its ranges at their offsets into a file made at its full size
beforehand. Nothing here opens a file, and the same plan and count give the same shares in every process,
which lets ranks that plan on their own agree on who writes what.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .manifest import TensorEntry
from .plan import FilePlan, Part, Region, row_blocks

__all__ = ["MIN_PIECE", "Slice", "Work", "by_tensor", "choose_writers", "cut", "seconds", "shares_inputs",
           "split_work"]

MIN_PIECE = 32 << 20
"""Bytes below which a file is not cut: each piece costs its writer an open and a few system calls."""
_COPY_RATE = 2e9
"""Bytes a second that one writer moves from a warm page cache (kernel-side copies; ``cp`` runs at 2-3.5 GB/s)."""
_PER_REGION = 5e-6
"""Seconds of a tensor region's cost that another writer takes over: its reads and writes. Its planning stays
with the process that packs it (:mod:`ckptkit.io.moves`), so a plan of many small chunks gains less from
more writers than its bytes suggest."""
_START = 0.4
"""Seconds that writing with workers costs before a byte moves: starting an interpreter that imports ckptkit
(in parallel, one per worker) and packing the shares (in this process)."""
_WRITER_SECONDS = 0.2
"""The least estimated writing each writer should get: below it, more of them only share the same memory
bandwidth."""
_MARGIN = 0.85
"""More than one writer only where the estimate says they finish in this fraction of one writer's time: the
estimate is rough, and a shared machine's other work takes cores from them."""
_PIECES_PER_WRITER = 4
"""A large file is cut into pieces of about a quarter of a writer's share, so that pieces of uneven size
(a cut falls between tensors) still balance out."""


@dataclass(frozen=True, slots=True)
class Slice:
    """Bytes ``[start, start + nbytes)`` of output file ``relpath``: ``parts`` laid end to end from ``start``."""

    relpath: str
    start: int
    parts: tuple[Part, ...]
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum([p.nbytes for p in self.parts]))


def cut(fp: FilePlan, size: int) -> list[Slice]:
    """``fp`` as consecutive slices of at most about ``size`` bytes each.

    A cut falls between parts; a tensor region larger than ``size`` is first cut along dim 0 into boxes of
    whole rows (their row-major bytes are consecutive ranges of the region's), framing bytes are never cut.

    Args:
        fp: the file's plan.
        size: the most bytes a slice should hold (a single part or row larger than it makes a larger slice).

    Returns:
        Slices covering ``[0, fp.nbytes)`` in order, none empty unless the file is.

    Raises:
        ValueError: ``size`` is below 1.
    """
    if size < 1:
        raise ValueError(f"cannot cut a file into slices of {size} bytes")
    slices: list[Slice] = []
    held: list[Part] = []
    start = pos = 0
    for part in fp.parts:
        pieces = row_blocks(part, size) if isinstance(part, Region) and part.nbytes > size else [part]
        for piece in pieces:
            if held and pos - start + piece.nbytes > size:
                slices.append(Slice(fp.relpath, start, tuple(held)))
                held, start = [], pos
            held.append(piece)
            pos += piece.nbytes
    if held or not slices:
        slices.append(Slice(fp.relpath, start, tuple(held)))
    return slices


def split_work(files: tuple[FilePlan, ...], n: int, *, cut_files: bool = True,
               min_piece: int | None = None) -> tuple[tuple[Slice, ...], ...]:
    """``files`` in ``n`` shares of about equal work, for ``n`` processes to write one share each.

    With ``cut_files``, a file that computes tensors from one input apart (:func:`shares_inputs`) is shared out
    tensor by tensor (:func:`by_tensor`); any other file larger than a writer's share (and than ``min_piece``)
    is cut (:func:`cut`) into pieces of about a quarter of a share, and a smaller file goes whole. A piece's
    work is its bytes, and the computation of its computed tensors (:func:`seconds`, as bytes copied in that
    time). The largest piece goes first, to the share with the least work so far (the lowest-numbered on a
    tie); within a share, pieces keep their order in ``files`` and in their file (an FP8 weight's values
    before its scales).

    Args:
        files: the plan's files.
        n: how many writers.
        cut_files: whether a file may be written by several writers (each its own byte ranges).
        min_piece: the fewest bytes a cut piece is made of (default :data:`MIN_PIECE`).

    Returns:
        ``n`` tuples of slices (some empty where there is less to write than writers), which together cover
        every byte of every file exactly once.

    Raises:
        ValueError: ``n`` is below 1.
    """
    if n < 1:
        raise ValueError(f"cannot split files over {n} processes")
    min_piece = MIN_PIECE if min_piece is None else min_piece
    share = -(-sum(f.nbytes for f in files) // n)
    piece = max(min_piece, -(-share // _PIECES_PER_WRITER), 1)
    most = sum(_work(Slice(f.relpath, 0, f.parts)) for f in files) / n / _PIECES_PER_WRITER
    pieces: list[tuple[int, tuple[Slice, ...]]] = []
    for index, fp in enumerate(files):
        if cut_files and shares_inputs(fp):
            pieces += [(index, group) for group in _tensor_pieces(fp, most, piece)]
            continue
        whole = not cut_files or fp.nbytes <= max(share, min_piece)
        pieces += [(index, (s,)) for s in ([Slice(fp.relpath, 0, fp.parts)] if whole else cut(fp, piece))]
    work = [sum(_work(s) for s in group) for _, group in pieces]
    loads: list[tuple[float, int]] = [(0.0, i) for i in range(n)]
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(pieces)), key=lambda i: -work[i]):
        load, which = heapq.heappop(loads)
        shares[which].append(i)
        heapq.heappush(loads, (load + work[i], which))
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i][0], min(s.start for s in pieces[i][1])))
    rank = {i: r for r, i in enumerate(order)}
    return tuple(tuple(s for i in sorted(share, key=rank.__getitem__) for s in pieces[i][1]) for share in shares)


def by_tensor(fp: FilePlan) -> list[tuple[Slice, ...]]:
    """``fp`` as groups of slices, one group for each tensor computed from another and one for each run of
    other parts between them. An FP8 weight's values and its scales, both computed from the weight, are one
    group, the values first: the process that writes both reads the weight once, and computes its tile scales
    as it quantizes it."""
    groups: dict[object, list[Slice]] = {}
    pos, run = 0, 0
    for part in fp.parts:
        derived = part.entry.derived if isinstance(part, Region) else None
        if derived is None:
            key: object = ("run", run)
        else:
            run += 1
            key = derived.inputs[0] if derived.op in _SHARE_INPUT and derived.inputs else ("part", pos)
        group = groups.setdefault(key, [])
        if group and group[-1].start + group[-1].nbytes == pos:  # adjacent: one slice
            group[-1] = Slice(fp.relpath, group[-1].start, (*group[-1].parts, part))
        else:
            group.append(Slice(fp.relpath, pos, (part,)))
        pos += part.nbytes
    # An FP8 weight's scales are computed with its values, from the same read of the weight: written after them.
    return [tuple(sorted(g, key=_scales_last)) for g in groups.values()]


def _scales_last(piece: Slice) -> bool:
    return any(isinstance(p, Region) and p.entry.derived is not None and p.entry.derived.op == "fp8_scale"
               for p in piece.parts)


def _tensor_pieces(fp: FilePlan, most: float, piece: int) -> list[tuple[Slice, ...]]:
    """:func:`by_tensor`'s groups of ``fp``, any group of more than ``most`` work (about a quarter of a
    writer's) cut into slices of about ``piece`` bytes (:func:`cut`), so that one large tensor is still shared
    out."""
    out: list[tuple[Slice, ...]] = []
    for group in by_tensor(fp):
        if sum(_work(s) for s in group) <= most:
            out.append(group)
            continue
        out += [(Slice(s.relpath, s.start + c.start, c.parts),) for s in group
                for c in cut(FilePlan(s.relpath, s.parts), piece)]
    return out


_SHARE_INPUT = ("quant_fp8", "fp8_scale")
"""Computations whose outputs read the same input (an FP8 weight's values and its tile scales)."""


def shares_inputs(fp: FilePlan) -> bool:
    """Whether ``fp`` computes tensors from one input apart (an FP8 weight's values and its scales), which
    :func:`by_tensor` keeps together."""
    return any(isinstance(p, Region) and p.entry.derived is not None and p.entry.derived.op in _SHARE_INPUT
               for p in fp.parts)
_SECONDS_PER_ELEMENT = {"quant_fp8": 4e-9, "fp8_scale": 1e-9, "dequant_fp8": 1.5e-9, "dequant_mxfp4": 3e-9}
"""About what a computed tensor costs per element read, on one core of a machine like the bench's, beyond
copying its bytes; other computations move elements only."""
_MOVE_SECONDS = 0.5e-9


def seconds(part: Part) -> float:
    """About what writing ``part`` costs one writer: its bytes at a kernel copy's speed, and for a computed
    tensor its computation (an FP8 tile scale reads the whole tile)."""
    copy = part.nbytes / _COPY_RATE
    if not isinstance(part, Region) or part.entry.derived is None:
        return copy
    return copy + part.nbytes // max(1, part.dtype.itemsize) * _per_element(part.entry)


def _per_element(entry: TensorEntry) -> float:
    """Seconds per element of computing ``entry``: its computation's, and its computed inputs' (the most)."""
    derived = entry.derived
    if derived is None:
        return 0.0
    own = _SECONDS_PER_ELEMENT.get(derived.op, _MOVE_SECONDS)
    if derived.op == "fp8_scale":  # a scale reads its whole tile
        own *= derived.block * derived.block
    return own + max((_per_element(i) for i in derived.inputs), default=0.0)


def _work(piece: Slice) -> float:
    """A piece's work in bytes copied in the same time."""
    return sum(seconds(p) for p in piece.parts) * _COPY_RATE


@dataclass(frozen=True, slots=True)
class Work:
    """What a plan asks of its writers, in the numbers that :func:`choose_writers` weighs."""

    nbytes: int
    regions: int
    """Tensor regions: each costs a writer some planning and a system call or two besides its bytes."""
    files: int
    pieces: int
    """The most writers the plan can be shared between: its files, or with files cut, pieces of
    :data:`MIN_PIECE` bytes (or computed tensors, where there are more of those)."""
    compute: float = 0.0
    """Seconds of computation beyond the copying (computed tensors: :func:`seconds`)."""

    @classmethod
    def of(cls, files: tuple[FilePlan, ...], *, cut_files: bool = True) -> Work:
        nbytes = sum(f.nbytes for f in files)
        regions = sum(isinstance(p, Region) for f in files for p in f.parts)
        computed = [p for f in files for p in f.parts if isinstance(p, Region) and p.entry.derived is not None]
        compute = sum(seconds(p) - p.nbytes / _COPY_RATE for p in computed)
        pieces = max(-(-nbytes // MIN_PIECE), len(computed)) if cut_files else sum(f.nbytes > 0 for f in files)
        return cls(nbytes, regions, len(files), pieces, compute)


def choose_writers(work: Work, cores: int) -> tuple[int, str]:
    """How many writers pay for ``work`` on a machine of ``cores`` usable cores, and why, in words.

    The work is estimated from the plan alone: its bytes at a kernel copy's speed, plus a little per tensor
    region. ``n`` writers take it in ``seconds / n`` after a start of :data:`_START`; the fastest ``n`` is
    chosen, each writer with at least :data:`_WRITER_SECONDS` of it, never more than ``cores`` nor than the
    pieces to write, and more than one only where they finish within :data:`_MARGIN` of one writer's time.

    Args:
        work: the plan's numbers (:meth:`Work.of`).
        cores: the cores this process may run on.

    Returns:
        The number of writers (1 or more) and the reason, for the report.
    """
    seconds = work.nbytes / _COPY_RATE + work.regions * _PER_REGION + work.compute
    most = max(1, min(cores, work.pieces, int(seconds / _WRITER_SECONDS)))
    n = min(range(1, most + 1), key=lambda k: seconds / k + _START * (k > 1))
    what = (f"{work.nbytes / 1e9:.2f} GB in {work.files} file{'s' * (work.files != 1)}, {work.regions} tensor "
            f"region{'s' * (work.regions != 1)}: about {seconds:.1f} s of writing")
    if n > 1 and seconds / n + _START <= _MARGIN * seconds:
        return n, f"{what}, about {seconds / n + _START:.1f} s with {n} of {cores} cores"
    if cores < 2:
        return 1, f"one core ({what})"
    return 1, f"{what}: too little for a second process to pay for its start"

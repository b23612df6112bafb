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

from .plan import FilePlan, Part, Region, row_blocks

__all__ = ["MIN_PIECE", "Slice", "cut", "split_work"]

MIN_PIECE = 32 << 20
"""Bytes below which a file is not cut: each piece costs its writer an open and a few system calls."""
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
               min_piece: int = MIN_PIECE) -> tuple[tuple[Slice, ...], ...]:
    """``files`` in ``n`` shares of about equal bytes, for ``n`` processes to write one share each.

    With ``cut_files``, a file larger than a writer's share (and than ``min_piece``) is cut (:func:`cut`)
    into pieces of about a quarter of a share; a smaller file goes whole. The largest piece goes first, to
    the share with the fewest bytes so far (the lowest-numbered on a tie); within a share, pieces keep their
    order in ``files`` and in their file.

    Args:
        files: the plan's files.
        n: how many writers.
        cut_files: whether a file may be written by several writers (each its own byte ranges).
        min_piece: the fewest bytes a cut piece is made of.

    Returns:
        ``n`` tuples of slices (some empty where there is less to write than writers), which together cover
        every byte of every file exactly once.

    Raises:
        ValueError: ``n`` is below 1.
    """
    if n < 1:
        raise ValueError(f"cannot split files over {n} processes")
    share = -(-sum(f.nbytes for f in files) // n)
    piece = max(min_piece, -(-share // _PIECES_PER_WRITER), 1)
    pieces: list[tuple[int, Slice]] = []
    for index, fp in enumerate(files):
        whole = not cut_files or fp.nbytes <= max(share, min_piece)
        pieces += [(index, s) for s in ([Slice(fp.relpath, 0, fp.parts)] if whole else cut(fp, piece))]
    loads = [(0, i) for i in range(n)]
    shares: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(pieces)), key=lambda i: -pieces[i][1].nbytes):
        nbytes, which = heapq.heappop(loads)
        shares[which].append(i)
        heapq.heappush(loads, (nbytes + pieces[i][1].nbytes, which))
    return tuple(tuple(pieces[i][1] for i in sorted(share)) for share in shares)

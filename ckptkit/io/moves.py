"""Byte moves: a slice of an output file as the reads and writes that make it, in the order the writer runs them.

:func:`units` turns parts (framing bytes, tensor regions) into units of work for the executor's writer: bytes
to write, source ranges to read into the write buffer, source ranges to copy kernel-side, a region to cast.
A worker process that writes its share of a plan needs nothing more: :func:`pack` lays a slice's units into
arrays of integers, which reach a worker in a fraction of the time a pickle of the plan's objects (regions,
their tensors' every chunk) takes, and :meth:`Moves.units` reads them back. The planning stays in the process
that planned.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ..core.manifest import Span
from ..core.plan import Bytes, Part, Region, Strided, plan_strided, row_blocks
from ..core.split import Slice

__all__ = ["CastBlock", "Literal", "Moves", "Read", "Unit", "pack", "units"]

KERNEL_COPY = 1 << 20
"""Bytes from which a copy moves kernel-side rather than through the write buffer."""


class Literal(NamedTuple):
    """Bytes the plan holds (framing), written at byte ``dst`` of the file."""

    dst: int
    data: bytes | memoryview


class Read(NamedTuple):
    """``nbytes`` of tensor ``key`` at byte ``dst`` of the file, from source ranges ``pieces`` (their ``dst``
    relative to this unit's): read into the write buffer, or with ``kernel`` copied file to file."""

    dst: int
    nbytes: int
    key: str
    pieces: tuple[Strided, ...]
    kernel: bool


class CastBlock(NamedTuple):
    """A region whose bytes are cast to another dtype, or computed (:mod:`.compute`), on the way, written at
    byte ``dst`` of the file."""

    dst: int
    region: Region


Unit = Literal | Read | CastBlock


def units(parts: tuple[Part, ...], start: int, cap: int) -> Iterator[Unit]:
    """The units that write ``parts`` laid end to end from byte ``start``. A region whose source ranges are
    all large (at least :data:`KERNEL_COPY` bytes, whole rows) is one kernel-side copy; any other is read
    into the write buffer, in boxes of whole rows of at most ``cap`` bytes."""
    pos = start
    held: list[bytes] = []  # framing bytes that follow one another (a chunk's tail, the next one's head): one unit
    for part in parts:
        if isinstance(part, Bytes):
            held.append(part.data)
            continue
        if held:
            data = held[0] if len(held) == 1 else b"".join(held)
            yield Literal(pos, data)
            pos += len(data)
            held.clear()
        if part.entry.derived is not None or (part.cast is not None and part.cast != part.entry.dtype):
            yield CastBlock(pos, part)
        else:
            yield from _reads(part, pos, cap)
        pos += part.nbytes
    if held:
        yield Literal(pos, held[0] if len(held) == 1 else b"".join(held))


def _reads(region: Region, pos: int, cap: int) -> Iterator[Read]:
    key = region.entry.key
    pieces = plan_strided(region)
    if pieces and all(s.rows == 1 and s.src.length >= KERNEL_COPY for s in pieces):
        yield Read(pos, region.nbytes, key, pieces, True)
    elif region.nbytes <= cap:
        yield Read(pos, region.nbytes, key, pieces, False)
    else:
        for block in row_blocks(region, cap):
            yield Read(pos, block.nbytes, key, plan_strided(block), False)
            pos += block.nbytes


_LITERAL, _BUFFERED, _KERNEL, _CAST = range(4)
_PIECE = 7  # ints per piece: source name, offset, length, dst, rows, src_step, dst_step


@dataclass(frozen=True)
class Moves:
    """A slice's units, packed: ``table`` holds per unit ``kind, dst, nbytes, ref, pieces`` then each piece's
    :data:`_PIECE` ints, ``ref`` indexing ``data`` (literal bytes), ``names`` (a read's key) or ``casts``;
    a piece's source file is an index into ``names``."""

    relpath: str
    start: int
    nbytes: int
    names: tuple[str, ...]
    table: array
    data: bytes
    casts: tuple[Region, ...]

    def units(self) -> Iterator[Unit]:
        t, names, data = self.table.tolist(), self.names, memoryview(self.data)
        i, end = 0, len(t)
        while i < end:
            kind, dst, nbytes, ref, count = t[i:i + 5]
            i += 5
            if kind == _LITERAL:
                yield Literal(dst, data[ref:ref + nbytes])
            elif kind == _CAST:
                yield CastBlock(dst, self.casts[ref])
            else:
                pieces = tuple(Strided(Span(names[t[j]], t[j + 1], t[j + 2]), *t[j + 3:j + _PIECE])
                               for j in range(i, i + count * _PIECE, _PIECE))
                i += count * _PIECE
                yield Read(dst, nbytes, names[ref], pieces, kind == _KERNEL)


def pack(piece: Slice, cap: int) -> Moves:
    """``piece``'s :func:`units` packed for a worker process (see :class:`Moves`)."""
    table: list[int] = []
    data = bytearray()
    names: dict[str, int] = {}
    casts: list[Region] = []
    for u in units(piece.parts, piece.start, cap):
        if isinstance(u, Literal):
            table += (_LITERAL, u.dst, len(u.data), len(data), 0)
            data += u.data
        elif isinstance(u, CastBlock):
            table += (_CAST, u.dst, u.region.nbytes, len(casts), 0)
            casts.append(u.region)
        else:
            table += (_KERNEL if u.kernel else _BUFFERED, u.dst, u.nbytes, names.setdefault(u.key, len(names)),
                      len(u.pieces))
            for s in u.pieces:
                src = s.src
                table += (names.setdefault(src.file, len(names)), src.offset, src.length, s.dst, s.rows, s.src_step,
                          s.dst_step)
    return Moves(piece.relpath, piece.start, piece.nbytes, tuple(names), array("q", table), bytes(data), tuple(casts))

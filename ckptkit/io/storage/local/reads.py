"""Local source reads: descriptors read with ``pread`` and ``preadv``, small reads read ahead, the rows of a
strided piece read straight into their places."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol

from ....core.plan import Strided
from ....errors import FormatError

__all__ = ["Descriptors", "ReadAhead", "pread_exact", "pread_into", "read_into"]


class Descriptors(Protocol):
    """Where :func:`read_into` gets a file's descriptor: :class:`ckptkit.io.sources.Files`, which checks the
    file holds the bytes asked for (declared here so that this module need not import the sources above it)."""

    def fd(self, path: str, need_end: int, *, start: int = 0, key: str = "") -> int: ...


class ReadAhead:
    """``os.pread`` of one local file that reads ahead when small reads follow one another.

    A DCP reader reads each chunk's archive (a kilobyte or two for a small chunk), those of one ``.distcp``
    file in order but between those of the other files: a read of :attr:`BLOCK` bytes that serves the next
    few costs one system call instead of one each. Only a read that starts where the last one ended
    reads ahead a block, so the reads of a large chunk's headers around its data read no data; any other
    small read takes :attr:`NEXT` bytes more, which hold the next archive's head where the read is an
    archive's tail (a chunk of tens of KiB: one system call per chunk instead of two)."""

    BLOCK = 16 << 10  # a dozen small archives a read; what it holds per file (64 MiB for 4096 rank files)
    SMALL = 16 << 10
    NEXT = 4 << 10  # a chunk archive's head: its local header and data.pkl, a few hundred bytes

    __slots__ = ("fd", "size", "data", "start", "end")

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.data, self.start, self.end = b"", 0, -1  # the block read ahead, where it starts; where the last read ended

    def pread(self, n: int, offset: int) -> bytes:
        at = offset - self.start
        if at >= 0 and at + n <= len(self.data):
            self.end = offset + n
            return self.data[at:at + n]
        if n <= self.SMALL:
            self.data = os.pread(self.fd, max(n, self.BLOCK) if offset == self.end else n + self.NEXT, offset)
            self.start = offset
            if n <= len(self.data):
                self.end = offset + n
                return self.data[:n]
        self.end = offset + n
        return os.pread(self.fd, n, offset)


def pread_exact(fd: int, start: int, end: int, path: str) -> bytes | bytearray:
    data = os.pread(fd, end - start, start)
    if len(data) == end - start:
        return data
    buf = bytearray(end - start)  # a short read: the rest, or the error naming where the file ended
    pread_into(fd, memoryview(buf), start, path)
    return buf


def pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise FormatError(f"{path}: unexpected end of file at offset {offset}")
        view, offset = view[n:], offset + n


_IOV_MAX = 1024  # buffers one preadv takes (Linux's UIO_MAXIOV)
_SKIP = 64 << 10  # bytes between strided rows read into a scratch buffer rather than making a read per row


def read_into(view: memoryview, pieces: Iterable[Strided], files: Descriptors, key: str) -> None:
    """Read ``pieces`` (of a region whose bytes ``view`` is) from local files into their places in ``view``.

    The rows of a strided piece (a chunk's columns of a ``Shard(1)`` tensor) are read straight into their
    places, one ``preadv`` for up to :data:`_IOV_MAX` of them: where the chunk holds only those columns its
    rows follow one another in the file; where it holds more, the bytes between them go to a scratch buffer."""
    for s in pieces:
        src, run = s.src, s.src.length
        if s.rows == 1:
            fd = files.fd(src.file, src.offset + run, start=src.offset, key=key)
            to = view[s.dst:s.dst + run]
            if os.preadv(fd, [to], src.offset) != run:  # a short read: the rest, or where the file ended
                pread_into(fd, to, src.offset, src.file)
            continue
        fd = files.fd(src.file, src.offset + (s.rows - 1) * s.src_step + run, start=src.offset, key=key)
        gap = s.src_step - run
        if not 0 <= gap <= _SKIP:  # rows far apart (or shared, an expanded tensor's): a read each
            for cp in s.copies():
                pread_into(fd, view[cp.dst:cp.dst + run], cp.src.offset, src.file)
            continue
        scratch = memoryview(bytearray(gap))
        per_call = _IOV_MAX if gap == 0 else _IOV_MAX // 2
        for first in range(0, s.rows, per_call):
            last = min(first + per_call, s.rows)
            iov = []
            for i in range(first, last):
                at = s.dst + i * s.dst_step
                iov.append(view[at:at + run])
                if gap and i + 1 < last:
                    iov.append(scratch)
            offset = src.offset + first * s.src_step
            want = (last - first) * run + (last - first - 1) * gap
            got = os.preadv(fd, iov, offset)
            if got != want:  # a short read: row by row, for the rest or the error naming where the file ended
                for cp in s.copies()[first:last]:
                    pread_into(fd, view[cp.dst:cp.dst + run], cp.src.offset, src.file)


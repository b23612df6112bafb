"""Source bytes: read-only descriptors opened once each, and the row-major bytes of a region read from them.

A source named by URL (a checkpoint on an object store) is read through :class:`~.remote.RemoteFiles` instead:
:meth:`Files.pread`, :meth:`Files.read` and :func:`read_region` take either; :meth:`Files.fd` is local only.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator

from ..core.plan import Copy, Region, Strided, plan_strided
from ..errors import FormatError
from .compute import compute_region
from .remote import PIECE, Range, RemoteFiles, bounds_error, coalesce, is_url

__all__ = ["Files", "opened", "read_into", "read_region"]


class Files:
    """Read-only descriptors of source files, opened once each, with sizes checked against every read.

    ``remote`` shares one :class:`RemoteFiles` (its pool of requests) between several ``Files``."""

    def __init__(self, remote: RemoteFiles | None = None) -> None:
        self._fds: dict[str, tuple[int, int]] = {}
        self._ahead: dict[str, _ReadAhead] = {}
        self._remote, self._own_remote = remote, remote is None

    def fd(self, path: str, need_end: int, *, start: int = 0, key: str = "") -> int:
        """The descriptor of ``path``, which must hold bytes ``[start, need_end)`` (read for ``key``)."""
        if path not in self._fds:
            if is_url(path):
                raise FormatError(f"{path}: a URL has no file descriptor; read it with Files.pread or Files.read")
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise FormatError(f"{path}: cannot open ({e.strerror})") from e
            self._fds[path] = (fd, os.fstat(fd).st_size)
        fd, size = self._fds[path]
        if 0 <= start <= need_end <= size:
            return fd
        raise bounds_error(path, key, start, need_end, size)

    def size(self, path: str) -> int:
        """The size of ``path`` (local or URL)."""
        if is_url(path):
            return self.remote.size(path)
        self.fd(path, 0)
        return self._fds[path][1]

    @property
    def remote(self) -> RemoteFiles:
        if self._remote is None:
            self._remote = RemoteFiles()
        return self._remote

    def pread(self, path: str, need_end: int, *, start: int = 0, key: str = "") -> Callable[[int, int], bytes]:
        """``os.pread`` bound to ``path`` (local or URL), which must hold bytes ``[start, need_end)``.

        A local file's small reads that follow one another (the chunk archives of a ``.distcp`` file) are served
        from one read ahead (:class:`_ReadAhead`)."""
        ahead = self._ahead.get(path)
        if ahead is not None and 0 <= start <= need_end <= ahead.size:
            return ahead.pread
        if is_url(path):
            return self.remote.pread(path, need_end, start, key)
        fd = self.fd(path, need_end, start=start, key=key)
        ahead = self._ahead[path] = _ReadAhead(fd, self._fds[path][1])
        return ahead.pread

    def read(self, path: str, offset: int, length: int, *, key: str = "") -> bytes:
        """``length`` bytes of ``path`` (local or URL) from ``offset``."""
        if is_url(path):
            return self.remote.read(path, offset, length, key)
        fd = self.fd(path, offset + length, start=offset, key=key)
        parts = []
        while length > 0:
            data = os.pread(fd, length, offset)
            if not data:
                raise FormatError(f"{path}: unexpected end of file at offset {offset}")
            parts.append(data)
            offset, length = offset + len(data), length - len(data)
        return b"".join(parts)

    def job(self, path: str, start: int, end: int, *, key: str = "") -> Callable[[], bytes | bytearray]:
        """A function that reads bytes ``[start, end)`` of ``path`` (local or URL) from any thread; the span is
        checked against the file here, in the caller's."""
        if is_url(path):
            self.remote.check(path, start, end, key)
            return functools.partial(RemoteFiles.get, path, start, end)
        return functools.partial(_pread_exact, self.fd(path, end, start=start, key=key), start, end, path)

    def expect(self, ranges: Iterable[Range]) -> None:
        """Announce the reads to come, in order, so that remote ones are fetched ahead (local ones need not)."""
        ranges = iter(ranges)
        first = next(ranges, None)
        if first is not None and is_url(first[0]):
            self.remote.expect(_chain(first, ranges))

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._ahead.clear()
        if self._remote is not None and self._own_remote:
            self._remote.close()

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ReadAhead:
    """``os.pread`` of one local file that reads ahead when small reads follow one another.

    A DCP reader reads each chunk's archive (a kilobyte or two for a small chunk), those of one ``.distcp``
    file in order but between those of the other files: a read of :attr:`BLOCK` bytes that serves the next
    few costs one system call instead of one each. Only a read that starts where the last one ended
    reads ahead, so the reads of a large chunk's headers around its data read no data."""

    BLOCK = 16 << 10  # a dozen small archives a read; what it holds per file (64 MiB for 4096 rank files)
    SMALL = 16 << 10

    __slots__ = ("fd", "size", "data", "start", "end")

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.data, self.start, self.end = b"", 0, -1  # the block read ahead, where it starts; where the last read ended

    def pread(self, n: int, offset: int) -> bytes:
        at = offset - self.start
        if at >= 0 and at + n <= len(self.data):
            self.end = offset + n
            return self.data[at:at + n]
        if offset == self.end and n <= self.SMALL:
            self.data, self.start = os.pread(self.fd, max(n, self.BLOCK), offset), offset
            if n <= len(self.data):
                self.end = offset + n
                return self.data[:n]
        self.end = offset + n
        return os.pread(self.fd, n, offset)


def _pread_exact(fd: int, start: int, end: int, path: str) -> bytes | bytearray:
    data = os.pread(fd, end - start, start)
    if len(data) == end - start:
        return data
    buf = bytearray(end - start)  # a short read: the rest, or the error naming where the file ended
    _pread_into(fd, memoryview(buf), start, path)
    return buf


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise FormatError(f"{path}: unexpected end of file at offset {offset}")
        view, offset = view[n:], offset + n


@contextlib.contextmanager
def opened(path: str) -> Iterator[tuple[Callable[[int, int], bytes], int]]:
    """``os.pread`` of ``path`` (local or URL) and its size, for one reader; a local file is open for the block."""
    if is_url(path):
        remote = RemoteFiles()
        try:
            yield remote.pread(path, 0), remote.size(path)
        finally:
            remote.close()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        yield functools.partial(os.pread, fd), os.fstat(fd).st_size
    finally:
        os.close(fd)


def _chain(first: Range, rest: Iterable[Range]) -> Iterable[Range]:
    yield first
    yield from rest


def read_region(region: Region, files: Files) -> bytearray:
    """The row-major bytes of ``region`` in the entry's dtype (``region.cast`` is not applied here); a computed
    entry's (:mod:`.compute`) are computed from its inputs'."""
    if region.entry.derived is not None:
        return bytearray(compute_region(region, lambda box: read_region(box, files)))
    buf = bytearray(Region(region.entry, region.offsets, region.sizes).nbytes)
    pieces = plan_strided(region)
    if pieces and is_url(pieces[0].src.file):
        _fetch_into(memoryview(buf), [cp for s in pieces for cp in s.copies()], files.remote, region.entry.key)
    else:
        read_into(memoryview(buf), pieces, files, region.entry.key)
    return buf


_IOV_MAX = 1024  # buffers one preadv takes (Linux's UIO_MAXIOV)
_SKIP = 64 << 10  # bytes between strided rows read into a scratch buffer rather than making a read per row


def read_into(view: memoryview, pieces: Iterable[Strided], files: Files, key: str) -> None:
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
                _pread_into(fd, to, src.offset, src.file)
            continue
        fd = files.fd(src.file, src.offset + (s.rows - 1) * s.src_step + run, start=src.offset, key=key)
        gap = s.src_step - run
        if not 0 <= gap <= _SKIP:  # rows far apart (or shared, an expanded tensor's): a read each
            for cp in s.copies():
                _pread_into(fd, view[cp.dst:cp.dst + run], cp.src.offset, src.file)
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
                    _pread_into(fd, view[cp.dst:cp.dst + run], cp.src.offset, src.file)


def _fetch_into(view: memoryview, copies: list[Copy], remote: RemoteFiles, key: str) -> None:
    """The copies' bytes into ``view``, fetched concurrently (``view`` bounds what is in flight)."""
    for cp in copies:
        remote.check(cp.src.file, cp.src.offset, cp.src.offset + cp.src.length, key)
    pieces = [(cp.dst + (start - cp.src.offset), (url, start, end)) for cp in copies
              for url, start, end in coalesce([(cp.src.file, cp.src.offset, cp.src.offset + cp.src.length)], PIECE)]
    for (dst, (_, start, end)), data in zip(pieces, remote.fetch((r for _, r in pieces), max(len(view), 1)),
                                            strict=True):
        view[dst:dst + end - start] = data

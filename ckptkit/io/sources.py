"""Source bytes: read-only descriptors opened once each, and the row-major bytes of a region read from them.

A source named by URL (a checkpoint on an object store) is read through :class:`~.remote.RemoteFiles` instead:
:meth:`Files.pread`, :meth:`Files.read` and :func:`read_region` take either; :meth:`Files.fd` is local only.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator

from ..core.plan import Copy, Region, plan_copies
from ..errors import FormatError
from .remote import PIECE, Range, RemoteFiles, bounds_error, coalesce, is_url

__all__ = ["Files", "opened", "read_region"]


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
    """The row-major bytes of ``region`` in the entry's dtype (``region.cast`` is not applied here).

    Copies whose source bytes follow one another (the rows of one chunk, when the region takes some of its
    columns: a ``Shard(1)`` tensor) are read in one piece and placed from memory: one read per chunk rather
    than one per row."""
    buf = bytearray(Region(region.entry, region.offsets, region.sizes).nbytes)
    view = memoryview(buf)
    copies = plan_copies(region)
    if copies and is_url(copies[0].src.file):
        _fetch_into(view, copies, files.remote, region.entry.key)
        return buf
    runs: list[list[Copy]] = []
    open_runs: dict[tuple[str, int], list[Copy]] = {}  # (file, where the run ends) -> a run a copy there extends
    for cp in sorted(copies, key=lambda cp: (cp.src.file, cp.src.offset)):
        run = open_runs.pop((cp.src.file, cp.src.offset), None)
        if run is None:  # (an expanded tensor's copies share their source bytes: each starts a run of its own)
            run = []
            runs.append(run)
        run.append(cp)
        open_runs[(cp.src.file, cp.src.offset + cp.src.length)] = run
    for run in runs:
        first, last = run[0].src, run[-1].src
        fd = files.fd(first.file, last.offset + last.length, start=first.offset, key=region.entry.key)
        if len(run) == 1:
            _pread_into(fd, view[run[0].dst:run[0].dst + first.length], first.offset, first.file)
            continue
        data = memoryview(bytearray(last.offset + last.length - first.offset))
        _pread_into(fd, data, first.offset, first.file)
        for cp in run:
            at = cp.src.offset - first.offset
            view[cp.dst:cp.dst + cp.src.length] = data[at:at + cp.src.length]
    return buf


def _fetch_into(view: memoryview, copies: tuple[Copy, ...], remote: RemoteFiles, key: str) -> None:
    """The copies' bytes into ``view``, fetched concurrently (``view`` bounds what is in flight)."""
    for cp in copies:
        remote.check(cp.src.file, cp.src.offset, cp.src.offset + cp.src.length, key)
    pieces = [(cp.dst + (start - cp.src.offset), (url, start, end)) for cp in copies
              for url, start, end in coalesce([(cp.src.file, cp.src.offset, cp.src.offset + cp.src.length)], PIECE)]
    for (dst, (_, start, end)), data in zip(pieces, remote.fetch((r for _, r in pieces), max(len(view), 1)),
                                            strict=True):
        view[dst:dst + end - start] = data

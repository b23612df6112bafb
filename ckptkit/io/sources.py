"""Source bytes: read-only descriptors opened once each, and the row-major bytes of a region read from them.

Each source file's storage (:func:`ckptkit.io.storage.storage_for`) is looked up once. A storage whose sources
give descriptors (local files) is read with ``pread``/``preadv``; one whose sources are streamed (an object
store's) through :class:`~ckptkit.io.storage.fsspec.reads.RemoteFiles`: :meth:`Files.pread`, :meth:`Files.read`
and :func:`read_region` take either; :meth:`Files.fd` only the first.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from ..core.plan import Copy, Region, plan_strided
from ..errors import FormatError
from .compute import compute_region
from .storage import storage_for
from .storage.base import bounds_error
from .storage.local.reads import ReadAhead, pread_exact, read_into

if TYPE_CHECKING:  # an object store's reads are imported where one is read
    from .storage.fsspec.reads import Range, RemoteFiles

__all__ = ["Files", "opened", "read_region"]


class Files:
    """Read-only descriptors of source files, opened once each, with sizes checked against every read.

    ``remote`` shares one :class:`RemoteFiles` (its pool of requests) between several ``Files``."""

    def __init__(self, remote: RemoteFiles | None = None) -> None:
        self._fds: dict[str, tuple[int, int]] = {}
        self._ahead: dict[str, ReadAhead] = {}
        self._streamed: dict[str, bool] = {}
        self._remote, self._own_remote = remote, remote is None

    def streamed(self, path: str) -> bool:
        """Whether ``path``'s storage streams it (no descriptors): looked up once per file."""
        streamed = self._streamed.get(path)
        if streamed is None:
            streamed = self._streamed[path] = not storage_for(path).descriptors
        return streamed

    def fd(self, path: str, need_end: int, *, start: int = 0, key: str = "") -> int:
        """The descriptor of ``path``, which must hold bytes ``[start, need_end)`` (read for ``key``)."""
        if path not in self._fds:
            storage = storage_for(path)
            try:
                source = storage.source(path)
            except OSError as e:
                raise FormatError(f"{path}: cannot open ({e.strerror})") from e
            self._fds[path] = (source.fileno(), source.size)
        fd, size = self._fds[path]
        if 0 <= start <= need_end <= size:
            return fd
        raise bounds_error(path, key, start, need_end, size)

    def size(self, path: str) -> int:
        """The size of ``path`` (local or URL)."""
        if self.streamed(path):
            return self.remote.size(path)
        self.fd(path, 0)
        return self._fds[path][1]

    @property
    def remote(self) -> RemoteFiles:
        """The pool that reads streamed sources (made on the first such read)."""
        if self._remote is None:
            from .storage.fsspec.reads import RemoteFiles

            self._remote = RemoteFiles()
        return self._remote

    def pread(self, path: str, need_end: int, *, start: int = 0, key: str = "") -> Callable[[int, int], bytes]:
        """``os.pread`` bound to ``path`` (local or URL), which must hold bytes ``[start, need_end)``.

        A local file's small reads that follow one another (the chunk archives of a ``.distcp`` file) are served
        from one read ahead (:class:`ReadAhead`)."""
        ahead = self._ahead.get(path)
        if ahead is not None and 0 <= start <= need_end <= ahead.size:
            return ahead.pread
        if self.streamed(path):
            return self.remote.pread(path, need_end, start, key)
        fd = self.fd(path, need_end, start=start, key=key)
        ahead = self._ahead[path] = ReadAhead(fd, self._fds[path][1])
        return ahead.pread

    def read(self, path: str, offset: int, length: int, *, key: str = "") -> bytes:
        """``length`` bytes of ``path`` (local or URL) from ``offset``."""
        if self.streamed(path):
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
        if self.streamed(path):
            self.remote.check(path, start, end, key)
            return functools.partial(self.remote.get, path, start, end)
        return functools.partial(pread_exact, self.fd(path, end, start=start, key=key), start, end, path)

    def expect(self, ranges: Iterable[Range]) -> None:
        """Announce the reads to come, in order, so that remote ones are fetched ahead (local ones need not)."""
        ranges = iter(ranges)
        first = next(ranges, None)
        if first is not None and self.streamed(first[0]):
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


@contextlib.contextmanager
def opened(path: str) -> Iterator[tuple[Callable[[int, int], bytes], int]]:
    """``os.pread`` of ``path`` (local or URL) and its size, for one reader; the file is open for the block."""
    storage = storage_for(path)
    if not storage.descriptors:
        with Files() as files:
            yield files.remote.pread(path, 0), files.remote.size(path)
        return
    source = storage.source(path)
    try:
        yield source.pread, source.size
    finally:
        source.close()


def _chain(first: Range, rest: Iterable[Range]) -> Iterable[Range]:
    yield first
    yield from rest


def read_region(region: Region, files: Files) -> bytearray | memoryview:
    """The row-major bytes of ``region`` in the entry's dtype (``region.cast`` is not applied here); a computed
    entry's (:mod:`.compute`) are computed from its inputs', and returned as computed (writable, not copied)."""
    if region.entry.derived is not None:
        return compute_region(region, lambda box: read_region(box, files))
    buf = bytearray(Region(region.entry, region.offsets, region.sizes).nbytes)
    pieces = plan_strided(region)
    if pieces and files.streamed(pieces[0].src.file):
        _fetch_into(memoryview(buf), [cp for s in pieces for cp in s.copies()], files.remote, region.entry.key)
    else:
        read_into(memoryview(buf), pieces, files, region.entry.key)
    return buf


def _fetch_into(view: memoryview, copies: list[Copy], remote: RemoteFiles, key: str) -> None:
    """The copies' bytes into ``view``, fetched concurrently (``view`` bounds what is in flight)."""
    from .storage.fsspec.reads import PIECE, coalesce

    for cp in copies:
        remote.check(cp.src.file, cp.src.offset, cp.src.offset + cp.src.length, key)
    pieces = [(cp.dst + (start - cp.src.offset), (url, start, end)) for cp in copies
              for url, start, end in coalesce([(cp.src.file, cp.src.offset, cp.src.offset + cp.src.length)], PIECE)]
    for (dst, (_, start, end)), data in zip(pieces, remote.fetch((r for _, r in pieces), max(len(view), 1)),
                                            strict=True):
        view[dst:dst + end - start] = data

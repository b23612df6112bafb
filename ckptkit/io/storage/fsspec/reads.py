"""Object stores' reads: a checkpoint's byte spans name their object by URL, and :class:`RemoteFiles` reads
them: ranged GETs, a bounded number in flight, adjacent ranges coalesced, and read-ahead in the order a reader
announces (:meth:`RemoteFiles.expect`), so that 50,000 DCP chunk headers are not 100,000 round trips in a row.
Local bytes never pass through here.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ....errors import FormatError
from ..base import bounds_error
from .paths import calling, filesystem

if TYPE_CHECKING:  # the pool is made on the first remote read: local runs never import it (start-up time)
    from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["PIECE", "REQUESTS", "Job", "Range", "RemoteFiles", "coalesce"]

REQUESTS = 16
"""Range requests in flight at once, per operation."""
PIECE = 8 << 20
"""Largest single range request: big tensors are fetched as several, concurrently."""
_AHEAD = 4 << 20
"""Largest coalesced read-ahead request (:meth:`RemoteFiles.expect`)."""

Range = tuple[str, int, int]
"""(URL, start, end) of bytes to read."""


class Job(NamedTuple):
    """A piece of an output file: ``run()`` gives its ``nbytes`` bytes."""

    nbytes: int
    run: Callable[[], bytes | bytearray | memoryview]
    inline: bool = False
    """Run in the consumer's thread when reached (literal bytes; a cast, whose reads use the pool themselves)."""


def coalesce(ranges: Iterable[Range], limit: int) -> Iterator[Range]:
    """``ranges`` in order, each run of back-to-back ranges of one object joined up to ``limit`` bytes, and
    ranges longer than ``limit`` split."""
    run: Range | None = None
    for url, start, end in ranges:
        if run is not None and run[0] == url and run[2] == start and end - run[1] <= limit:
            run = (url, run[1], end)
            continue
        if run is not None:
            yield run
        while end - start > limit:
            yield url, start, start + limit
            start += limit
        run = (url, start, end)
    if run is not None:
        yield run


class RemoteFiles:
    """Byte ranges of remote objects for one operation: object sizes checked once, range GETs on a bounded
    pool of threads. :meth:`close` stops it. Thread-safe for :meth:`read`, :meth:`fetch` and :meth:`size`."""

    def __init__(self, requests: int = REQUESTS) -> None:
        self.requests = requests
        self._sizes: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._plan: Iterator[Range] = iter(())
        self._ahead: deque[tuple[Range, Future]] = deque()
        self._pool_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the pool (:data:`REQUESTS` threads)."""
        with self._pool_lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.requests, thread_name_prefix="ckptkit-get")
            return self._pool.submit(fn, *args)

    def size(self, url: str) -> int:
        if url not in self._sizes:
            fs, path = filesystem(url)
            with calling(url):
                self._sizes[url] = int(fs.size(path))
        return self._sizes[url]

    def check(self, url: str, start: int, need_end: int, key: str = "") -> None:
        """Refuse a span the object does not hold, as :meth:`Files.fd` refuses one of a local file."""
        size = self.size(url)
        if not 0 <= start <= need_end <= size:
            raise bounds_error(url, key, start, need_end, size)

    @staticmethod
    def get(url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url`` in one GET (unchecked: see :meth:`check`); any thread may call it."""
        fs, path = filesystem(url)
        with calling(url):
            data = fs.cat_file(path, start=start, end=end) if end > start else b""
        if len(data) != end - start:
            raise FormatError(f"{url}: expected {end - start} bytes at offset {start}, the server sent {len(data)} "
                              "(did the object change while it was read?)")
        return cast(bytes, data)

    def read(self, url: str, offset: int, length: int, key: str = "") -> bytes:
        """``length`` bytes of ``url`` from ``offset``, from the read-ahead where announced, else one GET."""
        self.check(url, offset, offset + length, key)
        for i, ((u, start, end), future) in enumerate(self._ahead):
            if u == url and start <= offset and offset + length <= end:
                for _ in range(i):  # skipped: the reader went past them
                    self._ahead.popleft()
                self._fill()
                try:
                    return future.result()[offset - start:offset - start + length]
                except Exception:
                    break  # asked for again below, where the failure is reported as the reader reads
        return self.get(url, offset, offset + length)

    def pread(self, url: str, need_end: int, start: int = 0, key: str = "") -> Callable[[int, int], bytes]:
        """``os.pread`` of ``url`` (length, offset), for readers written against a descriptor."""
        self.check(url, start, need_end, key)
        return lambda n, offset: self.read(url, offset, max(0, min(n, self.size(url) - offset)), key)

    def expect(self, ranges: Iterable[Range]) -> None:
        """Announce the reads to come, in order: they are fetched ahead, :data:`REQUESTS` at a time, joined where
        back to back. Reads outside the announcement are served as they come."""
        self._ahead.clear()
        self._plan = coalesce(ranges, _AHEAD)
        self._fill()

    def _fill(self) -> None:
        while len(self._ahead) < self.requests:
            r = next(self._plan, None)
            if r is None:
                return
            self._ahead.append((r, self.submit(self.get, *r)))

    def fetch(self, ranges: Iterable[Range], budget: int) -> Iterator[bytes]:
        """The bytes of ``ranges`` in order, fetched ahead (see :meth:`ahead`)."""
        jobs = (Job(end - start, functools.partial(self.get, url, start, end)) for url, start, end in ranges)
        return cast(Iterator[bytes], self.ahead(jobs, budget))

    def ahead(self, jobs: Iterable[Job], budget: int) -> Iterator[bytes | bytearray | memoryview]:
        """The results of ``jobs`` in order. Pool jobs run ahead of the consumer, at most :data:`REQUESTS` and
        ``budget`` bytes of them (one at least) running or waiting to be taken; inline jobs run in the consumer's
        thread when their turn comes."""
        window: deque[tuple[Job, Future | None]] = deque()
        held = running = 0
        pending = iter(jobs)
        nxt = next(pending, None)
        try:
            while nxt is not None or window:
                while nxt is not None and (nxt.inline or running < self.requests
                                           and (running == 0 or held + nxt.nbytes <= budget)):
                    window.append((nxt, None if nxt.inline else self.submit(nxt.run)))
                    if not nxt.inline:
                        held, running = held + nxt.nbytes, running + 1
                    nxt = next(pending, None)
                job, future = window.popleft()
                if future is None:
                    yield job.run()
                    continue
                held, running = held - job.nbytes, running - 1
                yield future.result()
        finally:
            for _, future in window:
                if future is not None:
                    future.cancel()

    def close(self) -> None:
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


"""Source bytes: read-only descriptors opened once each, and the row-major bytes of a region read from them."""

from __future__ import annotations

import os

from ..core.plan import Copy, Region, plan_copies
from ..errors import FormatError

__all__ = ["Files", "read_region"]


class Files:
    """Read-only descriptors of source files, opened once each, with sizes checked against every read."""

    def __init__(self) -> None:
        self._fds: dict[str, tuple[int, int]] = {}

    def fd(self, path: str, need_end: int, *, start: int = 0, key: str = "") -> int:
        """The descriptor of ``path``, which must hold bytes ``[start, need_end)`` (read for ``key``)."""
        if path not in self._fds:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise FormatError(f"{path}: cannot open ({e.strerror})") from e
            self._fds[path] = (fd, os.fstat(fd).st_size)
        fd, size = self._fds[path]
        if 0 <= start <= need_end <= size:
            return fd
        what = f"{key!r} " if key else ""
        if start < 0 or need_end < start:
            raise FormatError(f"{path}: {what}is said to lie at offset {start}, {need_end - start} bytes long; "
                              "offsets and lengths cannot be negative")
        raise FormatError(f"{path}: {what}needs bytes up to offset {need_end} but the file has {size} (truncated?)")

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Files:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise FormatError(f"{path}: unexpected end of file at offset {offset}")
        view, offset = view[n:], offset + n


def read_region(region: Region, files: Files) -> bytearray:
    """The row-major bytes of ``region`` in the entry's dtype (``region.cast`` is not applied here).

    Copies whose source bytes follow one another (the rows of one chunk, when the region takes some of its
    columns: a ``Shard(1)`` tensor) are read in one piece and placed from memory: one read per chunk rather
    than one per row."""
    buf = bytearray(Region(region.entry, region.offsets, region.sizes).nbytes)
    view = memoryview(buf)
    runs: list[list[Copy]] = []
    open_runs: dict[tuple[str, int], list[Copy]] = {}  # (file, where the run ends) -> a run a copy there extends
    for cp in sorted(plan_copies(region), key=lambda cp: (cp.src.file, cp.src.offset)):
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

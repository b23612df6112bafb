"""Recorded checksums checked while an output is written: a plan's :class:`~ckptkit.core.plan.Check` list, read
and summed in a thread of its own beside the writer.

The writer moves most bytes kernel-side (``copy_file_range``) and cuts chunks apart (a reshard), so the checks
read their source bytes again, from the page cache, each box whole and in plan order, on another core where
there is one: ``zlib.crc32`` and the reads release the GIL. A failed check stops the writer at its next
progress report, and the output is never published: :func:`checking` raises it before the commit.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib
from collections.abc import Callable, Iterator

from ..core.plan import Check, row_blocks
from ..errors import ChecksumError
from .sources import Files, read_region

__all__ = ["Checking", "checking", "crc_of"]

_BLOCK = 4 << 20
"""Bytes read at a time: the most a check holds in memory."""


def crc_of(check: Check, files: Files, buf: memoryview) -> int:
    """The CRC-32 of ``check``'s bytes as ``files`` reads them now, through ``buf`` (a scratch buffer)."""
    crc = 0
    for span in check.spans:
        pos, end = span.offset, span.offset + span.length
        while pos < end:
            n = min(len(buf), end - pos)
            if files.streamed(span.file):
                crc = zlib.crc32(files.read(span.file, pos, n, key=check.key), crc)
            else:
                fd, view = files.fd(span.file, end, start=span.offset, key=check.key), buf[:n]
                got = os.preadv(fd, [view], pos)
                if got <= 0:
                    raise ChecksumError(f"{check.what}: the file ends at byte {pos}")
                crc, n = zlib.crc32(view[:got], crc), got
            pos += n
    for region in check.regions:
        for block in row_blocks(region, len(buf)):
            crc = zlib.crc32(read_region(block, files), crc)
    return crc


class Checking:
    """The checks of one write under way (:func:`checking`): :meth:`watch` wraps the writer's progress
    callback so that a failed check stops the writer."""

    def __init__(self, checks: tuple[Check, ...], block: int) -> None:
        self.checks, self.block = checks, block
        self.failure: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ckptkit-checks", daemon=True)

    def _run(self) -> None:
        buf = memoryview(bytearray(self.block))
        try:
            with Files() as files:
                for check in self.checks:
                    if self.stop.is_set():
                        return
                    got = crc_of(check, files, buf)
                    if got != check.crc32:
                        raise ChecksumError(
                            f"{check.what} fails its CRC-32 check (recorded {check.crc32:08x}, the bytes give "
                            f"{got:08x}): the checkpoint changed after it was saved; --no-verify-checksums "
                            "(verify_checksums=False) reads it as it is")
        except BaseException as e:  # told to the writer, which raises it in its own thread
            self.failure = e

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def watch(self, progress: Callable[[int], None]) -> Callable[[int], None]:
        """``progress``, raising a failed check's error first."""
        if not self.checks:
            return progress

        def watched(n: int) -> None:
            self.raise_failure()
            progress(n)

        return watched


@contextlib.contextmanager
def checking(checks: tuple[Check, ...], max_memory: int) -> Iterator[Checking]:
    """Check ``checks`` in a thread while the block runs (the write); on leaving, wait for them and raise the
    first that failed (:class:`ChecksumError`), so that the caller publishes nothing. A block that raises
    stops the checks."""
    state = Checking(checks, max(1 << 16, min(_BLOCK, max_memory // 8)))
    if not checks:
        yield state
        return
    state.thread.start()
    try:
        yield state
    except BaseException:
        state.stop.set()
        state.thread.join()
        raise
    state.thread.join()
    state.raise_failure()

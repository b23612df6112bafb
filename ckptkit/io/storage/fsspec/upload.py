"""Streams: a plan's files produced front to back as streams of pieces, their streamed source ranges fetched
ahead concurrently, then written into a local file (:class:`StreamWriter`, where a source is an object's) or
uploaded to an object store (:func:`upload`, where DST is one).

The local writer (:mod:`ckptkit.io.storage.local.writer`) moves bytes kernel-side between local files, which
needs no order. Here each output file is a stream (an upload is written front to back), made of:

- a :class:`~ckptkit.core.plan.Bytes` part, as it is;
- a tensor region's source ranges (:func:`~ckptkit.core.plan.plan_copies`), joined where back to back, cut into
  pieces of at most :data:`~.reads.PIECE`, and read on the pool of :class:`~.reads.RemoteFiles` ahead of the
  writer (a local source by ``pread``, a remote one by a range GET);
- a region to cast, in row blocks, cast as the local writer casts.

Memory stays bounded by ``max_memory``, never by a file's size: :func:`upload` puts up to
:data:`FILES_AT_ONCE` files at once, each with a quarter of its share of the budget fetched ahead, a quarter
for a cast block, and up to twice a quarter buffered for the multipart upload's current part (S3's minimum
part, 5 MiB, is the floor).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ....core.dtypes import DType
from ....core.plan import Bytes, FilePlan, Part, Region, plan_copies, row_blocks
from ...compute import block_budget
from ...sources import Files, read_region
from .paths import RemotePath, calling
from .reads import PIECE, Job, RemoteFiles, coalesce
from .staging import ObjectStaging

__all__ = ["FILES_AT_ONCE", "StreamWriter", "file_pieces", "upload"]

FILES_AT_ONCE = 4
"""Output files uploaded at once (each upload sends its parts one after another)."""
_MIN_PART, _MAX_PART = 5 << 20, 64 << 20
_GAP = 64 << 10
"""Bytes between two reads of a source that a gathered request fetches rather than making two (a DCP chunk's
``torch.save`` archive headers lie between one tensor's bytes and the next)."""

Cast = Callable[[bytearray | memoryview, DType, DType], memoryview]
"""The local executor's cast: source bytes, their dtype, the dtype to write."""


def file_pieces(parts: tuple[Part, ...], files: Files, budget: int,
                cast_bytes: Cast) -> Iterator[bytes | bytearray | memoryview]:
    """The bytes of a file made of ``parts``, front to back, with at most ``budget`` bytes read ahead (half
    in flight, half gathered: :func:`_gathered`) and a cast's row block within it too."""
    return files.remote.ahead(_gathered(_jobs(parts, files, budget, cast_bytes), files, budget // 2), budget // 2)


class _Read(NamedTuple):
    """Source bytes ``[start, end)`` of ``path`` that a file needs, for tensor ``key``."""

    path: str
    start: int
    end: int
    key: str


def _jobs(parts: tuple[Part, ...], files: Files, budget: int, cast_bytes: Cast) -> Iterator[Job | _Read]:
    for part in parts:
        if isinstance(part, Bytes):
            yield Job(part.nbytes, functools.partial(bytes, part.data), inline=True)
        elif part.entry.derived is None and (part.cast is None or part.cast == part.entry.dtype):
            ranges = ((cp.src.file, cp.src.offset, cp.src.offset + cp.src.length) for cp in plan_copies(part))
            for path, start, end in coalesce(ranges, PIECE):
                yield _Read(path, start, end, part.entry.key)
        else:
            for block in row_blocks(part, block_budget(part, budget)):
                yield Job(block.nbytes, functools.partial(_cast_block, block, part.dtype, files, cast_bytes),
                          inline=True)


def _gathered(items: Iterator[Job | _Read], files: Files, window: int) -> Iterator[Job]:
    """``items`` as jobs, the reads of each window of about ``window`` bytes gathered: the reads of one source
    within it that follow each other (up to :data:`_GAP` apart, :data:`~.remote.PIECE` in all) are one request,
    made where the first of them falls and kept until the last is served. An output interleaves its sources
    (an HF file takes each tensor's chunks from every rank of a DCP, whose rank files hold tensor after
    tensor), so a source's next bytes are rarely the very next read; gathered, a 4-rank export asks for up to
    8 MiB at a time instead of one tensor's share, and a checkpoint of many small chunks is not one request
    per chunk. What is held stays within the window."""
    pending: list[Job | _Read] = []
    held = 0
    for item in items:
        pending.append(item)
        if isinstance(item, _Read):
            held += item.end - item.start
            if held >= window:
                yield from _gather(pending, files)
                pending, held = [], 0
    yield from _gather(pending, files)


class _Run:
    """Bytes ``[start, end)`` of one source, fetched once for the ``left`` reads that lie in it."""

    def __init__(self, path: str, start: int, end: int) -> None:
        self.path, self.start, self.end, self.left = path, start, end, 1
        self.data: bytes | bytearray | memoryview = b""

    def first(self, fetch: Callable[[], bytes | bytearray], start: int, end: int) -> memoryview:
        """Fetch the run (on the pool) and serve its first read."""
        self.data = fetch()
        return self.take(start, end)

    def take(self, start: int, end: int) -> memoryview:
        """Serve a read (in the consumer's thread, after :meth:`first`'s result was taken); the last lets go."""
        piece = memoryview(self.data)[start - self.start:end - self.start]
        self.left -= 1
        if not self.left:
            self.data = b""
        return piece


def _gather(items: list[Job | _Read], files: Files) -> Iterator[Job]:
    planned: list[Job | tuple[_Read, _Run, bool]] = []  # a read, its run, and whether it makes the request
    last: dict[str, _Run] = {}  # each source's run still open to the next read
    for item in items:
        if isinstance(item, Job):
            planned.append(item)
            continue
        files.job(item.path, item.start, item.end, key=item.key)  # each read's span checked, with its key
        run = last.get(item.path)
        if run is not None and run.end <= item.start <= run.end + _GAP and item.end - run.start <= PIECE:
            run.end, run.left = item.end, run.left + 1
            planned.append((item, run, False))
        else:
            last[item.path] = run = _Run(item.path, item.start, item.end)
            planned.append((item, run, True))
    for entry in planned:
        if isinstance(entry, Job):
            yield entry
            continue
        read, run, makes = entry
        if makes:
            fetch = files.job(run.path, run.start, run.end, key=read.key)
            yield Job(run.end - run.start, functools.partial(run.first, fetch, read.start, read.end))
        else:
            yield Job(read.end - read.start, functools.partial(run.take, read.start, read.end), inline=True)


def _cast_block(block: Region, to: DType, files: Files, cast_bytes: Cast) -> memoryview:
    return cast_bytes(read_region(block, files), block.entry.dtype, to)


class StreamWriter:
    """The local executor's writer for sources behind URLs: each file written front to back as its pieces come."""

    def __init__(self, files: Files, max_memory: int, progress: Callable[[int], None], cast_bytes: Cast) -> None:
        self.files, self.progress, self.cast_bytes = files, progress, cast_bytes
        self.budget = max(PIECE, max_memory // 2)

    def write_file(self, out: int, parts: tuple[Part, ...], start: int = 0) -> None:
        """Write ``parts`` laid end to end from byte ``start`` of ``out`` (made at its full size beforehand)."""
        pos = start
        for piece in file_pieces(parts, self.files, self.budget, self.cast_bytes):
            os.pwrite(out, piece, pos)
            pos += len(piece)
            self.progress(len(piece))


class _Cancelled(Exception):
    """Another upload failed, or the run was interrupted: this one stops at its next piece."""


def upload(files: list[FilePlan], staging: ObjectStaging, *, commit: str, max_memory: int,
           cast_bytes: Cast, progress: Callable[[int], None] = lambda n: None) -> None:
    """Upload every file of ``files`` in place under ``staging``, the ``commit`` file last.

    A failure or an interrupt (SIGINT, SIGTERM) stops every upload at its next piece and aborts the multipart
    uploads in progress; :meth:`ObjectStaging.abort` then removes what was put.
    """
    share = max(_MIN_PART, max_memory // FILES_AT_ONCE)
    remote = RemoteFiles()
    try:
        _upload_all([fp for fp in files if fp.relpath != commit], staging, remote, share, cast_bytes,
                    progress)
        _upload_all([fp for fp in files if fp.relpath == commit], staging, remote, share, cast_bytes,
                    progress)
    finally:
        remote.close()


def _upload_all(files: list[FilePlan], staging: ObjectStaging, remote: RemoteFiles, share: int, cast_bytes: Cast,
                progress: Callable[[int], None]) -> None:
    """Upload ``files``, :data:`FILES_AT_ONCE` at a time; the first failure stops the others and is raised."""
    if not files:
        return
    cancel = threading.Event()
    from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait  # object stores only

    with ThreadPoolExecutor(min(FILES_AT_ONCE, len(files)), thread_name_prefix="ckptkit-put") as pool:
        futures: list[Future] = []
        try:
            for fp in files:
                target = staging.started(fp.relpath)
                futures.append(pool.submit(_upload, fp, target, remote, share, cast_bytes, progress, cancel))
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # SIGINT, SIGTERM in this thread: stop the uploads before the staging is removed
            cancel.set()
            wait(futures)
            raise
        failed = [f for f in done if f.exception() is not None]
        if failed:
            cancel.set()
            wait(futures)
            errors = [e for f in futures if (e := f.exception()) is not None]
            raise next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])


def _upload(fp: FilePlan, target: RemotePath, remote: RemoteFiles, share: int, cast_bytes: Cast,
            progress: Callable[[int], None], cancel: threading.Event) -> None:
    quarter = max(PIECE, share // 4)
    part = min(max(_MIN_PART, quarter), _MAX_PART)
    with Files(remote) as files:
        url = str(target)
        with calling(url):
            out = target.fs.open(target.path, "wb", block_size=part)
        try:
            for piece in file_pieces(fp.parts, files, quarter, cast_bytes):
                if cancel.is_set():
                    raise _Cancelled(f"{url}: stopped")
                with calling(url):
                    out.write(piece)
                progress(len(piece))
            with calling(url):
                out.close()  # the upload completes here: the object appears whole, or not at all
        except BaseException:
            _discard(out)
            raise


def _discard(out: Any) -> None:
    """Abort an upload without completing it: a file object's ``close`` (also called when it is collected)
    would complete it with what was written so far."""
    with contextlib.suppress(Exception):
        out.discard()
    with contextlib.suppress(Exception):
        out.closed = True

"""The local writer: a plan's byte ranges streamed into output files by descriptor.

Bytes that need no change move kernel-side with ``os.copy_file_range`` (no user-space buffer, no RSS).
Only a dtype cast brings bytes into memory, one row block of at most ``max_memory`` at a time. Sources whose
storage streams them (an object store's) are read by ranged requests instead
(:class:`~ckptkit.io.storage.fsspec.upload.StreamWriter`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

from ....core.dtypes import DType
from ....core.plan import FilePlan, Part, Region, row_blocks
from ....core.split import Slice
from ....errors import FormatError
from ...compute import block_budget
from ...moves import Literal, Moves, Read, Unit, units
from ...options import DEFAULT_MAX_MEMORY
from ...sources import Files, read_region
from .reads import read_into

__all__ = ["allocate", "cast_bytes", "write_cap", "write_descriptors", "write_files", "write_slices"]

_COPY_PIECE = 1 << 30  # copy_file_range moves at most this much per call; larger counts are split
_GATHER_BLOCK = 8 << 20  # the write buffer's size


def cast_bytes(data: bytearray | memoryview, src: DType, dst: DType) -> memoryview:
    """``data``, a flat array of ``src``, as ``dst``: between floating dtypes in numpy (:mod:`ckptkit.io.floats`,
    the bits torch's casts give, without importing torch), any other cast by torch."""
    if src == dst:
        return memoryview(data)
    if not data:
        return memoryview(b"")
    from ...floats import ENCODES, convert, held

    if src.name in ENCODES and dst.name in ENCODES:
        return convert(held(data, src.name), src.name, dst.name).data.cast("B")
    import torch  # a cast among other dtypes

    src_dtype, dst_dtype = getattr(torch, src.name), getattr(torch, dst.name)
    out = bytearray(len(data) // src.itemsize * dst.itemsize)
    torch.frombuffer(out, dtype=dst_dtype).copy_(torch.frombuffer(data, dtype=src_dtype))  # copy_ casts
    return memoryview(out)


def write_cap(max_memory: int) -> int:
    """The write buffer's size under ``max_memory``: two buffers (one filling, one being written) beside a
    cast block."""
    return max(1, min(max_memory // 4, _GATHER_BLOCK))


class _Writer:
    """Runs a file's units (:mod:`.moves`) in order. Copies of at least :data:`.moves.KERNEL_COPY` bytes move
    kernel-side; smaller ones (a DCP of many small chunks: framing, a chunk, framing...; the rows of column
    chunks) are read into one buffer with the framing between them and written with one ``pwrite`` per
    buffer: a kernel copy of a small range costs several times the bytes' own cost, and a write per piece as
    much again."""

    def __init__(self, files: Files, max_memory: int, progress: Callable[[int], None]) -> None:
        self.files, self.max_memory, self.progress = files, max_memory, progress
        self.kernel_copy = hasattr(os, "copy_file_range")
        self.cap = write_cap(max_memory)
        self.buf, self.spare = memoryview(bytearray(0)), memoryview(bytearray(0))
        self.out, self.start, self.fill = -1, 0, 0  # the buffer holds bytes [start, start + fill) of out
        self.writing: Future[None] | None = None  # the spare buffer's write, in the writer thread

    def write_file(self, out: int, parts: tuple[Part, ...], start: int = 0) -> None:
        """Write ``parts`` laid end to end from byte ``start`` of ``out``."""
        self.run(out, units(parts, start, self.cap))

    def run(self, out: int, todo: Iterable[Unit]) -> None:
        """Run ``todo`` on ``out``; every write is done when this returns."""
        self.fill = 0  # (what a failed file left buffered is not written to this one)
        done = told = 0  # bytes reported to progress: once a buffer's worth, not per unit (a DCP has three per chunk)
        with ThreadPoolExecutor(1, thread_name_prefix="ckptkit-write") as self.pool:
            try:
                for u in todo:
                    if isinstance(u, Literal):
                        n = len(u.data)
                        self._buffered(out, u.dst, n)[:] = u.data
                    elif isinstance(u, Read):
                        n = u.nbytes
                        self._copy(out, u)
                    else:
                        n = u.region.nbytes
                        self._cast_copy(out, u.region, u.region.dtype, u.dst)
                    done += n
                    if done - told >= _GATHER_BLOCK:
                        self.progress(done - told)
                        told = done
                self.flush()
            finally:  # out is closed after this: no write of it may still be under way
                self._written()
        self.progress(done - told)

    def _buffered(self, out: int, pos: int, n: int) -> memoryview:
        """Room for bytes ``[pos, pos + n)`` of ``out`` in the buffer, written out by :meth:`flush`; bytes
        that do not follow the buffered ones, or do not fit, flush it first."""
        if out != self.out or pos != self.start + self.fill or self.fill + n > len(self.buf):
            self.flush()
            if n > len(self.buf):
                self.buf = memoryview(bytearray(max(n, min(self.cap, len(self.buf) * 2 or 1 << 20))))
            self.out, self.start = out, pos
        view = self.buf[self.fill:self.fill + n]
        self.fill += n
        return view

    def flush(self) -> None:
        """Hand the buffered bytes to the writer thread (a write releases the GIL: the next buffer fills
        meanwhile) and take the spare buffer once its own write is done."""
        if self.fill:
            self._written()
            self.writing = self.pool.submit(_pwrite_all, self.out, self.buf[:self.fill], self.start)
            self.buf, self.spare = self.spare, self.buf
        self.fill = 0
        if len(self.buf) > self.cap:  # one piece larger than the buffer's cap (a single row): not kept
            self.buf = memoryview(bytearray(0))

    def _written(self) -> None:
        writing, self.writing = self.writing, None
        if writing is not None:
            writing.result()
        if len(self.spare) > self.cap:
            self.spare = memoryview(bytearray(0))

    def _copy(self, out: int, read: Read) -> None:
        if not read.kernel:
            read_into(self._buffered(out, read.dst, read.nbytes), read.pieces, self.files, read.key)
            return
        for s in read.pieces:
            fd = self.files.fd(s.src.file, s.src.offset + s.src.length, start=s.src.offset, key=read.key)
            self._copy_range(fd, out, s.src.offset, read.dst + s.dst, s.src.length)

    def _copy_range(self, src: int, out: int, src_off: int, dst_off: int, n: int) -> None:
        while n > 0 and self.kernel_copy:
            try:
                done = os.copy_file_range(src, out, min(n, _COPY_PIECE), src_off, dst_off)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                    raise
                self.kernel_copy = False  # this filesystem pair cannot: fall back to a buffer for good
                break
            if done == 0:
                raise FormatError(f"unexpected end of source file while copying {n} bytes at offset {src_off}")
            src_off, dst_off, n = src_off + done, dst_off + done, n - done
        buf = bytearray(min(n, 64 << 20))
        while n > 0:
            view = memoryview(buf)[:min(n, len(buf))]
            got = os.preadv(src, [view], src_off)
            if got == 0:
                raise FormatError(f"unexpected end of source file while copying {n} bytes at offset {src_off}")
            os.pwrite(out, view[:got], dst_off)
            src_off, dst_off, n = src_off + got, dst_off + got, n - got

    def _cast_copy(self, out: int, region: Region, cast: DType, pos: int) -> None:
        """A region cast, or computed (:mod:`.compute`), one row block at a time."""
        self.flush()
        for block in row_blocks(region, block_budget(region, self.max_memory)):
            data = cast_bytes(read_region(block, self.files), block.entry.dtype, cast)
            os.pwrite(out, data, pos)
            pos += len(data)


def _pwrite_all(out: int, view: memoryview, pos: int) -> None:
    while view:
        n = os.pwrite(out, view, pos)
        view, pos = view[n:], pos + n


def write_files(files: tuple[FilePlan, ...], stage: Path, *, max_memory: int = DEFAULT_MAX_MEMORY,
                fsync: bool = False, progress: Callable[[int], None] = lambda n: None,
                names: dict[str, Path] | None = None, streamed: bool = False) -> None:
    """Write ``files`` under the existing directory ``stage``. An error while writing names the file by
    ``names`` (relpath to the path the user will see: the destination, not the staging directory).
    ``streamed``: some sources are streamed by their storage (an object store's), read by ranged requests."""
    allocate(files, stage, names)
    write_slices(tuple(Slice.whole(fp) for fp in files), stage, max_memory=max_memory, fsync=fsync,
                 progress=progress, names=names, streamed=streamed)


def allocate(files: tuple[FilePlan, ...], stage: Path, names: dict[str, Path] | None = None) -> None:
    """Make every file of ``files`` under ``stage`` at its planned size (empty, sparse where the filesystem
    can), so that writers fill byte ranges of it in any order and any number of processes.

    Raises:
        OSError: a file cannot be made; the message names it by ``names``.
    """
    for fp in files:
        path = stage / fp.relpath
        with _naming((names or {}).get(fp.relpath, path)):
            path.parent.mkdir(parents=True, exist_ok=True)
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(out, fp.nbytes)
            finally:
                os.close(out)


def write_slices(slices: Iterable[Slice | Moves], stage: Path, *, max_memory: int = DEFAULT_MAX_MEMORY,
                 fsync: bool = False, progress: Callable[[int], None] = lambda n: None,
                 names: dict[str, Path] | None = None, streamed: bool = False) -> None:
    """Write ``slices`` (byte ranges of files :func:`allocate` made under ``stage``), each at its offsets; what
    other processes write to the same files meanwhile is theirs. Arguments as for :func:`write_files`.

    Raises:
        OSError: a write failed; the message names the file by ``names``.
        CheckpointError: a source is short or unreadable.
    """
    known = names or {}
    write_descriptors(slices, lambda relpath: os.open(stage / relpath, os.O_WRONLY), max_memory=max_memory,
                      fsync=fsync, progress=progress, name_of=lambda relpath: known.get(relpath, stage / relpath),
                      streamed=streamed)


def write_descriptors(slices: Iterable[Slice | Moves], open_out: Callable[[str], int], *,
                      max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False,
                      progress: Callable[[int], None] = lambda n: None, name_of: Callable[[str], object] = str,
                      streamed: bool = False) -> None:
    """Write ``slices`` into the descriptors ``open_out(relpath)`` opens (and this closes), each at its offsets.
    An error while writing names the file ``name_of(relpath)``. Other arguments as for :func:`write_slices`."""
    from ..fsspec.upload import StreamWriter  # sources read by ranged requests

    with Files() as sources:
        writer = StreamWriter(sources, max_memory, progress, cast_bytes) if streamed else _Writer(sources, max_memory,
                                                                                                progress)
        for piece in slices:
            with _naming(name_of(piece.relpath)):
                out = open_out(piece.relpath)
                try:
                    if isinstance(piece, Moves):
                        cast(_Writer, writer).run(out, piece.units())
                    else:
                        writer.write_file(out, piece.parts, piece.start)
                    if fsync:
                        os.fsync(out)
                finally:
                    os.close(out)


@contextlib.contextmanager
def _naming(name: object) -> Iterator[None]:
    """An OSError inside names the file as the user knows it (DST's, not the staging directory's)."""
    try:
        yield
    except OSError as e:
        if e.errno is None:
            raise
        raise OSError(e.errno, f"{e.strerror} (writing {name})") from e

"""Execution: stream a :class:`WritePlan` into a staging directory, then move it into place.

Bytes that need no change move kernel-side with ``os.copy_file_range`` (no user-space buffer, no RSS).
Only a dtype cast brings bytes into memory, one row block of at most ``max_memory`` at a time.

:func:`execute_distributed` splits the files over the ranks of the default process group (torchrun, a
training job's group in a save hook); every rank plans the whole job. The calls every rank makes, in order:

0. the job (reading, planning, writing) runs inside :func:`all_ranks` (the ops' ``distributed=True``);
1. an ``all_gather`` in which every rank says whether it got as far as writing: one that failed before
   casts its error instead, so that no rank waits for it, and every rank raises;
2. rank 0 checks DST, makes the staging directory and every output file at its planned size; a ``broadcast``
   tells the directory's path (or rank 0's error);
3. each rank writes its share (:func:`ckptkit.core.split.split_work`: whole files, and byte ranges of large
   ones, into the files rank 0 made at their sizes); an ``all_gather`` collects the outcomes;
4. rank 0 publishes once every file has its planned size, or aborts if any rank failed; a ``broadcast``
   tells every rank how it went.

:mod:`ckptkit.io.parallel` splits the files over worker processes of one machine instead.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from .. import errors
from ..core.dtypes import DType
from ..core.plan import FilePlan, Part, Region, WritePlan, row_blocks
from ..core.split import Slice, split_work
from ..errors import CheckpointError, FormatError, UsageError
from .compute import block_budget
from .moves import Literal, Moves, Read, Unit, units
from .options import DEFAULT_MAX_MEMORY
from .publish import Staging, check_destination, stage
from .remote import RemotePath, is_url
from .sources import Files, read_into, read_region
from .transfer import StreamWriter, execute_remote

__all__ = ["DEFAULT_MAX_MEMORY", "GROUP_TIMEOUT", "all_ranks", "allocate", "execute", "execute_distributed",
           "gloo_group", "write_cap", "write_files", "write_slices"]

P = ParamSpec("P")
R = TypeVar("R")

_COPY_PIECE = 1 << 30  # copy_file_range moves at most this much per call; larger counts are split
_GATHER_BLOCK = 8 << 20  # the write buffer's size


def _cast(data: bytearray, src: DType, dst: DType) -> memoryview:
    if src == dst:
        return memoryview(data)
    import torch  # only a dtype cast needs torch

    src_dtype, dst_dtype = getattr(torch, src.name), getattr(torch, dst.name)
    t = torch.frombuffer(data, dtype=src_dtype) if data else torch.empty(0, dtype=src_dtype)
    return t.to(dst_dtype).view(torch.uint8).numpy().data


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
            data = _cast(read_region(block, self.files), block.entry.dtype, cast)
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
    ``streamed``: some sources are URLs, whose bytes come by ranged requests (:mod:`.transfer`)."""
    allocate(files, stage, names)
    write_slices(tuple(Slice(fp.relpath, 0, fp.parts) for fp in files), stage, max_memory=max_memory, fsync=fsync,
                 progress=progress, names=names, streamed=streamed)


def allocate(files: tuple[FilePlan, ...], stage: Path, names: dict[str, Path] | None = None) -> None:
    """Make every file of ``files`` under ``stage`` at its planned size (empty, sparse where the filesystem
    can), so that writers fill byte ranges of it in any order and any number of processes.

    Raises:
        OSError: a file cannot be made; the message names it by ``names``.
    """
    for fp in files:
        path = stage / fp.relpath
        with _naming(fp.relpath, path, names):
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
    with Files() as sources:
        writer = StreamWriter(sources, max_memory, progress, _cast) if streamed else _Writer(sources, max_memory,
                                                                                           progress)
        for piece in slices:
            path = stage / piece.relpath
            with _naming(piece.relpath, path, names):
                out = os.open(path, os.O_WRONLY)
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
def _naming(relpath: str, path: Path, names: dict[str, Path] | None) -> Iterator[None]:
    """An OSError inside names the file as the user knows it (DST's, not the staging directory's)."""
    try:
        yield
    except OSError as e:
        if e.errno is None:
            raise
        name = (names or {}).get(relpath, path)
        raise OSError(e.errno, f"{e.strerror} (writing {name})") from e


def _names(plan: WritePlan, dst: Path) -> dict[str, Path]:
    return {fp.relpath: dst if plan.single_file else dst / fp.relpath for fp in plan.files}


def execute(plan: WritePlan, dst: Path, *, overwrite: bool = False, sources: tuple[Path, ...] = (),
            max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False,
            progress: Callable[[int], None] = lambda n: None) -> Path:
    """Write every file of ``plan`` under a staging directory and move the result to ``dst`` atomically.
    A URL ``dst`` (an object store) is written in place, its commit file last (:func:`.transfer.execute_remote`)."""
    if is_url(dst):
        return execute_remote(plan, cast(RemotePath, dst), overwrite=overwrite, sources=sources,
                              max_memory=max_memory, cast_bytes=_cast, progress=progress)
    dst = check_destination(dst, overwrite=overwrite, sources=sources)
    with stage(dst, replace=overwrite) as staging:
        write_files(plan.files, staging.path, max_memory=max_memory, fsync=fsync, progress=progress,
                    names=_names(plan, dst), streamed=any(map(is_url, sources)))
        staging.commit(replace=overwrite, file=plan.files[0].relpath if plan.single_file else None, fsync=fsync)
    return dst


def _publish(plan: WritePlan, staging: Staging, *, overwrite: bool, fsync: bool) -> None:
    """Commit ``staging`` once every file of ``plan`` is there with its planned size: a process that wrote
    somewhere else (a rank whose filesystem is not shared with rank 0's) leaves a hole, never a short output."""
    for fp in plan.files:
        path = staging.path / fp.relpath
        size = path.stat().st_size if path.is_file() else None
        if size != fp.nbytes:
            staging.abort()
            raise FormatError(f"{staging.dst / fp.relpath}: expected {fp.nbytes} bytes from the process that wrote "
                              f"it, found {'no file' if size is None else f'{size} bytes'}; is DST on a filesystem "
                              "every process shares?")
    staging.commit(replace=overwrite, file=plan.files[0].relpath if plan.single_file else None, fsync=fsync)


# --------------------------------------------------------------------------------------------------------
# Ranks of a process group


_vote_owed = False
"""Whether this process, inside :func:`all_ranks`, has yet to cast its vote of step 1."""
_group: Any = None
"""The gloo group of the run :func:`all_ranks` runs (:func:`gloo_group`)."""
GROUP_TIMEOUT = timedelta(hours=24)
"""How long a collective of a distributed conversion waits. Ranks wait for the slowest share of a job that may
take hours; a rank that dies is noticed sooner (torchrun stops the others), so this only bounds a rank that
hangs alive."""
_GLOO_GROUPS: dict[tuple[int, timedelta | None], Any] = {}


def gloo_group(timeout: timedelta | None = None) -> Any:
    """A gloo group of ckptkit's own over every rank of the default group, or None when there is none. In a
    training job the default group is training's (NCCL, with a watchdog of minutes): ckptkit's collectives must
    neither wait on it nor interleave with it, and object collectives on gloo need no device. Made once per
    default group and timeout (``new_group`` is itself a collective: every rank calls this at the same point);
    ``destroy_process_group()`` ends them with the default group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = (id(dist.group.WORLD), timeout)
    if key not in _GLOO_GROUPS:
        if not _GLOO_GROUPS:
            # Dropped while the interpreter is whole: a group freed during its finalization, after the
            # job's destroy_process_group(), could abort the process at exit ("terminate called without an
            # active exception").
            atexit.register(_GLOO_GROUPS.clear)
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo", timeout=timeout)
    return _GLOO_GROUPS[key]


def _from_rank(rank: int, failure: tuple[str, str]) -> CheckpointError:
    """Another rank's failure, as this rank raises it: the same ckptkit error class, the message prefixed."""
    kind, message = failure
    cls = getattr(errors, kind, None)
    cls = cls if isinstance(cls, type) and issubclass(cls, CheckpointError) else FormatError
    return cls(f"rank {rank}: {message}")


def _failure(e: BaseException | None) -> tuple[str, str] | None:
    return None if e is None else (type(e).__name__, " ".join(str(e).split()) or type(e).__name__)


def _gather(e: BaseException | None) -> list[tuple[int, tuple[str, str]]]:
    """Every rank's failure, as (rank, (error class, message)) pairs; empty when no rank failed."""
    import torch.distributed as dist

    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, _failure(e), group=_group)
    return [(rank, failure) for rank, failure in enumerate(outcomes) if failure is not None]


def _vote(e: BaseException | None) -> None:
    """Step 1: every rank says whether it is ready to write; raise on every rank that is, if any is not."""
    global _vote_owed
    _vote_owed = False
    failed = _gather(e)
    if failed and e is None:
        raise _from_rank(*failed[0])


def all_ranks(fn: Callable[P, R]) -> Callable[P, R]:
    """For a function that writes through :func:`execute_distributed` when called with ``distributed=True``: an
    error on any rank before it writes (a source it cannot read, a bad option) fails every rank, instead of
    leaving the others waiting for it at the first collective."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        global _vote_owed
        if not kwargs.get("distributed"):
            return fn(*args, **kwargs)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("distributed=True writes from every rank of the default process group, and there is "
                             "none: call torch.distributed.init_process_group first (torchrun ... -m ckptkit does)")
        global _group
        _group = gloo_group(GROUP_TIMEOUT)
        _vote_owed = True
        try:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                if _vote_owed:
                    _vote(e)
                raise
            except BaseException:  # a signal: this rank leaves, and the others' collectives fail without it
                _vote_owed = False
                raise
            if _vote_owed:  # wrote nothing (a dry run): the vote still answers the other ranks'
                _vote(None)
        finally:
            _group = None
        return result

    return run


def _write_share(plan: WritePlan, staging: Staging, dst: Path, rank: int, world: int, *, max_memory: int,
                 fsync: bool, streamed: bool) -> Exception | None:
    """Step 3 on one rank: write its share; return the error instead of raising it, for the others to hear."""
    try:
        if not staging.path.is_dir():
            raise UsageError(f"{staging.path}, rank 0's staging directory beside DST, is not visible from rank "
                             f"{rank}: DST must be on a filesystem every rank shares")
        write_slices(split_work(plan.files, world, cut_files=not streamed)[rank], staging.path,
                     max_memory=max_memory, fsync=fsync, names=_names(plan, dst), streamed=streamed)
    except Exception as e:
        return e
    return None


def execute_distributed(plan: WritePlan, dst: Path, *, overwrite: bool = False, sources: tuple[Path, ...] = (),
                        max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False) -> Path:
    """``execute`` from every rank of the default process group, each writing its share of the files.

    Every rank must pass the same plan (planning is pure, so the same inputs give it) and call this once
    the job's reading and planning are done (steps 1-4 of the module's docstring); rank 0 publishes once all
    have written, and every rank returns, or raises, with the run's outcome (a rank's own error, else the
    first other rank's, named "rank N: ...").
    """
    import torch.distributed as dist

    if is_url(dst):
        raise UsageError(f"{dst}: distributed writes go to a local or shared filesystem; an object store is written "
                         "by one process")
    rank, world = dist.get_rank(), dist.get_world_size()
    dst = Path(dst).absolute()
    _vote(None)
    staging: Staging | None = None
    error: Exception | None = None
    if rank == 0:
        try:
            check_destination(dst, overwrite=overwrite, sources=sources)
            staging = stage(dst, replace=overwrite)
            allocate(plan.files, staging.path, _names(plan, dst))
        except Exception as e:  # told to every rank below, so none waits forever
            if staging is not None:
                staging.abort()
            error = e
    shared: list[Any] = [_failure(error) if error else str(staging.path) if staging else None]
    try:
        dist.broadcast_object_list(shared, src=0, group=_group)
    except BaseException:  # a lost rank, a signal: rank 0's staging directory goes with the run
        if staging is not None:
            staging.abort()
        raise
    if error is not None:
        raise error
    if isinstance(shared[0], tuple):
        raise _from_rank(0, shared[0])
    staging = staging or Staging(dst, Path(shared[0]), owner=False)
    with staging:  # rank 0's is removed on every way out but its publishing: a signal, a lost rank
        failed = _write_share(plan, staging, dst, rank, world, max_memory=max_memory, fsync=fsync,
                              streamed=any(map(is_url, sources)))
        problems = _gather(failed)
        published: Exception | None = None
        if rank == 0:
            try:
                if problems:
                    staging.abort()
                else:
                    _publish(plan, staging, overwrite=overwrite, fsync=fsync)
            except Exception as e:
                published = e
        outcome: list[Any] = [_failure(published)]
        dist.broadcast_object_list(outcome, src=0, group=_group)
    if failed is not None:
        raise failed
    if problems:
        raise _from_rank(*problems[0])
    if published is not None:
        raise published
    if outcome[0] is not None:
        raise _from_rank(0, outcome[0])
    return dst

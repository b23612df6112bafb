"""Execution: stream a :class:`WritePlan` into a staging directory, then move it into place.

Bytes that need no change move kernel-side with ``os.copy_file_range`` (no user-space buffer, no RSS).
Only a dtype cast brings bytes into memory, one row block of at most ``max_memory`` at a time.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from ..core.dtypes import DType
from ..core.plan import Bytes, FilePlan, Part, Region, WritePlan, plan_copies, row_blocks
from ..errors import FormatError, UsageError
from .publish import Staging, check_destination, stage
from .sources import Files, read_region

__all__ = ["DEFAULT_MAX_MEMORY", "execute", "execute_distributed", "write_files"]

DEFAULT_MAX_MEMORY = 1 << 30
_COPY_PIECE = 1 << 30  # copy_file_range moves at most this much per call; larger counts are split
_FEW_COPIES = 16  # a region of up to this many copies moves by kernel copies whatever their size
_SMALL_COPY = 1 << 16  # copies smaller than this on average go through memory instead
_GATHER_BLOCK = 64 << 20  # bytes of such a region gathered at a time (its reads are as large again)


def _cast(data: bytearray, src: DType, dst: DType) -> memoryview:
    import torch  # only a dtype cast needs torch

    src_dtype, dst_dtype = getattr(torch, src.name), getattr(torch, dst.name)
    t = torch.frombuffer(data, dtype=src_dtype) if data else torch.empty(0, dtype=src_dtype)
    return t.to(dst_dtype).view(torch.uint8).numpy().data


class _Writer:
    def __init__(self, files: Files, max_memory: int, progress: Callable[[int], None]) -> None:
        self.files, self.max_memory, self.progress = files, max_memory, progress
        self.kernel_copy = hasattr(os, "copy_file_range")

    def write_file(self, out: int, parts: tuple[Part, ...]) -> None:
        pos = 0
        for part in parts:
            if isinstance(part, Bytes):
                os.pwrite(out, part.data, pos)
            elif part.cast is None or part.cast == part.entry.dtype:
                self._copy(out, part, pos)
            else:
                self._cast_copy(out, part, part.cast, pos)
            pos += part.nbytes
            self.progress(part.nbytes)
        os.ftruncate(out, pos)

    def _copy(self, out: int, region: Region, pos: int) -> None:
        copies = plan_copies(region)
        if len(copies) > _FEW_COPIES and region.nbytes < len(copies) * _SMALL_COPY:
            # Many small pieces (the rows of column chunks): a kernel copy each would cost a system call per
            # row; read_region reads each chunk's rows in one piece and they go out in one write per block.
            for block in row_blocks(region, max(1, min(self.max_memory // 2, _GATHER_BLOCK))):  # held twice
                data = read_region(block, self.files)
                os.pwrite(out, data, pos)
                pos += len(data)
            return
        for cp in copies:
            fd = self.files.fd(cp.src.file, cp.src.offset + cp.src.length, start=cp.src.offset, key=region.entry.key)
            self._copy_range(fd, out, cp.src.offset, pos + cp.dst, cp.src.length)

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
        # A block's source bytes and their cast copy are alive at once, so a row costs its size in both dtypes;
        # row_blocks counts the block in the cast dtype alone.
        both = region.entry.dtype.itemsize + cast.itemsize
        for block in row_blocks(region, max(1, self.max_memory * cast.itemsize // both)):
            data = _cast(read_region(block, self.files), block.entry.dtype, cast)
            os.pwrite(out, data, pos)
            pos += len(data)


def write_files(files: tuple[FilePlan, ...], stage: Path, *, max_memory: int = DEFAULT_MAX_MEMORY,
                fsync: bool = False, progress: Callable[[int], None] = lambda n: None,
                names: dict[str, Path] | None = None) -> None:
    """Write ``files`` under the existing directory ``stage``. An error while writing names the file by
    ``names`` (relpath to the path the user will see: the destination, not the staging directory)."""
    with Files() as sources:
        writer = _Writer(sources, max_memory, progress)
        for fp in files:
            path = stage / fp.relpath
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    writer.write_file(out, fp.parts)
                    if fsync:
                        os.fsync(out)
                finally:
                    os.close(out)
            except OSError as e:
                if e.errno is None:
                    raise
                name = (names or {}).get(fp.relpath, path)
                raise OSError(e.errno, f"{e.strerror} (writing {name})") from e


def _names(plan: WritePlan, dst: Path) -> dict[str, Path]:
    return {fp.relpath: dst if plan.single_file else dst / fp.relpath for fp in plan.files}


def execute(plan: WritePlan, dst: Path, *, overwrite: bool = False, sources: tuple[Path, ...] = (),
            max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False,
            progress: Callable[[int], None] = lambda n: None) -> Path:
    """Write every file of ``plan`` under a staging directory and move the result to ``dst`` atomically."""
    dst = check_destination(dst, overwrite=overwrite, sources=sources)
    with stage(dst, replace=overwrite) as staging:
        write_files(plan.files, staging.path, max_memory=max_memory, fsync=fsync, progress=progress,
                    names=_names(plan, dst))
        staging.commit(replace=overwrite, file=plan.files[0].relpath if plan.single_file else None, fsync=fsync)
    return dst


def execute_distributed(plan: WritePlan, dst: Path, *, overwrite: bool = False, sources: tuple[Path, ...] = (),
                        max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False) -> Path:
    """``execute`` with the files split round-robin over the ranks of the default process group.

    Every rank must pass the same plan (planning is pure, so the same inputs give it). Rank 0 checks the
    destination and stages; every rank writes its share into that one staging directory; rank 0 publishes
    once all have written, and every rank returns, or raises, with rank 0's outcome.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dst = Path(dst).absolute()
    staging: Staging | None = None
    error: BaseException | None = None
    if rank == 0:
        try:
            check_destination(dst, overwrite=overwrite, sources=sources)
            staging = stage(dst, replace=overwrite)
        except Exception as e:  # told to every rank below, so none waits forever
            error = e
    shared: list = [(str(error), None) if error else (None, str(staging.path) if staging else None)]
    dist.broadcast_object_list(shared, src=0)
    message, where = shared[0]
    if message is not None:
        raise error if error is not None else UsageError(message)
    staging = staging or Staging(dst, Path(where), owner=False)
    try:
        write_files(plan.files[rank::world], staging.path, max_memory=max_memory, fsync=fsync,
                    names=_names(plan, dst))
        failed = None
    except Exception as e:
        failed = e
    outcomes: list[str | None] = [None] * world
    dist.all_gather_object(outcomes, None if failed is None else f"rank {rank}: {failed}")
    problems = [o for o in outcomes if o]
    published: str | None = None
    if rank == 0:
        try:
            if problems:
                staging.abort()
            else:
                staging.commit(replace=overwrite, file=plan.files[0].relpath if plan.single_file else None,
                               fsync=fsync)
        except Exception as e:
            published, failed = f"rank 0: {e}", e
    outcome = [published]
    dist.broadcast_object_list(outcome, src=0)
    if problems or outcome[0]:
        raise failed if failed else FormatError("; ".join(problems + [o for o in outcome if o]))
    return dst

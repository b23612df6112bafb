"""Parallel writing: a plan's files split over processes, on one machine or over the ranks of a process group.

Planning is pure, so every process given the same inputs holds the same plan. Each process writes the files
of its share (:func:`ckptkit.core.plan.split_files`: about equal bytes) into one staging directory
(:mod:`ckptkit.io.publish`), and one process publishes it once every share is written and every file has
its planned size. The output is the one a single process writes, byte for byte, and it is complete or
absent: a failure in any process removes the staging directory and fails the whole run.

Two ways to get the processes:

- :func:`execute_parallel` (``--workers N``): the calling process checks DST, stages, starts N worker
  processes (spawned: a fresh interpreter is safe whatever threads or OpenMP pools the caller started;
  forking is not), shows their progress, waits, and publishes.
- :func:`execute_ranks`: every rank of the default process group (``torchrun ... -m ckptkit``, or a training
  job's group in a save hook). The calls every rank makes, in order:

  0. the job (reading, planning, writing) runs inside :func:`all_ranks` (the ops' ``distributed=True``);
  1. an ``all_gather`` in which every rank says whether it got as far as writing: one that failed before
     casts its error instead, so that no rank waits for it, and every rank raises;
  2. rank 0 checks DST and makes the staging directory; a ``broadcast`` tells its path (or rank 0's error);
  3. each rank writes its share; an ``all_gather`` collects the outcomes;
  4. rank 0 publishes, or aborts if any rank failed; a ``broadcast`` tells every rank how it went.

:func:`torchrun_group` makes (or finds) the default process group for the CLI under torchrun.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from .. import errors
from ..core.plan import FilePlan, WritePlan, split_files
from ..errors import CheckpointError, FormatError, UsageError
from .execute import DEFAULT_MAX_MEMORY, _names, execute, write_files
from .publish import Staging, check_destination, stage

__all__ = ["all_ranks", "execute_parallel", "execute_ranks", "torchrun_group"]

P = ParamSpec("P")
R = TypeVar("R")

_POLL = 0.2
"""Seconds between progress updates while workers run."""
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
"""The environment torchrun gives each process it starts; a process group forms from it (``env://``)."""
_GROUP_TIMEOUT = timedelta(hours=24)
"""How long a collective of a group made by :func:`torchrun_group` waits. Ranks wait at step 3 for the
slowest share of a job that may take hours; a rank that dies is noticed sooner (its connections close, and
torchrun stops the others), so this only bounds a rank that hangs alive."""


# --------------------------------------------------------------------------------------------------------
# Shared by both: the check before publishing


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
# Workers on one machine


def _worker(files: tuple[FilePlan, ...], where: Path, max_memory: int, fsync: bool, names: dict[str, Path],
            done: Any, index: int, outcome: Connection) -> None:
    # Ctrl-C reaches the whole process group, and Slurm's SIGTERM every process of the job: the parent answers
    # for all (stops the workers, removes the staging directory, says so in one line). A worker says nothing:
    # it ignores Ctrl-C and dies of SIGTERM, whatever handlers the console script it re-imports installed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def progress(n: int) -> None:
        done[index] += n  # this worker's slot alone: no lock

    try:
        write_files(files, where, max_memory=max_memory, fsync=fsync, progress=progress, names=names)
    except Exception as e:
        outcome.send(_portable(e))
    else:
        outcome.send(None)


def _portable(e: Exception) -> Exception:
    """``e`` as another process can unpickle it: OSError and ckptkit's errors are; anything else as FormatError."""
    if isinstance(e, (OSError, CheckpointError)) and type(e).__module__ in ("builtins", errors.__name__):
        return e
    return FormatError(f"{type(e).__name__}: {e}")


def _write_in_workers(shares: tuple[tuple[FilePlan, ...], ...], where: Path, names: dict[str, Path], *,
                      max_memory: int, fsync: bool, progress: Callable[[int], None]) -> None:
    """Write each share in a worker process of its own; raise the first failure after stopping the others."""
    ctx = multiprocessing.get_context("spawn")
    done = ctx.RawArray("q", len(shares))
    running: dict[Connection, multiprocessing.process.BaseProcess] = {}
    workers = []
    reported = 0
    try:
        for i, share in enumerate(shares):
            receive, send = ctx.Pipe(duplex=False)
            own = {fp.relpath: names[fp.relpath] for fp in share}
            p = ctx.Process(target=_worker, args=(share, where, max_memory, fsync, own, done, i, send),
                            name=f"ckptkit-worker-{i}", daemon=True)
            p.start()
            send.close()  # the worker holds the only writing end now: its death reads as EOF
            running[receive] = p
            workers.append(p)
        while running:
            ready = wait(list(running), timeout=_POLL)
            total = sum(done)
            progress(total - reported)
            reported = total
            for conn in cast(list[Connection], ready):
                finished = running.pop(conn)
                try:
                    failure = conn.recv()
                except EOFError:  # gone without a word: killed (the OOM killer, a signal)
                    finished.join()
                    failure = FormatError(f"worker process {finished.name} died (exit code {finished.exitcode}) "
                                          "before writing its files")
                conn.close()
                if failure is not None:
                    raise failure
    finally:
        for p in workers:
            if p.is_alive():
                p.terminate()
        for p in workers:
            p.join()
        for receive in running:
            receive.close()


def execute_parallel(plan: WritePlan, dst: Path, *, workers: int, overwrite: bool = False,
                     sources: tuple[Path, ...] = (), max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False,
                     progress: Callable[[int], None] = lambda n: None) -> Path:
    """:func:`ckptkit.io.execute.execute` with the files split over ``workers`` processes on this machine.

    One worker (or a plan of one file) writes in this process. ``max_memory`` is the budget of them all: each
    worker casts in blocks of its equal part. Workers are spawned, so a script that calls this must do so
    under ``if __name__ == "__main__":``, as for any spawning multiprocessing (the CLI does).
    """
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    shares = tuple(s for s in split_files(plan.files, workers) if s)
    if len(shares) < 2:
        return execute(plan, dst, overwrite=overwrite, sources=sources, max_memory=max_memory, fsync=fsync,
                       progress=progress)
    dst = check_destination(dst, overwrite=overwrite, sources=sources)
    with stage(dst, replace=overwrite) as staging:
        _write_in_workers(shares, staging.path, _names(plan, dst), max_memory=max(1, max_memory // len(shares)),
                          fsync=fsync, progress=progress)
        _publish(plan, staging, overwrite=overwrite, fsync=fsync)
    return dst


# --------------------------------------------------------------------------------------------------------
# Ranks of a process group


_vote_owed = False
"""Whether this process, inside :func:`all_ranks`, has yet to cast its vote of step 1."""


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
    dist.all_gather_object(outcomes, _failure(e))
    return [(rank, failure) for rank, failure in enumerate(outcomes) if failure is not None]


def _vote(e: BaseException | None) -> None:
    """Step 1: every rank says whether it is ready to write; raise on every rank that is, if any is not."""
    global _vote_owed
    _vote_owed = False
    failed = _gather(e)
    if failed and e is None:
        raise _from_rank(*failed[0])


def all_ranks(fn: Callable[P, R]) -> Callable[P, R]:
    """For a function that writes through :func:`execute_ranks` when called with ``distributed=True``: an
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
        _vote_owed = True
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
        return result

    return run


def _write_share(plan: WritePlan, staging: Staging, dst: Path, rank: int, world: int, *, max_memory: int,
                 fsync: bool) -> Exception | None:
    """Step 3 on one rank: write its share; return the error instead of raising it, for the others to hear."""
    try:
        if not staging.path.is_dir():
            raise UsageError(f"{staging.path}, rank 0's staging directory beside DST, is not visible from rank "
                             f"{rank}: DST must be on a filesystem every rank shares")
        write_files(split_files(plan.files, world)[rank], staging.path, max_memory=max_memory, fsync=fsync,
                    names=_names(plan, dst))
    except Exception as e:
        return e
    return None


def execute_ranks(plan: WritePlan, dst: Path, *, overwrite: bool = False, sources: tuple[Path, ...] = (),
                  max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False) -> Path:
    """Write ``plan`` to ``dst`` from every rank of the default process group, each its share of the files.

    Every rank must pass the same plan (planning is pure, so the same inputs give it) and call this once
    the job's reading and planning are done; rank 0 publishes once all have written, and every rank returns,
    or raises, with the run's outcome (a rank's own error, else the first other rank's, named "rank N: ...").
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dst = Path(dst).absolute()
    _vote(None)
    staging: Staging | None = None
    error: Exception | None = None
    if rank == 0:
        try:
            check_destination(dst, overwrite=overwrite, sources=sources)
            staging = stage(dst, replace=overwrite)
        except Exception as e:  # told to every rank below, so none waits forever
            error = e
    shared: list[Any] = [_failure(error) if error else str(staging.path) if staging else None]
    dist.broadcast_object_list(shared, src=0)
    if error is not None:
        raise error
    if isinstance(shared[0], tuple):
        raise _from_rank(0, shared[0])
    staging = staging or Staging(dst, Path(shared[0]), owner=False)
    with staging:  # rank 0's is removed on every way out but its publishing: a signal, a lost rank
        failed = _write_share(plan, staging, dst, rank, world, max_memory=max_memory, fsync=fsync)
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
        dist.broadcast_object_list(outcome, src=0)
    if failed is not None:
        raise failed
    if problems:
        raise _from_rank(*problems[0])
    if published is not None:
        raise published
    if outcome[0] is not None:
        raise _from_rank(0, outcome[0])
    return dst


@contextlib.contextmanager
def torchrun_group() -> Iterator[int | None]:
    """This process's rank when torchrun started it among others (``WORLD_SIZE`` > 1, and ``RANK``,
    ``LOCAL_RANK`` and ``MASTER_ADDR`` set, as torchrun and launchers like it set them), else None.

    The default process group is used if it exists, else made here (gloo, from torchrun's ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) and destroyed on the way out. A collective that
    fails because another rank died or left becomes a one-line ``ConnectionError`` naming this rank.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r}: expected a number of ranks (torchrun sets "
                         "it)") from None
    if world <= 1 or not all(name in os.environ for name in _TORCHRUN):
        yield None
        return
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", timeout=_GROUP_TIMEOUT)
    rank = dist.get_rank()
    try:
        yield rank
    except dist.DistError as e:
        first = next(iter(str(e).strip().splitlines()), type(e).__name__)
        raise ConnectionError(f"rank {rank}: lost the other ranks ({first})") from e
    finally:
        if made:
            dist.destroy_process_group()

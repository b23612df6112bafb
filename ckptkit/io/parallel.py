"""Parallel writing: a plan's bytes split over processes, on one machine or over the ranks of a process group.

Planning is pure, so every process given the same inputs holds the same plan. The plan is cut into shares of
about equal bytes (:func:`ckptkit.core.split.split_work`): small files whole, and a large file in byte ranges
where its bytes cost work outside the write (a dtype cast, a computed tensor), so that one large output file
(an ``export-hf --dtype bf16`` of one safetensors file) is cast by several processes at once. On one machine a
file of copied bytes stays whole: writers of one file take turns at its lock (:func:`_cut_files`). Ranks of
a process group, each on its own machine, cut it all the same.
One process stages the output, every file at its planned size (:meth:`ckptkit.io.storage.Storage.stage`);
each process joins it and writes its ranges at their offsets (:meth:`~ckptkit.io.storage.Staged.write`); one
process commits once every share is written and every file has its planned size. The output is the one a
single process writes, byte for byte, and it is complete or absent: a failure in any process aborts the staged
output and fails the whole run. Only a storage with ``shared_writes`` (a local or shared filesystem) is written
by several processes.

Two ways to get the processes:

- :func:`execute_parallel` (``--workers N``): the calling process checks DST, stages, starts N - 1 worker
  processes (spawned: a fresh interpreter is safe whatever threads or OpenMP pools the caller started, after
  a cast in torch, say; forking is not), writes the first share itself, shows their progress, waits, and
  publishes. The planning stays in
  the calling process: a worker gets its share as packed byte moves (:mod:`ckptkit.io.moves`), reads no
  ``.metadata`` or header, plans nothing, and imports no torch unless its share casts a dtype.
- every rank of the default process group: :func:`ckptkit.io.execute.execute_distributed`, which
  :func:`torchrun_group` sets up for the CLI under ``torchrun ... -m ckptkit`` (a training job's group
  serves a save hook).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from .. import errors
from ..core.plan import Region, WritePlan
from ..core.split import Slice, Work, choose_writers, split_work
from ..errors import CheckpointError, FormatError, UsageError
from .checks import checking
from .execute import GROUP_TIMEOUT, execute, streamed
from .moves import Moves, pack
from .options import WriteOptions
from .progress import count
from .storage import Staged, Storage, storage_for
from .storage.local.writer import write_cap

if TYPE_CHECKING:  # multiprocessing is imported where workers start: a run without them never loads it
    import multiprocessing
    from multiprocessing.connection import Connection

__all__ = ["cores", "execute_parallel", "free_memory", "torchrun_group", "writers"]

_PR_SET_PDEATHSIG = 1
"""prctl(2): the signal this process gets when its parent dies."""
_POLL = 0.2
"""Seconds between progress updates while workers run."""
_STOPS = {signal.SIGINT, signal.SIGTERM}
"""The signals that stop a run (Ctrl-C, and SIGTERM from Slurm or Kubernetes)."""
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
"""The environment torchrun gives each process it starts; a process group forms from it (``env://``)."""


# --------------------------------------------------------------------------------------------------------
# Workers on one machine


def _worker(share: tuple[Moves, ...] | tuple[Slice, ...], storage: Storage, dst: Any, token: str,
            single_file: bool, readers: tuple[Storage, ...], max_memory: int, fsync: bool, stream: bool, done: Any,
            index: int, outcome: Connection, parent: int) -> None:
    # Ctrl-C reaches the whole process group, and Slurm's SIGTERM every process of the job: the parent answers
    # for all (stops the workers, removes the staging directory, says so in one line). A worker says nothing:
    # it ignores Ctrl-C and dies of SIGTERM, whatever handlers the console script it re-imports installed.
    # ``readers``, the storages of the sources, came with their state (an object store's --storage-options).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with(parent)

    def progress(n: int) -> None:
        done[index] += n  # this worker's slot alone: no lock

    try:
        staged = storage.join(dst, token, single_file=single_file, who=f"worker {index}")
        staged.write(share, max_memory=max_memory, fsync=fsync, progress=progress, streamed=stream)
    except Exception as e:
        outcome.send(_portable(e))
    else:
        outcome.send(None)


def _die_with(parent: int) -> None:
    """Have the kernel kill this worker when its parent dies (SIGKILL, the OOM killer): it would otherwise
    write on into a staging directory that the next run removes, and recreate it (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took
        os._exit(1)


def _start(p: multiprocessing.process.BaseProcess) -> None:
    """Start worker ``p`` with Ctrl-C and SIGTERM held until it has its share: a signal halfway through would
    leave a process that nobody stops (its pid not yet known), reading a share cut short. Held in Python, not
    by a signal mask, which cannot hold a signal that arrived a moment before (and which the worker would
    inherit); only the main thread handles signals, so only there is there anything to hold."""
    if threading.current_thread() is not threading.main_thread():
        p.start()
        return
    held: list[int] = []
    handlers = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in _STOPS
                if signal.getsignal(s) not in (signal.SIG_IGN, None)}  # None: set outside Python, kept
    try:
        p.start()
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for signum in held[:1]:
            signal.raise_signal(signum)  # to the run's own handler, now that the worker can be stopped


def _portable(e: Exception) -> Exception:
    """``e`` as another process can unpickle it: OSError and ckptkit's errors are; anything else as FormatError."""
    if isinstance(e, (OSError, CheckpointError)) and type(e).__module__ in ("builtins", errors.__name__):
        return e
    return FormatError(f"{type(e).__name__}: {e}")


def _write_in_workers(shares: tuple[tuple[Slice, ...], ...], storage: Storage, staged: Staged, *,
                      single_file: bool, readers: tuple[Storage, ...], max_memory: int, fsync: bool, stream: bool,
                      progress: Callable[[int], None]) -> None:
    """Write the first share in this process and each other share in a worker process of its own, which joins
    ``staged``; raise the first failure after stopping the workers.

    A share of local sources travels packed (:func:`.moves.pack`), each packed just before its worker starts,
    so that the workers started first import while later shares are packed; this process then writes its own
    share, which costs neither a start nor a pack."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    done = ctx.RawArray("q", len(shares))
    running: dict[Connection, multiprocessing.process.BaseProcess] = {}
    workers: list[multiprocessing.process.BaseProcess] = []
    reported = 0

    def report(own: int = 0) -> None:
        nonlocal reported
        done[0] += own
        total = sum(done)
        progress(total - reported)
        reported = total

    try:
        for i, share in enumerate(shares[1:], 1):
            receive, send = ctx.Pipe(duplex=False)
            job = share if stream else tuple(pack(s, write_cap(max_memory)) for s in share)
            p = ctx.Process(target=_worker, args=(job, storage, staged.dst, staged.token, single_file, readers,
                                                  max_memory, fsync, stream, done, i, send, os.getpid()),
                            name=f"ckptkit-worker-{i}", daemon=True)
            workers.append(p)
            _start(p)
            send.close()  # the worker holds the only writing end now: its death reads as EOF
            running[receive] = p
        staged.write(shares[0], max_memory=max_memory, fsync=fsync, progress=report, streamed=stream)
        _wait(running, report)
    finally:
        started = [p for p in workers if p.pid is not None]
        for w in started:
            if w.is_alive():
                w.kill()  # what it wrote is in the staging directory, which goes; a worker still starting up
                # would answer SIGTERM with the console script's own "terminated" line
        for w in started:
            w.join()
        for receive in running:
            receive.close()


def _wait(running: dict[Connection, multiprocessing.process.BaseProcess], report: Callable[[], None]) -> None:
    """Wait for the workers ``running``, reporting progress; raise the first failure one reports (or its death)."""
    from multiprocessing.connection import wait

    while running:
        ready = wait(list(running), timeout=_POLL)
        report()
        for conn in cast("list[Connection]", ready):
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


def cores() -> int:
    """The cores this process may run on (its CPU affinity: ``taskset``, a container's or Slurm's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def writers(workers: int | str, plan: WritePlan, storage: Storage, sources: tuple[Any, ...] = ()) -> tuple[int, str]:
    """How many processes :func:`execute_parallel` should write ``plan`` with, and why, in words.

    Args:
        workers: a count, or ``"auto"``: as many as pay on this machine for this plan
            (:func:`ckptkit.core.split.choose_writers` over :func:`cores` and :func:`free_memory`); one where
            ``storage`` has no ``shared_writes`` (an object store).
        plan: what will be written.
        storage: where.
        sources: the files read (streamed ones keep each file whole, as one writer streams it).

    Returns:
        The count and the reason, for the report (none for one process asked for).

    Raises:
        UsageError: ``workers`` is neither ``"auto"`` nor a count of at least 1.
    """
    if workers != "auto":
        try:
            n = int(workers)
        except ValueError:
            n = 0
        if n < 1 or str(n) != str(workers).strip():
            raise UsageError(f"--workers: expected auto or a number of processes of at least 1, got {workers!r}")
        if n == 1:
            return 1, ""
        cut = _cut_files(plan, sources)
        shares = sum(1 for share in split_work(plan.files, n, cut_files=cut) if share)
        if shares < n:
            why = ("too little to share" if cut else f"{count(len(plan.files), 'file')} of copied bytes, and a "
                   "file is written by one process (two would take turns at its lock)")
            return shares, f"--workers {n}: {why}"
        return n, f"--workers {n}"
    if not storage.shared_writes:
        return 1, "auto: an object store is written by one process"
    n, why = choose_writers(Work.of(plan.files, cut_files=_cut_files(plan, sources)), cores(), free_memory())
    return n, f"auto: {why}"


def free_memory() -> int | None:
    """Bytes of memory free now, outside the page cache (``MemFree`` of ``/proc/meminfo``); None elsewhere."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemFree:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cut_files(plan: WritePlan, sources: tuple[Any, ...]) -> bool:
    """Whether this machine's writers may share a file, each its byte ranges: only where its bytes cost work
    outside the write itself (a dtype cast, a computed tensor). A file of copied bytes is written by one
    process: a local filesystem takes the file's lock for every write into it (ext4's and XFS's buffered
    writes, ``copy_file_range`` among them), so two writers of one file take turns, each paying its start,
    and on a busy machine a writer descheduled while it holds the lock stalls the other. A streamed source
    (an object store's) is read whole by one writer either way."""
    if streamed(sources):
        return False
    return any(isinstance(p, Region) and (p.cast is not None or p.entry.derived is not None)
               for f in plan.files for p in f.parts)


def execute_parallel(plan: WritePlan, dst: Any, storage: Storage, options: WriteOptions,
                     progress: Callable[[int], None] = lambda n: None, sources: tuple[Any, ...] = ()) -> Any:
    """:func:`ckptkit.io.execute.execute` with the files split over ``options.workers`` processes (a count) on
    this machine.

    This process writes one share and ``workers - 1`` worker processes the others; one worker (or a plan too
    small to share) writes in this process alone. ``max_memory`` is the budget of them all: each casts in
    blocks of its equal part. Workers are spawned, so a script that calls this must do so
    under ``if __name__ == "__main__":``, as for any spawning multiprocessing (the CLI does).

    Raises:
        UsageError: fewer than one worker, or several for a storage without ``shared_writes``.
    """
    workers = int(options.workers)
    if workers < 1:
        raise UsageError(f"--workers must be at least 1, got {workers}")
    stream = streamed(sources)
    shares = tuple(s for s in split_work(plan.files, workers, cut_files=_cut_files(plan, sources)) if s)
    if len(shares) < 2:  # one file of copied bytes, say: this process alone writes it
        return execute(plan, dst, storage, options, progress, sources)
    if not storage.shared_writes:
        raise UsageError(f"{dst}: --workers write to a local or shared filesystem; an object store is written by "
                         "one process (leave out --workers)")
    dst = storage.check(dst, overwrite=options.overwrite, sources=sources)
    readers = tuple({type(r): r for r in map(storage_for, sources) if not r.descriptors}.values())
    with storage.stage(dst, plan, overwrite=options.overwrite, fsync=options.fsync) as staged:
        with checking(plan.checks, options.max_memory) as checks:  # in this process, while the workers write
            _write_in_workers(shares, storage, staged, single_file=plan.single_file, readers=readers,
                              max_memory=max(1, options.max_memory // len(shares)), fsync=options.fsync,
                              stream=stream, progress=checks.watch(progress))
        staged.commit()
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
        dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    rank = dist.get_rank()
    try:
        yield rank
    except dist.DistError as e:
        first = next(iter(str(e).strip().splitlines()), type(e).__name__)
        raise ConnectionError(f"rank {rank}: lost the other ranks ({first})") from e
    finally:
        if made:
            dist.destroy_process_group()

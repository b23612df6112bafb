"""Execution: stream a :class:`WritePlan` into whichever storage it is given, complete or absent.

:func:`execute` makes the calls of :class:`~ckptkit.io.storage.Storage` in order: check the destination,
stage, write every piece, commit (or abort on any failure). The staged write is the one step that
:mod:`ckptkit.io.parallel`'s worker processes and :func:`execute_distributed`'s ranks share.

:func:`execute_distributed` splits the files over the ranks of the default process group (torchrun, a
training job's group in a save hook); every rank plans the whole job. The calls every rank makes, in order:

0. the job (reading, planning, writing) runs inside :func:`all_ranks` (the ops' ``distributed=True``);
1. an ``all_gather`` in which every rank says whether it got as far as writing: one that failed before
   casts its error instead, so that no rank waits for it, and every rank raises;
2. rank 0 checks DST and stages the output (every output file made at its planned size); a ``broadcast``
   tells the staged output's token (or rank 0's error), by which the other ranks join it;
3. each rank writes its share (:func:`ckptkit.core.split.split_work`: whole files, and byte ranges of large
   ones, into the files rank 0 made at their sizes); an ``all_gather`` collects the outcomes;
4. rank 0 commits once every file has its planned size, or aborts if any rank failed; a ``broadcast``
   tells every rank how it went.

:mod:`ckptkit.io.parallel` splits the files over worker processes of one machine instead.
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from .. import errors
from ..core.plan import WritePlan
from ..core.split import Slice, shares_inputs, split_work
from ..errors import CheckpointError, FormatError, UsageError
from .options import WriteOptions
from .storage import Staged, Storage, storage_for

__all__ = ["GROUP_TIMEOUT", "all_ranks", "execute", "execute_distributed", "gloo_group", "streamed"]

P = ParamSpec("P")
R = TypeVar("R")


def streamed(sources: tuple[Any, ...]) -> bool:
    """Whether any of ``sources`` is streamed by its storage (no descriptors): read by ranged requests, each
    output file front to back."""
    return any(not storage_for(src).descriptors for src in sources)


def execute(plan: WritePlan, dst: Any, storage: Storage, options: WriteOptions,
            progress: Callable[[int], None] = lambda n: None, sources: tuple[Any, ...] = ()) -> Any:
    """Write every file of ``plan`` to ``dst`` on ``storage``: checked, staged, written, committed.

    Args:
        plan: what to write.
        dst: where, a path of ``storage``'s.
        storage: the storage ``dst`` is on.
        options: ``overwrite``, ``max_memory`` and ``fsync`` apply.
        progress: called with the bytes written since the last call.
        sources: what DST must stay clear of (the input and every file read).

    Returns:
        ``dst``, as the storage checked it (a local path made absolute).

    Raises:
        UsageError: DST exists (without ``overwrite``), overlaps a source, or cannot be written.
        CheckpointError: a source is short or unreadable.
        OSError: a write failed.
    """
    dst = storage.check(dst, overwrite=options.overwrite, sources=sources)
    with storage.stage(dst, plan, overwrite=options.overwrite, fsync=options.fsync) as staged:
        stream = streamed(sources)
        staged.write(whole_files(plan, storage.shared_writes and not stream), max_memory=options.max_memory,
                     fsync=options.fsync, progress=progress, streamed=stream)
        staged.commit()
    return dst


def whole_files(plan: WritePlan, in_any_order: bool = False) -> tuple[Slice, ...]:
    """Every file of ``plan`` as one share: whole, or where its byte ranges may be written in ``in_any_order``
    and it computes tensors, in the order :func:`ckptkit.core.split.split_work` writes them (an FP8 weight's
    values before its scales, which are computed with them)."""
    if in_any_order and any(shares_inputs(fp) for fp in plan.files):
        return split_work(plan.files, 1)[0]
    return tuple(Slice(fp.relpath, 0, fp.parts) for fp in plan.files)


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
    """For a function that writes through :func:`execute_distributed` when called with ``distributed=True`` (a
    keyword, or the field of its ``options``, which the keyword overrides): an error on any rank before it
    writes (a source it cannot read, a bad option) fails every rank, instead of leaving the others waiting for
    it at the first collective."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        global _vote_owed
        options = kwargs.get("options")
        default = isinstance(options, WriteOptions) and options.distributed
        if not kwargs.get("distributed", default):
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


def _write_share(plan: WritePlan, staged: Staged, rank: int, world: int, options: WriteOptions,
                 sources: tuple[Any, ...]) -> Exception | None:
    """Step 3 on one rank: write its share; return the error instead of raising it, for the others to hear."""
    try:
        stream = streamed(sources)
        staged.write(split_work(plan.files, world, cut_files=not stream)[rank], max_memory=options.max_memory,
                     fsync=options.fsync, streamed=stream)
    except Exception as e:
        return e
    return None


def _stage_on_rank0(plan: WritePlan, dst: Any, storage: Storage, options: WriteOptions,
                    sources: tuple[Any, ...]) -> tuple[Staged | None, Exception | None]:
    """Step 2 on rank 0: check DST and stage the output; the error instead of raising it."""
    staged: Staged | None = None
    try:
        dst = storage.check(dst, overwrite=options.overwrite, sources=sources)
        staged = storage.stage(dst, plan, overwrite=options.overwrite, fsync=options.fsync)
    except Exception as e:  # told to every rank below, so none waits forever
        return None, e
    return staged, None


def execute_distributed(plan: WritePlan, dst: Any, storage: Storage, options: WriteOptions,
                        sources: tuple[Any, ...] = ()) -> Any:
    """``execute`` from every rank of the default process group, each writing its share of the files.

    Every rank must pass the same plan (planning is pure, so the same inputs give it) and call this once
    the job's reading and planning are done (steps 1-4 of the module's docstring); rank 0 commits once all
    have written, and every rank returns, or raises, with the run's outcome (a rank's own error, else the
    first other rank's, named "rank N: ...").

    Raises:
        UsageError: ``storage`` cannot have several processes write one output (an object store).
    """
    import torch.distributed as dist

    if not storage.shared_writes:
        raise UsageError(f"{dst}: distributed writes go to a local or shared filesystem; an object store is written "
                         "by one process")
    rank, world = dist.get_rank(), dist.get_world_size()
    dst = storage.path(dst).absolute()
    _vote(None)
    staged, error = _stage_on_rank0(plan, dst, storage, options, sources) if rank == 0 else (None, None)
    shared: list[Any] = [_failure(error) if error else staged.token if staged else None]
    try:
        dist.broadcast_object_list(shared, src=0, group=_group)
    except BaseException:  # a lost rank, a signal: rank 0's staged output goes with the run
        if staged is not None:
            staged.abort()
        raise
    if error is not None:
        raise error
    if isinstance(shared[0], tuple):
        raise _from_rank(0, shared[0])
    if staged is None:
        try:
            staged = storage.join(dst, shared[0], single_file=plan.single_file, who=f"rank {rank}")
        except Exception as e:  # heard by the others in step 3, as a failed write is
            _outcome(rank, None, e)
            raise
    with staged:  # rank 0's is removed on every way out but its commit: a signal, a lost rank
        _outcome(rank, staged, _write_share(plan, staged, rank, world, options, sources))
    return dst


def _outcome(rank: int, staged: Staged | None, failed: Exception | None) -> None:
    """Steps 3 (its ``all_gather``) and 4: rank 0 commits or aborts; every rank raises the run's failure."""
    import torch.distributed as dist

    problems = _gather(failed)
    published: Exception | None = None
    if rank == 0 and staged is not None:
        try:
            if problems:
                staged.abort()
            else:
                staged.commit()
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

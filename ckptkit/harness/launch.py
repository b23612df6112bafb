"""Start N real ranks (``torch.multiprocessing`` spawn, gloo or NCCL, ``file://`` rendezvous) and collect
what each returns."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DEFAULT_DEADLINE", "run_ranks"]

DEFAULT_DEADLINE = 300.0
"""Seconds a group of ranks may run in all before :func:`run_ranks` kills it (tests, the demo)."""


def _entry(rank: int, fn: Callable, world: int, rdv: str, backend: str, args: tuple, results,
           timeout: float | None, cuda: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # When a peer fails, spawn ends the others by SIGTERM: the parent reports the failure, so a rank goes
    # quietly rather than through the ckptkit command's own "terminated" line (its handler came with the import).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A rank killed by a signal (SIGSEGV in a collective) leaves no Python traceback of its own: faulthandler
    # writes every thread's stack to this file, which run_ranks appends to the error.
    faulthandler.enable(open(_fault_file(rdv, rank), "w"), all_threads=True)  # noqa: SIM115  (open until exit)
    if cuda:
        # A GPU of its own where there are enough; else ranks share them, which gloo allows and NCCL does not.
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=None if timeout is None else timedelta(seconds=timeout))
    try:
        results.put((rank, fn(rank, world, *args), None))
        dist.barrier()
    except BaseException as e:  # report, then let spawn see the failure too
        results.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        dist.destroy_process_group()
        raise
    # gloo's native teardown aborts now and then when several ranks share 2 cores ("terminate called
    # without an active exception", after the work is done and reported). A rank that succeeded has
    # nothing left to flush, so it leaves without running destructors.
    os._exit(0)


def _fault_file(rdv: str, rank: int) -> str:
    return os.path.join(os.path.dirname(rdv), f"fault-rank{rank}.txt")


def _stacks(rdv: str, world_size: int) -> str:
    """What faulthandler wrote for ranks that died of a signal: the Python stack each was in."""
    found = []
    for rank in range(world_size):
        try:
            with open(_fault_file(rdv, rank)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            found.append(f"rank {rank} (faulthandler):\n{text}")
    return "\n".join(found)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout: float | None = None, deadline: float | None = DEFAULT_DEADLINE,
              cuda: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``fn`` must be importable (a module-level function) since ranks are spawned, not forked. ``timeout``
    (seconds) bounds each collective, so a rank stuck waiting on a peer raises instead of hanging for the
    backend's default 30 minutes. ``deadline`` (seconds, None for none) bounds the whole group, start-up
    included: past it every rank is killed and :class:`TimeoutError` raised, so that no hang outlives it.
    ``cuda`` (implied by NCCL) makes GPU ``rank % device_count()`` each rank's current device before the group
    starts.

    Raises:
        RuntimeError: a rank raised (its message and traceback are in the error), or died.
        TimeoutError: the group ran past ``deadline``.
    """
    start = time.monotonic()
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # its "Terminating process N via signal SIGTERM": the error says why
    try:
        return _run_group(fn, world_size, args, backend, timeout, deadline, cuda, start)
    finally:
        spawn_log.setLevel(level)


def _run_group(fn: Callable[..., Any], world_size: int, args: tuple, backend: str, timeout: float | None,
               deadline: float | None, cuda: bool, start: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    out: dict[int, Any] = {}
    errors: list[str] = []

    def drain() -> None:
        # Read results as they come: a rank blocks on a full pipe until someone does.
        while not results.empty():
            rank, value, error = results.get()
            if error:
                errors.append(f"rank {rank} of {world_size} failed: {error}")
            else:
                out[rank] = value

    with tempfile.TemporaryDirectory(prefix="ckptkit-rdv-") as tmp:
        rdv = os.path.join(tmp, "rendezvous")
        group = mp.start_processes(_entry, args=(fn, world_size, rdv, backend, args, results, timeout,
                                                        cuda or backend == "nccl"),
                                   nprocs=world_size, join=False, start_method="spawn")
        try:
            while not group.join(timeout=0.5):
                drain()
                if deadline is not None and time.monotonic() - start > deadline:
                    raise TimeoutError(f"{world_size} ranks of {fn.__module__}.{fn.__qualname__} ran past the "
                                       f"deadline of {deadline:g} s; all of them were killed "
                                       f"(ranks {sorted(out)} had returned)")
        except mp.ProcessRaisedException:
            pass  # join killed the other ranks; the rank's own message is in results
        except mp.ProcessExitedException as e:
            stacks = _stacks(rdv, world_size)
            errors.append(f"rank {e.error_index} of {world_size} died: {e}" + (f"\n{stacks}" if stacks else ""))
        finally:
            for p in group.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        drain()
    if errors:
        raise RuntimeError(errors[0])
    if len(out) != world_size:
        raise RuntimeError(f"only ranks {sorted(out)} of {world_size} reported back")
    return [out[r] for r in range(world_size)]

"""Start ranks the way a launcher would for a framework's own code: torchrun's environment, no process group.

``ckptkit.harness.launch.run_ranks`` makes the process group itself; accelerate and Lightning make theirs
from the environment (and Lightning launches nothing when it finds ``LOCAL_RANK`` set), so these ranks only
get the variables. Framework-specific CPU tricks stay inside the workers (``_workers.py``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["spawn"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", OMP_NUM_THREADS="1",
                      TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    try:
        results.put((rank, fn(rank, world, *args), None))
    except BaseException as e:
        results.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    # As in run_ranks: gloo's teardown can abort on these shared cores after the work is reported.
    os._exit(0)


def spawn(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with contextlib.suppress(mp.ProcessRaisedException, mp.ProcessExitedException):
        mp.spawn(_entry, args=(fn, world, _free_port(), args, results), nprocs=world, join=True)
    out: dict[int, Any] = {}
    while not results.empty():
        rank, value, error = results.get()
        if error:
            raise RuntimeError(f"rank {rank} of {world} failed: {error}")
        out[rank] = value
    if len(out) != world:
        raise RuntimeError(f"only ranks {sorted(out)} of {world} reported back")
    return [out[r] for r in range(world)]

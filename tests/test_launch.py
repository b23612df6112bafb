"""``ckptkit.harness.launch.run_ranks``, the one way the tests start real ranks: a deadline ends a hung group."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch.distributed as dist

from ckptkit.harness.launch import run_ranks


def _hang_in_a_collective(rank: int, world: int) -> None:
    if rank == 0:
        dist.barrier()  # waits for rank 1, which never comes
    time.sleep(3600)


def test_run_ranks_kills_a_hung_group_at_its_deadline():
    with pytest.raises(TimeoutError, match=r"^2 ranks of test_launch\._hang_in_a_collective ran past the deadline "
                                           r"of 8 s; all of them were killed \(ranks \[\] had returned\)$"):
        run_ranks(_hang_in_a_collective, 2, deadline=8)
    assert multiprocessing.active_children() == []

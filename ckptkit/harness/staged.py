"""FSDP2's all-gather and reduce-scatter staged through CPU memory, for ranks that share GPUs over gloo.

NCCL refuses two ranks on one GPU, so a cell with more FSDP2 ranks than GPUs runs on gloo with CUDA tensors,
and those ranks die with SIGSEGV. FSDP2 (torch 2.13 ``fsdp/_fully_shard/_fsdp_collectives.py``) runs its
all-gather (``dist.all_gather_single``, asynchronous in the forward) and reduce-scatter
(``dist.reduce_scatter_single``, ``ReduceOp.AVG`` in fp32 and bf16) on CUDA buffers it allocates and frees on
side streams of its own, which gloo's CUDA path copies to and from the host on streams of *its* own. Which
collective the ranks die in is not known yet: :func:`.launch.run_ranks` appends each dead rank's Python
stack (faulthandler) to the error, so the next GPU run names it.

``FSDPModule.set_custom_all_gather`` and ``set_custom_reduce_scatter`` (public FSDP2 methods) replace the
two collectives. The ones here copy the CUDA input to the CPU (a blocking copy, ordered after the stream
FSDP2 calls from), all-gather or reduce-scatter the CPU tensors over gloo, as FSDP2 does on a CPU host,
and copy the result back on the same stream: gloo never sees a CUDA tensor, and every copy is ordered by the
stream FSDP2 waits on. On CPU they are exact (the tests train with and without them, bit for bit). Whether
they keep shared-GPU ranks alive is pending a GPU run: set ``CKPTKIT_HARNESS_STAGE_FSDP2=1`` to have the
harness use them, and run its FSDP2 cells on one GPU rather than skip them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["STAGE_ENV", "CpuStagedAllGather", "CpuStagedReduceScatter", "stage_collectives", "staging_enabled"]

STAGE_ENV = "CKPTKIT_HARNESS_STAGE_FSDP2"
"""Set to 1 to run FSDP2 cells with more ranks than GPUs through :func:`stage_collectives` (pending a GPU run)."""


def staging_enabled() -> bool:
    return os.environ.get(STAGE_ENV) == "1"


def _empty(size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class CpuStagedAllGather(AllGather):
    """An all-gather of CPU copies; synchronous whatever ``async_op`` asks (returns no work)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        output = torch.empty_like(output_tensor, device="cpu")
        dist.all_gather_into_tensor(output, input_tensor.cpu(), group=group)
        output_tensor.copy_(output)
        return None


class CpuStagedReduceScatter(ReduceScatter):
    """A reduce-scatter of CPU copies, with FSDP2's reduce op; synchronous (returns no work)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> dist.Work | None:
        output = torch.empty_like(output_tensor, device="cpu")
        dist.reduce_scatter_tensor(output, input_tensor.cpu(), op=op, group=group)
        output_tensor.copy_(output)
        return None


def stage_collectives(model: nn.Module) -> None:
    """Give every FSDP2 module in ``model`` the CPU-staged all-gather and reduce-scatter."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(CpuStagedAllGather())
            module.set_custom_reduce_scatter(CpuStagedReduceScatter())

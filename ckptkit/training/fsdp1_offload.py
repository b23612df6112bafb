"""Loading into FSDP1 with ``CPUOffload(offload_params=True)``: settle the flat parameters first.

FSDP1's lazy init (torch ``fsdp/_flat_param.py``, ``FlatParamHandle.init_flat_param_attributes``) keeps an
offloaded shard in ``flat_param._local_shard``, a *pinned copy* of the flat parameter, while
``flat_param.data`` stays on the unpinned storage the wrapper was built with. Only the first reshard
(``_use_sharded_flat_param``: ``flat_param.data = flat_param._local_shard``) joins the two. A load into a
fresh wrapper runs the lazy init itself and, on some paths, writes straight into ``flat_param.data`` with no
unshard and writeback to ``_local_shard``: ``FULL_STATE_DICT`` under ``NO_SHARD`` with ``use_orig_params``
(``fsdp/_state_dict_utils.py``: ``_should_unshard_params`` is False; FULL_SHARD is NO_SHARD on one rank) and
``LOCAL_STATE_DICT``. The state then reads back bit for bit, and the first forward computes with the
loaded weights; its reshard swaps in ``_local_shard``, still the weights the model was built with, and
backward and the optimizer carry on from those.

Entering and leaving ``summon_full_params`` once before the load runs the lazy init and a reshard, so the
load writes into ``_local_shard`` itself. Found by reading torch 2.13 and checked on CPU with pinning
emulated by a copy (the one property the drift depends on); confirmation on a GPU is pending.
"""

from __future__ import annotations

from torch import nn

__all__ = ["settle_offloaded_fsdp1"]


def settle_offloaded_fsdp1(model: nn.Module) -> bool:
    """Point every CPU-offloaded FSDP1 flat parameter in ``model`` at its pinned shard, before a load.

    Call on every rank (an unshard is collective), before anything is loaded. One FSDP unit is unsharded
    at a time, root first (it runs the lazy init for all of them), so the whole model is never gathered.

    Args:
        model: any module; FSDP1 units without parameter offloading, and other wrappers, are left alone.

    Returns:
        Whether an offloaded FSDP1 unit was found (and settled).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    units = FullyShardedDataParallel.fsdp_modules(model)  # pre-order: the root first
    if not any(unit.cpu_offload.offload_params for unit in units):
        return False
    for unit in units:
        with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
            pass
    return True

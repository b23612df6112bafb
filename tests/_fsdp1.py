"""What real FSDP1 ranks do with LOCAL_STATE_DICT checkpoints, run under ``ckptkit.harness.launch.run_ranks``
(gloo on CPU, ``file://`` rendezvous). Module-level functions, so that spawned ranks can import them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    StateDictType,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fixtures_models import Block, tiny, train_step

AUTO_WRAP = "block:fixtures_models:Block"
MODEL = "fixtures_models:tiny"


def wrap(use_orig_params: bool, param_dtype: str | None = None) -> tuple[FSDP, torch.optim.Optimizer]:
    """``param_dtype`` (``bfloat16``, ``float16``) runs under ``MixedPrecision`` as real configurations set it:
    low-precision parameters, fp32 gradient reduction and buffers. ``cast_forward_inputs`` because the fp32
    buffer ``scale`` makes the root's activations fp32, which a bf16 LayerNorm in a block refuses on CPU."""
    torch.manual_seed(0)  # the same initial weights on every rank
    mixed = None if param_dtype is None else MixedPrecision(
        param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32, buffer_dtype=torch.float32,
        cast_forward_inputs=True)
    model = FSDP(tiny(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params,
                 device_id=torch.device("cpu"), mixed_precision=mixed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model: FSDP, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        return model.state_dict(), FSDP.optim_state_dict(model, optim)


def train_and_save(rank: int, world: int, out: str, use_orig_params: bool, param_dtype: str | None = None) -> None:
    """Two AdamW steps, then save: ``full.pt`` and ``full_optim.pt`` (what torch gathers, taken first),
    ``model/rank{r}.pt`` (the bare LOCAL state dict), ``train/model_rank_{r}.pt`` (model, the flat
    ``optimizer.state_dict()`` and a step counter), ``optim{r}.pt`` (that optimizer state alone) and
    ``layout_of.json`` (what ``ckptkit.save`` records of the live model)."""
    from ckptkit.formats.local.derive import layout_of

    out_dir = Path(out)
    model, optim = wrap(use_orig_params, param_dtype)
    for step in range(2):
        train_step(model, optim, 10 * step + rank)
    full, full_optim = _full(model, optim)
    if rank == 0:
        torch.save(full, out_dir / "full.pt")
        torch.save(full_optim, out_dir / "full_optim.pt")
        (out_dir / "layout_of.json").write_bytes(layout_of(model).to_json())
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
    (out_dir / "model").mkdir(exist_ok=True)
    (out_dir / "train").mkdir(exist_ok=True)
    torch.save(local, out_dir / "model" / f"rank{rank}.pt")
    torch.save({"model": local, "optim": optim.state_dict(), "step": 2}, out_dir / "train" / f"model_rank_{rank}.pt")
    torch.save(optim.state_dict(), out_dir / f"optim{rank}.pt")  # plain tensors: torch.load needs no process group
    _settle()


def load_and_gather(rank: int, world: int, jobs: list[tuple[str, str, bool, bool, str]],
                    param_dtype: str | None = None) -> None:
    """For each ``(directory, file pattern, use_orig_params, with_optim, out)``: load this rank's file into a
    fresh FSDP1 model (and optimizer) under LOCAL_STATE_DICT, then save to ``out`` what torch's
    FULL_STATE_DICT gathers (``{"model": ..., "optim": ...}``) and this rank's own ``optimizer.state_dict()``
    to ``out`` with ``.rank{r}`` appended. (Tensors cannot be returned: the queue shares their storage with a
    process that is gone by the time the parent reads it.)"""
    for directory, pattern, use_orig_params, with_optim, out in jobs:
        model, optim = wrap(use_orig_params, param_dtype)
        saved = torch.load(Path(directory) / pattern.format(rank=rank), weights_only=False)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig(),
                                  LocalOptimStateDictConfig()):
            # With use_orig_params=True, FSDP1 loads through the per-parameter views and reports its own
            # _flat_param keys as unexpected (its own files too, at their own world size): load non-strict
            # and check that nothing else is off.
            result = model.load_state_dict(saved["model"] if with_optim else saved, strict=not use_orig_params)
        if result.missing_keys or any(not k.endswith("_flat_param") for k in result.unexpected_keys):
            raise AssertionError(f"rank {rank}: loading {directory} left {result}")
        if with_optim:
            optim.load_state_dict(saved["optim"])
            torch.save(optim.state_dict(), f"{out}.rank{rank}")
        full, full_optim = _full(model, optim)
        if rank == 0:
            torch.save({"model": full, "optim": full_optim if with_optim else None}, out)
    _settle()


def _settle() -> None:
    # Three gloo ranks on two cores: a rank that tears its process group down while a peer is still busy
    # sometimes dies in gloo ("terminate called without an active exception"), with torch's own files too.
    # Leaving together avoids it.
    dist.barrier()

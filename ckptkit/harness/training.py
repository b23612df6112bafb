"""The tiny transformer built and wrapped as a :class:`TrainConfig` says, on one rank, and trained on a
global batch that does not depend on the world size.

Every rank seeds the same generator before building, so all ranks (and all runs) start from the same
weights; each step's global batch is cut into equal per-rank slices, so gradients averaged over the ranks
are the gradient of the same global mean loss at any world size.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffload,
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.nn.parallel import DistributedDataParallel

from .configs import WRAP_MIN_NUM_PARAMS, AutoWrap, ParamDtype, TrainConfig, Wrapper
from .model import Block, TinyConfig, TinyTransformer, batch, next_token_loss

__all__ = ["GLOBAL_BATCH", "LR", "MODEL", "SEED", "build", "perturb_resumed", "train"]

MODEL = TinyConfig()
SEED = 0
LR = 1e-2
GLOBAL_BATCH = 12
"""Sequences per step, split evenly over 1, 2, 3, 4 or 6 ranks."""


def build(config: TrainConfig, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """This rank's wrapped model and its AdamW, under the default process group of ``config.world_size``."""
    if dist.get_world_size() != config.world_size:
        raise RuntimeError(f"{config.name} needs {config.world_size} ranks, "
                           f"the process group has {dist.get_world_size()}")
    torch.manual_seed(SEED)
    model = TinyTransformer(MODEL)
    wrapped = _WRAP[config.wrapper](model, config, device)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=LR)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, *, start: int, steps: int,
          device: torch.device) -> list[float]:
    """Steps ``start .. start + steps - 1``; returns each step's global mean loss (the same on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise RuntimeError(f"the global batch of {GLOBAL_BATCH} sequences does not split evenly over {world} ranks")
    per = GLOBAL_BATCH // world
    losses = []
    for step in range(start, start + steps):
        tokens = batch(MODEL, step, GLOBAL_BATCH)[rank * per:(rank + 1) * per].to(device)
        loss = next_token_loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # equal slices: the mean of the ranks' means is the global mean
        losses.append(total.item() / world)
    return losses


def perturb_resumed(config: TrainConfig, optimizer: torch.optim.Optimizer) -> None:
    """Double the learning rate of a resumed run under a ``perturb_resume`` configuration (test only: see
    :attr:`TrainConfig.perturb_resume`); nothing otherwise. Call after the loaded state has been captured."""
    if config.perturb_resume:
        for group in optimizer.param_groups:
            group["lr"] *= 2


def _mesh(config: TrainConfig, device: torch.device):
    names = ("replicate", "shard") if len(config.mesh_shape) == 2 else ("shard",)
    return init_device_mesh(device.type, config.mesh_shape, mesh_dim_names=names)


def _plain(model: TinyTransformer, config: TrainConfig, device: torch.device) -> nn.Module:
    return model.to(device)


def _ddp(model: TinyTransformer, config: TrainConfig, device: torch.device) -> nn.Module:
    return DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)


def _fsdp1(model: TinyTransformer, config: TrainConfig, device: torch.device) -> nn.Module:
    sharding, auto_wrap, use_orig_params = config.fsdp1_options
    policy = {AutoWrap.NONE: None, AutoWrap.BLOCK: ModuleWrapPolicy({Block}),
              AutoWrap.SIZE: functools.partial(size_based_auto_wrap_policy, min_num_params=WRAP_MIN_NUM_PARAMS)}
    mixed = None
    if config.param_dtype not in (None, ParamDtype.FP32):
        mixed = MixedPrecision(param_dtype=getattr(torch, config.param_dtype.torch_name), reduce_dtype=torch.float32,
                               buffer_dtype=torch.float32)
    # device_id is needed on CPU too: without it FSDP1 looks for an accelerator and refuses to start.
    return FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy[sharding.value], auto_wrap_policy=policy[auto_wrap],
        use_orig_params=use_orig_params, device_id=device, mixed_precision=mixed,
        cpu_offload=CPUOffload(offload_params=bool(config.cpu_offload)),
        device_mesh=_mesh(config, device) if sharding.hybrid else None)


def _fsdp2(model: TinyTransformer, config: TrainConfig, device: torch.device) -> nn.Module:
    options = dict(
        mesh=_mesh(config, device), reshard_after_forward=config.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if config.bf16 else MixedPrecisionPolicy(),
        # Pinned memory exists only beside an accelerator.
        offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if config.cpu_offload else OffloadPolicy())
    if not config.cpu_offload:
        model.to(device)  # offloaded parameters must start on the CPU; fully_shard moves the rest to the mesh
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)  # in place: it returns model, its class swapped for an FSDP subclass
    if device.type == "cuda" and config.world_size > torch.cuda.device_count():
        from .staged import stage_collectives, staging_enabled  # imported only here: it needs FSDP2's comm API

        if staging_enabled():
            stage_collectives(model)  # ranks share GPUs over gloo: pending a GPU run, see staged.py
    return model


_WRAP = {Wrapper.PLAIN: _plain, Wrapper.DDP: _ddp, Wrapper.FSDP1: _fsdp1, Wrapper.FSDP2: _fsdp2}

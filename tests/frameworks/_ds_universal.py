"""Rank functions for resuming in DeepSpeed 0.19.8's own engine: an FSDP2 run (torch's ``fully_shard`` and AdamW,
saved with DCP), and DeepSpeed ZeRO runs that resume from a universal checkpoint, or save one of their own.

Both train the same tiny model on the same global batch per step, split evenly over the ranks, with gradients
clipped to a norm of 1.0 (DeepSpeed's default ``gradient_clipping``, which a universal checkpoint written from
another framework does not carry), so a resumed run is on the uninterrupted run's trajectory to rounding.

One CPU shim, inside the DeepSpeed ranks only: ``deepspeed.comm.torch.build_shm_op`` returns None, so the engine
does not compile its shared-memory all-reduce op with g++ (minutes here); it then all-reduces through gloo.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 13, 7, 11, 5
GLOBAL_BATCH = 6
"""Sequences per step, split evenly over 1, 2, 3 or 6 ranks."""
LR, CLIP = 1e-2, 1.0


class Net(nn.Module):
    """Odd sizes, so that FSDP2's and ZeRO's partitions cut parameters unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.fc2(torch.relu(self.norm(self.fc1(h))))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _tokens(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    per = GLOBAL_BATCH // world
    return batch[rank * per:(rank + 1) * per]


def _mean(loss: torch.Tensor) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


# ---------------------------------------------------------------------------------------------------- FSDP2


def _report(rank: int, result: str, value: dict[str, Any]) -> None:
    """Rank 0 saves ``value`` to ``result``: tensors returned through the spawn queue would be shared memory that
    the rank's exit takes away."""
    if rank == 0:
        torch.save(value, result)
    dist.barrier()


def fsdp2_run(rank: int, world: int, out: str, result: str, save_after: int, steps: int) -> None:
    """Steps 1..``steps`` of FSDP2 training of ``Net``, saving ``{"model", "optim"}`` with DCP after step
    ``save_after`` into ``out``. Saves the losses and the final full parameters into ``result``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = _net()
    fully_shard(model.fc1)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(1, steps + 1):
        loss = model(_tokens(step, rank, world))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss))
        if step == save_after:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    _report(rank, result, {"losses": losses, "params": {k: v.clone() for k, v in final.items()}})


# ------------------------------------------------------------------------------------------------ DeepSpeed


def _engine(stage: int, universal: bool):
    import importlib

    import deepspeed

    # The CPU shim. By name: `import deepspeed.comm.torch as m` gives torch itself, which deepspeed.comm imports.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // int(os.environ["WORLD_SIZE"]),
              "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "checkpoint": {"load_universal": universal}}
    model = _net()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _ds_steps(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last + 1):
        loss = engine(_tokens(step, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(_mean(loss))
    return losses


def _full_params(engine, stage: int) -> dict[str, torch.Tensor]:
    if stage < 3:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().clone() for n, p in params}


def ds_resume(rank: int, world: int, load_dir: str, result: str, stage: int, first: int, last: int) -> None:
    """A DeepSpeed ZeRO-``stage`` engine loads the universal checkpoint in ``load_dir`` (by its
    ``latest_universal``) and trains steps ``first``..``last``. Saves what it loaded, its losses and its final
    parameters into ``result``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine = _engine(stage, universal=True)
    path, _ = engine.load_checkpoint(load_dir)
    loaded = {"path": path, "global_steps": engine.global_steps,
              "lr": [g["lr"] for g in engine.optimizer.param_groups]}
    losses = _ds_steps(engine, rank, world, first, last)
    _report(rank, result, {"loaded": loaded, "losses": losses, "params": _full_params(engine, stage)})


def ds_save(rank: int, world: int, save_dir: str, stage: int, steps: int) -> None:
    """A DeepSpeed ZeRO-``stage`` engine trains ``steps`` steps and saves its own checkpoint into ``save_dir``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine = _engine(stage, universal=False)
    _ds_steps(engine, rank, world, 1, steps)
    engine.save_checkpoint(save_dir, tag=f"global_step{steps}")

"""A DeepSpeed 0.19.8 ZeRO run that saves its own checkpoint (which ``ds_to_universal`` then converts), on CPU
gloo ranks: a tiny model of odd sizes, one global batch per step split evenly over the ranks.

One CPU shim, inside the DeepSpeed ranks only: ``deepspeed.comm.torch.build_shm_op`` returns None, so the engine
does not compile its shared-memory all-reduce op with g++ (minutes here); it then all-reduces through gloo.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 13, 7, 11, 5
GLOBAL_BATCH = 6
"""Sequences per step, split evenly over 1, 2, 3 or 6 ranks."""
LR, CLIP = 1e-2, 1.0


class Net(nn.Module):
    """Odd sizes, so that ZeRO's partitions cut parameters unevenly."""

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


def _engine(stage: int):
    import importlib

    import deepspeed

    # The CPU shim. By name: `import deepspeed.comm.torch as m` gives torch itself, which deepspeed.comm imports.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // int(os.environ["WORLD_SIZE"]),
              "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
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


def ds_save(rank: int, world: int, save_dir: str, stage: int, steps: int) -> None:
    """A DeepSpeed ZeRO-``stage`` engine trains ``steps`` steps and saves its own checkpoint into ``save_dir``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine = _engine(stage)
    _ds_steps(engine, rank, world, 1, steps)
    engine.save_checkpoint(save_dir, tag=f"global_step{steps}")

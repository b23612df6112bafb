"""A short FSDP2 training loop that checkpoints with ckptkit.save and resumes with ckptkit.load.

Run it on CPU with 2 ranks, then resume on 3 ranks from the same checkpoints:

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --ckpt /tmp/run --steps 6
    torchrun --nproc-per-node 3 examples/train_fsdp2.py --ckpt /tmp/run --steps 9
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import ckptkit
from ckptkit.harness.model import TinyConfig, TinyTransformer, batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True, help="checkpoint root (step-N directories and 'latest')")
    parser.add_argument("--steps", type=int, default=6, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--form", default="sharded", choices=["sharded", "full", "hf"])
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyTransformer(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = 0
    if os.path.exists(os.path.join(args.ckpt, "latest")):
        start = ckptkit.load(args.ckpt, model, optimizer=opt).step  # any world size, any saved form
        if rank == 0:
            print(f"resumed from step {start} on {world} ranks")

    pending = None
    for step in range(start, args.steps):
        tokens = batch(cfg, step, size=2 * world)[rank::world]  # one global batch, split by rank
        loss = model.loss(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}")
        if (step + 1) % args.save_every == 0:
            if pending is not None:
                pending.wait()
            pending = ckptkit.save(args.ckpt, model, optimizer=opt, form=args.form, step=step + 1,
                                   keep_last=2, async_save=True)
    if pending is not None:
        pending.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

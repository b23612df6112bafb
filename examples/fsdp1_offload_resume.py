"""Resuming FSDP1 with CPUOffload(offload_params=True) and use_orig_params=True leaves the uninterrupted run.

Torch alone, one rank: train 2 steps, save model and optimizer with FSDP1's FULL_STATE_DICT API, train 3 more
(the uninterrupted run); build the same model fresh, load, train the same 3 steps. The state reads back bit
for bit after the load, yet the resumed losses differ from the uninterrupted ones.

Why (torch/distributed/fsdp): the load runs FSDP's lazy init, whose ``init_flat_param_attributes`` makes
``flat_param._local_shard`` a pinned *copy* of the flat parameter while ``flat_param.data`` stays on the
unpinned storage. With NO_SHARD (which FULL_SHARD becomes on one rank) and ``use_orig_params=True``,
``_should_unshard_params`` is False, so the load writes straight into that unpinned storage and nothing
copies it to ``_local_shard``. The first forward computes with the loaded weights; its reshard
(``_use_sharded_flat_param``: ``flat_param.data = flat_param._local_shard``) then swaps in the copy made at
lazy init, which holds the weights the model was built with. Backward and the optimizer go on from those.

    python examples/fsdp1_offload_resume.py            # on a GPU: the first resumed loss equal, then a drift
    python examples/fsdp1_offload_resume.py --settle   # summon_full_params before the load: max rel diff 0.0
    python examples/fsdp1_offload_resume.py --emulate-pinning   # on a CPU: pin_memory() as a plain copy

With ``--emulate-pinning`` (torch 2.13, CPU) it prints ``max rel diff 2.8e-02``, and 0.0 with ``--settle``.

``--settle`` enters and leaves ``FSDP.summon_full_params`` once before loading, which runs the lazy init
and a reshard, so the load writes into ``_local_shard`` itself. ``--emulate-pinning`` lets the script run
where torch refuses to pin ("Cannot access accelerator device"): ``pin_memory()`` becomes ``clone()``,
which keeps the one property the drift depends on, that the pinned shard is a second storage.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffload, FullStateDictConfig, FullyShardedDataParallel, StateDictType


def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
    model = FullyShardedDataParallel(net, cpu_offload=CPUOffload(offload_params=True), use_orig_params=True,
                                     device_id=device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, device: torch.device) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 16, generator=g).to(device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_state_dict(model: nn.Module):
    # offload_to_cpu=False: FSDP refuses it with NO_SHARD; rank0_only=False: one rank anyway.
    return FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                                    FullStateDictConfig(offload_to_cpu=False, rank0_only=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", action="store_true", help="summon_full_params once before loading")
    parser.add_argument("--emulate-pinning", action="store_true", help="pin_memory() as clone(), to run on a CPU")
    args = parser.parse_args()
    if args.emulate_pinning:
        torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()  # type: ignore[method-assign]
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]  # FSDP waits on its D2H copies
    cuda = torch.cuda.is_available() and not args.emulate_pinning
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")

    model, optimizer = build(device)
    train(model, optimizer, range(0, 2), device)
    with full_state_dict(model):
        torch.save({"model": model.state_dict(),
                    "optim": FullyShardedDataParallel.optim_state_dict(model, optimizer)}, path)
    uninterrupted = train(model, optimizer, range(2, 5), device)

    model, optimizer = build(device)
    if args.settle:
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            pass
    state = torch.load(path, weights_only=True)
    with full_state_dict(model):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, state["optim"]))
    resumed = train(model, optimizer, range(2, 5), device)

    rel = max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted, strict=True))
    print(f"torch {torch.__version__} on {device}{' (pinning emulated)' if args.emulate_pinning else ''}")
    print(f"uninterrupted {uninterrupted}\nresumed       {resumed}\nmax rel diff {rel:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

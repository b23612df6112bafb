"""The resume matrix's targets: each resumes every converted checkpoint given to it through its framework's own
load path, on 2 gloo ranks, and trains steps 4-6 with the recipe of :mod:`_matrix`.

- plain FSDP2 (transformers' Llama): the optimizer and a torch LR scheduler built first, then torch's
  ``dcp.load`` of ``get_state_dict``'s state dicts under the checkpoint's own section names (flattened where the
  checkpoint's param groups are), and ``set_state_dict``;
- torchtitan 0.3: its Trainer's pieces (:func:`_matrix.titan_parts`: model, ``OptimizersContainer``,
  ``LRSchedulersContainer``, ``train_state``) built first, then ``CheckpointManager.load`` of the checkpoint as
  its ``initial_load_path``, the dataloader excluded (its state is per rank);
- DeepSpeed 0.19.8: its engine (ZeRO-2, a client LR scheduler) and ``load_checkpoint`` of the universal
  checkpoint (``load_universal``), the scheduler's state not loaded (a universal checkpoint holds none);
- megatron-core 0.16.1: ``dist_checkpointing.load`` of the model and of its DistributedOptimizer's
  ``dp_reshardable`` state, then ``load_state_dict``.

Each writes, for every checkpoint, the step its framework's state holds after the load, the losses of steps
4-6 and the final weights under HF names; and a control: the first checkpoint's weights with a fresh optimizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import _matrix as mx
import _megatron_distopt as md
from _megatron_distopt import SAVED, STEPS

RESUMED = range(SAVED + 1, STEPS + 1)


def _hf_steps(model, opt, sched) -> list[float]:
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in RESUMED:
        ids = md.batch(step, rank, world)
        loss = mx.loss_of(model(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), mx.CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(mx.mean(loss))
    return losses


# ---------------------------------------------------------------------------------------------------- FSDP2


def _layout(path: Path) -> tuple[list[Path], bool, str, bool]:
    """How a checkpoint keeps the model and the optimizer, read from torch's own metadata: its DCP directories
    (accelerate's ``save_state`` has two), whether the model sits under ``model``, the optimizer's section, and
    whether its param groups are flattened per parameter."""
    import torch.distributed.checkpoint as dcp

    dirs = [path / "pytorch_model_fsdp_0", path / "optimizer_0"] if (path / "optimizer_0").is_dir() else [path]
    keys = {k for d in dirs for k in dcp.FileSystemReader(str(d)).read_metadata().state_dict_metadata}
    section = next(k for k in keys if k.endswith(".state.lm_head.weight.exp_avg")).split(".state.")[0]
    return dirs, "model.lm_head.weight" in keys, section, f"{section}.param_groups.lm_head.weight.lr" in keys


def _fsdp2_load(model, opt, path: Path, with_optimizer: bool = True) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    dirs, nested, section, flattened = _layout(path)
    options = StateDictOptions(flatten_optimizer_state_dict=flattened)
    msd, osd = get_state_dict(model, opt, options=options)
    model_part = {"model": msd} if nested else dict(msd)
    state = {**model_part, section: osd} if with_optimizer else model_part
    for d in dirs:
        keys = set(dcp.FileSystemReader(str(d)).read_metadata().state_dict_metadata)
        dcp.load({k: v for k, v in state.items() if any(x == k or x.startswith(k + ".") for x in keys)},
                 checkpoint_id=str(d))
    set_state_dict(model, opt if with_optimizer else [], model_state_dict=msd,
                   optim_state_dict=osd if with_optimizer else {}, options=options)


def fsdp2(rank: int, world: int, cells: list[tuple[str, str]], result: str) -> None:
    """Each ``(name, checkpoint)`` of ``cells`` resumed in plain FSDP2; rank 0 writes ``result``."""
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, path in [*cells, ("control", cells[0][1])]:
        print("CELL", name, flush=True)
        model = mx.hf_model(99)
        mx.sharded(model, model.model.layers)
        opt = mx.adamw(model)
        sched = mx.constant(opt)  # built before the load, as a training script builds it
        _fsdp2_load(model, opt, Path(path), with_optimizer=name != "control")
        step = max((float(s["step"]) for s in opt.state.values()), default=None)
        out[name] = {"step": step, "losses": _hf_steps(model, opt, sched), "model": mx.full_hf(model)}
    mx.report(rank, result, out)


# ----------------------------------------------------------------------------------------------- torchtitan


def torchtitan(rank: int, world: int, cells: list[tuple[str, str]], result: str) -> None:
    """Each ``(name, checkpoint)`` resumed by torchtitan's CheckpointManager; rank 0 writes ``result``."""
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, path in [*cells, ("control", cells[0][1])]:
        model = mx.titan_model(99)
        folder = str(Path(result).parent / f"titan-{name}")  # empty: the load takes initial_load_path
        optimizers, schedulers, state, checkpointer = mx.titan_parts(
            model, folder, path, exclude_from_loading=["dataloader"], initial_load_model_only=name == "control")
        checkpointer.load()
        checkpointer.close()
        loaded = {"step": state.step, "last_epoch": schedulers.schedulers[0].last_epoch}
        losses = mx.titan_steps(model, optimizers, schedulers, state, RESUMED)
        out[name] = {**loaded, "losses": losses, "model": mx.titan_to_hf(model)}
    mx.report(rank, result, out)


# ------------------------------------------------------------------------------------------------ DeepSpeed


def _fp32_weights(universal: Path) -> dict[str, torch.Tensor]:
    tag = universal / (universal / "latest_universal").read_text().strip() / "zero"
    return {p.name: torch.load(p / "fp32.pt", weights_only=True)["param"] for p in tag.iterdir() if p.is_dir()}


def _undo_zero3_load(engine, universal: Path) -> bool:
    """Undo what DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    does to any universal checkpoint, its own included: it gives the first saved group's hyperparameters to every
    group (put back each group's from ``optimizer_state.pt``, by position, as ZeRO-1 and ZeRO-2 load them), and
    one ``step`` tensor to every sub-group's state, which Adam then advances once per sub-group each step (each
    gets its own). Returns whether the step was shared."""
    tag = universal / (universal / "latest_universal").read_text().strip()
    saved = torch.load(tag / "zero" / "optimizer_state.pt", weights_only=True)["param_groups"]
    for group, fields in zip(engine.optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in fields.items() if k != "params"})
    states = list(engine.optimizer.optimizer.state.values())
    shared = len({id(s["step"]) for s in states}) < len(states)
    for state in states:
        state["step"] = state["step"].clone()
    return shared


def deepspeed(rank: int, world: int, cells: list[tuple[str, str]], result: str) -> None:
    """Each ``(name, universal checkpoint)`` resumed by DeepSpeed's engine (ZeRO-2, ``load_universal``), the first
    also under ZeRO-3 (``zero3 engine``, with :func:`_undo_zero3_load` after the load); the control's
    engine starts from the first one's fp32 weights with a fresh optimizer. Rank 0 writes ``result``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, path in [*cells, ("zero3 engine", cells[0][1]), ("control", cells[0][1])]:
        model = mx.hf_model(99)
        if name == "control":
            model.load_state_dict(_fp32_weights(Path(path)))
        stage = 3 if name == "zero3 engine" else 2
        engine = mx.ds_engine(stage, model, universal=name != "control")
        if name != "control":
            engine.load_checkpoint(path, load_lr_scheduler_states=False)
        decay = [g["weight_decay"] for g in engine.optimizer.param_groups]
        loaded = {"step": engine.global_steps, "weight_decay": decay}
        if stage == 3:
            loaded["shared_step"] = _undo_zero3_load(engine, Path(path))
        out[name] = {**loaded, "losses": mx.ds_steps(engine, RESUMED), "model": mx.ds_params(engine, stage)}
    mx.report(rank, result, out)


# ---------------------------------------------------------------------------------------------- megatron-core


def _megatron_load(model, opt, ckpt: str, with_optimizer: bool) -> int:
    """megatron-core's ``dist_checkpointing.load`` of ``ckpt`` into ``model`` (and ``opt``); the iteration its
    common state holds."""
    from megatron.core import dist_checkpointing

    inner = opt.chained_optimizers[0]
    inner._init_optimizer_states_with_dummy_values()  # the step its state_dict reads without TE or apex
    msd = model.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    state = dist_checkpointing.load({**msd, "optimizer": osd} if with_optimizer else msd, ckpt)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    if with_optimizer:
        with torch.no_grad():  # float32 main parameters are views of the model's, which require grad
            opt.load_state_dict(state["optimizer"])
        # megatron-core 0.16.1 with torch's AdamW (no TE, no apex) loads each parameter's step from the state its
        # dummy step made (1), one tensor shared by all, not the saved one; it does so for its own checkpoints
        # too. The saved step is in the param groups it loaded: put it back, one tensor each.
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                inner.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))
    return dist_checkpointing.load_common_state_dict(ckpt)["iteration"]


def megatron(rank: int, world: int, cells: list[tuple[str, str]], result: str) -> None:
    """Each ``(name, checkpoint)`` (one bucket, as ``convert --to megatron`` writes) resumed by megatron-core; rank 0
    writes ``result``, and every rank the optimizer's per-parameter state as loaded from the ``megatron`` cell
    (``loaded{rank}.pt`` beside ``result``)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel()
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # CUDA shim 1, as in _megatron_distopt
    out: dict[str, Any] = {}
    for name, path in [*cells, ("control", cells[0][1])]:
        model = md.meg.build("llama", 1, seed=3)  # weights unlike the saved ones: a tensor not loaded shows
        with md._CudaOnCpu():  # CUDA shim 2
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
            opt = md._optimizer(ddp)
            iteration = _megatron_load(model, opt, path, with_optimizer=name != "control")
            if name == "megatron":
                torch.save(md.optimizer_states(opt.chained_optimizers[0], model),
                           Path(result).parent / f"loaded{rank}.pt")
            result_file = str(Path(result).parent / f"megatron-{name}.pt")
            md._train(rank, world, model, ddp, opt, RESUMED, result_file)
        dist.barrier()
        if rank == 0:
            out[name] = {"step": iteration, **torch.load(result_file, weights_only=True)}
    mx.report(rank, result, out)
    md.meg._done()

"""The resume matrix's training runs: one recipe, saved by eight frameworks' own code (:mod:`_matrix_targets`
resumes them in five).

Every source trains the tiny Llama that transformers, torchtitan and megatron-core compute identically
(:mod:`_megatron_distopt`'s: 2 layers, hidden 32, 4 heads in 2 query groups, float32) on 2 gloo ranks for 6
steps of one global batch (4 sequences, 2 per rank), with megatron-core's recipe: Adam(W) at a constant rate
``LR``, betas ``BETAS``, eps ``EPS``, weight decay ``WD`` on the matrices and none on the 1-D parameters,
gradients clipped to ``CLIP``, an LR scheduler built before training (a constant one: where a schedule
stands is checked by value in the targets, not through the losses). Each saves with its own calls after step 3
and goes on: the uninterrupted run, whose losses and final weights (under HF names) are the oracle.

``sources`` runs the frameworks one after another in one process group: plain FSDP2 (``dcp.save`` of
``get_state_dict``), ``ckptkit.save``, torchtitan 0.3 (its own ``Llama3Model``, ``OptimizersContainer``,
``LRSchedulersContainer`` and ``CheckpointManager.save``), accelerate 1.15 ``save_state`` (FSDP2), Lightning
2.6 Fabric (FSDP1, sharded ``fabric.save``), DeepSpeed 0.19.8 ZeRO-2 and ZeRO-3 (``save_checkpoint``), and
megatron-core 0.16.1's DistributedOptimizer (:func:`_megatron_distopt.megatron_source`, whose recipe this is).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import _megatron_distopt as md
from _megatron_distopt import BETAS, CLIP, EPS, LR, SAVED, STEPS, WD

SOURCES = ("fsdp2", "ckptkit", "torchtitan", "accelerate", "fabric", "zero2", "zero3", "megatron")
"""The matrix's sources, by the names the tests use."""
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 32, 4, 2, 64, 2


def hf_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(md.hf_config())


def groups(named, dims: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """megatron-core's grouping of ``named`` parameters: matrices decayed, 1-D parameters and biases not (by their
    ``dims`` where a wrapper flattened them: FSDP1's)."""
    named = list(named)
    plain = [p for n, p in named if (dims[_unwrapped(n)] if dims else p.dim()) == 1 or n.endswith(".bias")]
    ids = {id(p) for p in plain}
    return [{"params": [p for _, p in named if id(p) not in ids], "weight_decay": WD},
            {"params": plain, "weight_decay": 0.0}]


def _unwrapped(name: str) -> str:
    return name.replace("_forward_module.", "").replace("_fsdp_wrapped_module.", "")


def adamw(model: torch.nn.Module, dims: dict[str, int] | None = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups(model.named_parameters(), dims), lr=LR, betas=BETAS, eps=EPS)


def constant(opt) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def loss_of(out, ids: torch.Tensor) -> torch.Tensor:
    return md._loss(out if isinstance(out, torch.Tensor) else out.logits, ids)


def mean(loss: torch.Tensor) -> float:
    return md._mean(loss, dist.get_world_size())


def sharded(model: torch.nn.Module, layers) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    return fully_shard(model)


def full_hf(model) -> dict[str, torch.Tensor]:
    """The full weights of an FSDP2 (or plain) HF model, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.clone() for k, v in state.items()}


def report(rank: int, path: str, value: Any) -> None:
    """Rank 0 saves ``value``: tensors handed back through the spawn queue would be shared memory the rank's exit
    takes away."""
    if rank == 0:
        torch.save(value, path)
    dist.barrier()


# ------------------------------------------------------------------------------------------------ torch


def _torch_loop(model, opt, sched, step_fn, save) -> list[float]:
    """Steps 1-6 of ``model``; ``save()`` after step 3. ``step_fn(loss)`` runs backward, clipping and the step."""
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(1, STEPS + 1):
        ids = md.batch(step, rank, world)
        loss = loss_of(model(ids), ids)
        step_fn(loss)
        sched.step()
        losses.append(mean(loss))
        if step == SAVED:
            save()
    return losses


def _plain_step(model, opt):
    def step(loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return step


def fsdp2_source(out: Path) -> dict[str, Any]:
    """Plain FSDP2: ``dcp.save({"model", "optim"})`` of ``get_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = hf_model(1)
    sharded(model, model.model.layers)
    opt = adamw(model)

    def save():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "fsdp2"))

    losses = _torch_loop(model, opt, constant(opt), _plain_step(model, opt), save)
    return {"losses": losses, "model": full_hf(model)}


def ckptkit_source(out: Path) -> dict[str, Any]:
    """``ckptkit.save`` of an FSDP2 model, its optimizer, scheduler and step."""
    import ckptkit

    model = hf_model(2)
    sharded(model, model.model.layers)
    opt = adamw(model)
    sched = constant(opt)
    losses = _torch_loop(model, opt, sched, _plain_step(model, opt),
                         lambda: ckptkit.save(out / "ckptkit", model, optimizer=opt, scheduler=sched, step=SAVED))
    return {"losses": losses, "model": full_hf(model)}


# ------------------------------------------------------------------------------------------- torchtitan


class TrainState:
    """What torchtitan's Trainer registers as ``train_state`` with its CheckpointManager (its own
    ``state_dict``/``load_state_dict``)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class CausalAttention(torch.nn.Module):
    """torchtitan's inner-attention call, computed by SDPA with a causal mask (no weights of its own)."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **_):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def titan_config():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    vocab = md.meg.VOCAB
    return Llama3Model.Config(
        dim=HIDDEN, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=HIDDEN, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=_NORM_INIT, eps=1e-6),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=vocab, param_init=_output_linear_init(HIDDEN)),
        layers=_build_llama3_layers(n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN,
                                    rope=ComplexRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=2 * md.meg.SEQ,
                                                            theta=10000.0),
                                    attn_backend="flex", fuse_qkv=False))


def titan_model(seed: int) -> torch.nn.Module:
    """torchtitan's Llama 3 of the matrix's shape, FSDP2-sharded as its ``apply_fsdp`` does. The layers' norms
    take eps 1e-6 (megatron-core's and the HF config's; torchtitan's layer builder fixes 1e-5), and a causal SDPA
    stands in for flex attention, which has no backward on CPU (:class:`CausalAttention`)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = titan_config().build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.eps = 1e-6
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalAttention()
    return sharded(model, model.layers.values())


def titan_parts(model: torch.nn.Module, folder: str, initial: str | None = None, **config):
    """torchtitan's Trainer's pieces for ``model``: ``OptimizersContainer`` (AdamW; norms without weight decay),
    ``LRSchedulersContainer`` (constant), ``train_state`` and the ``CheckpointManager`` over ``folder``, which
    loads ``initial`` where the folder holds no checkpoint (``initial_load_path``); built in the Trainer's
    order, the schedulers before any load."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    kwargs = {"lr": LR, "betas": BETAS, "eps": EPS}
    optimizers = OptimizersContainer(OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"norm\.", optimizer_name="AdamW", optimizer_kwargs={**kwargs, "weight_decay": 0.0}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={**kwargs, "weight_decay": WD})]),
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=0, min_lr_factor=1.0).build(optimizers=optimizers,
                                                                                      training_steps=STEPS)
    state = TrainState()
    checkpointer = CheckpointManager(
        CheckpointManager.Config(**{"enable": True, "folder": folder, "interval": SAVED, "keep_latest_k": 0,
                                    "initial_load_path": initial, "initial_load_model_only": False, **config}),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None)
    return optimizers, schedulers, state, checkpointer


def titan_to_hf(model) -> dict[str, torch.Tensor]:
    """The full weights of torchtitan's model under HF names, by torchtitan's own adapter."""
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return Llama3StateDictAdapter(titan_config(), None).to_hf(full_hf(model))


def titan_steps(model, optimizers, schedulers, state, steps: range, after=lambda: None) -> list[float]:
    """torchtitan's training steps (the Trainer's order: clip, optimizer, schedulers, the step count)."""
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        ids = md.batch(step, rank, world)
        loss = loss_of(model(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizers.step()
        optimizers.zero_grad()
        schedulers.step()
        state.step = step
        state.ntokens_seen += ids.numel() * world
        losses.append(mean(loss))
        after()
    return losses


def torchtitan_source(out: Path) -> dict[str, Any]:
    """torchtitan's Trainer's save: ``CheckpointManager.save`` every ``SAVED`` steps into ``step-3/``."""
    model = titan_model(3)
    optimizers, schedulers, state, checkpointer = titan_parts(model, str(out / "torchtitan"))
    losses = titan_steps(model, optimizers, schedulers, state, range(1, SAVED + 1))
    checkpointer.save(SAVED)
    losses += titan_steps(model, optimizers, schedulers, state, range(SAVED + 1, STEPS + 1))
    checkpointer.close()
    return {"losses": losses, "model": titan_to_hf(model)}


# ------------------------------------------------------------------------------------ accelerate, Lightning


def accelerate_source(out: Path) -> dict[str, Any]:
    """accelerate's ``save_state`` under its FSDP2 plugin (SHARDED_STATE_DICT)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from _workers import _force_accelerate_fsdp

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], cpu_ram_efficient_loading=False)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    _force_accelerate_fsdp(plugin)
    model = hf_model(4)
    model, opt = acc.prepare(model, adamw(model))

    def step(loss):
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()

    losses = _torch_loop(model, opt, constant(opt), step, lambda: acc.save_state(str(out / "accelerate")))
    return {"losses": losses, "model": full_hf(model)}


def fabric_source(out: Path) -> dict[str, Any]:
    """Lightning Fabric's sharded ``fabric.save`` (FSDPStrategy, FSDP1) of model, optimizer, scheduler, step."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from _workers import _fabric, _pin_no_offload

    _pin_no_offload()
    fabric = _fabric(dist.get_world_size(), "sharded")
    plain = hf_model(5)
    dims = {n: p.dim() for n, p in plain.named_parameters()}  # FSDP1 flattens them
    model = fabric.setup_module(FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     use_orig_params=True, device_id=torch.device("cpu")))
    opt = fabric.setup_optimizers(adamw(model, dims))
    sched = constant(opt)

    def step(loss):
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=CLIP)
        opt.step()
        opt.zero_grad()

    def save() -> None:
        fabric.save(out / "fabric", {"model": model, "optimizer": opt, "scheduler": sched, "step": SAVED})

    losses = _torch_loop(model, opt, sched, step, save)
    return {"losses": losses, "model": full_hf(model.module)}


# ------------------------------------------------------------------------------------------------ DeepSpeed


def ds_engine(stage: int, model: torch.nn.Module, universal: bool = False):
    """DeepSpeed's engine over ``model`` with the recipe: ZeRO-``stage``, torch's AdamW in megatron-core's two
    groups, clipping, a constant client LR scheduler. One CPU shim: ``build_shm_op`` returns None, so the engine
    does not compile its shared-memory all-reduce (minutes) and all-reduces through gloo."""
    import importlib

    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    config = {"train_micro_batch_size_per_gpu": md.GLOBAL // dist.get_world_size(), "gradient_accumulation_steps": 1,
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": WD, "torch_adam": True}},
              "checkpoint": {"load_universal": universal}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups(model.named_parameters()), config=config,
                                      lr_scheduler=lambda opt: constant(opt))
    return engine


def ds_params(engine, stage: int) -> dict[str, torch.Tensor]:
    """The engine's full parameters (gathered under ZeRO-3)."""
    import contextlib

    import deepspeed

    params = list(engine.module.named_parameters())
    gather = deepspeed.zero.GatheredParameters([p for _, p in params]) if stage == 3 else contextlib.nullcontext()
    with gather:
        return {n: p.detach().clone() for n, p in params}


def ds_steps(engine, steps: range, after=lambda step: None) -> list[float]:
    losses = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        ids = md.batch(step, rank, world)
        loss = loss_of(engine(ids), ids)
        engine.backward(loss)
        engine.step()
        losses.append(mean(loss))
        after(step)
    return losses


def deepspeed_source(out: Path, stage: int) -> dict[str, Any]:
    """DeepSpeed's own ``save_checkpoint`` under ZeRO-``stage``."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine = ds_engine(stage, hf_model(6))

    def save(step: int) -> None:
        if step == SAVED:
            engine.save_checkpoint(str(out / f"zero{stage}"), tag=f"global_step{step}")

    losses = ds_steps(engine, range(1, STEPS + 1), save)
    return {"losses": losses, "model": ds_params(engine, stage)}


# ------------------------------------------------------------------------------------------------ the run


def sources(rank: int, world: int, out: str) -> None:
    """Each torch-based source's run in turn on one process group; rank 0 writes ``<out>/expected.pt``: each
    source's losses and final HF-named weights."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    path = Path(out)
    expected = {}
    for name, run in (("fsdp2", fsdp2_source), ("ckptkit", ckptkit_source), ("torchtitan", torchtitan_source),
                      ("accelerate", accelerate_source), ("fabric", fabric_source),
                      ("zero2", lambda p: deepspeed_source(p, 2)), ("zero3", lambda p: deepspeed_source(p, 3))):
        expected[name] = run(path)
        dist.barrier()
    (path / "megatron").mkdir(exist_ok=True)
    md.megatron_source(str(path / "megatron"))  # last: its CUDA shims stay in place
    if rank == 0:
        expected["megatron"] = torch.load(path / "megatron" / "expected.pt", weights_only=True)
    report(rank, str(path / "expected.pt"), expected)

"""A megatron-core run with its ``DistributedOptimizer`` on 2 gloo CPU ranks (data parallel), saved as
Megatron-LM saves it with ``distrib_optim_sharding_type="dp_reshardable"``: the resume matrix's megatron-core
source, whose recipe every source of the matrix follows (:mod:`_matrix`).

The model is :mod:`_megatron`'s tiny Llama (float32 parameters, local spec, TP=1), trained 6 steps of one
global batch (4 sequences, 2 per rank) with Megatron's Adam (torch's ``AdamW`` underneath), clipping at
:data:`CLIP`, and its ``OptimizerParamScheduler`` holding the learning rate and weight decay constant (which
sets each group's ``weight_decay`` to ``WD * wd_mult``: 1-D parameters take none). It saves after step 3.

megatron-core's DistributedOptimizer runs on CPU given two shims, inside these ranks only:
- ``torch.cuda.current_device`` returns ``"cpu"``: the grad buffers are allocated on it;
- :class:`_CudaOnCpu`, a torch function mode: the optimizer makes its scalars with ``device="cuda"`` (sent
  to the CPU here) and checks each parameter's ``Tensor.type()`` against ``torch.cuda.*Tensor`` names (which
  a CPU tensor's name is reported as).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import _megatron as meg

LR, WD, BETAS, EPS, CLIP = 1e-2, 0.1, (0.9, 0.95), 1e-8, 0.3
GLOBAL, SAVED, STEPS = 4, 3, 6
BUCKET = 6000
"""Elements per bucket: the 22,688 parameters fill several, so that the split crosses bucket boundaries."""


class _CudaOnCpu(TorchFunctionMode):
    """``device="cuda"`` made on the CPU, ``.cuda()`` a no-op, and ``Tensor.type()`` named as a CUDA tensor's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=meg.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=meg.SEQ * 2,
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    ids = torch.randint(0, meg.VOCAB, (GLOBAL, meg.SEQ), generator=torch.Generator().manual_seed(1000 + step))
    return ids[rank * GLOBAL // world:(rank + 1) * GLOBAL // world]


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, meg.VOCAB), ids[:, 1:].reshape(-1))


def _mean(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def to_hf(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A Megatron Llama parameter (or a state of its shape) under HF's names: ``linear_qkv`` split per query
    group into q, k and v rows, ``linear_fc1`` into gate and up."""
    layer = name.split(".")[2] if name.startswith("decoder.layers.") else None
    simple = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
              "decoder.final_layernorm.weight": "model.norm.weight"}
    if name in simple:
        return {simple[name]: value}
    rest = name.split(".", 3)[3]
    prefix = f"model.layers.{layer}."
    if rest == "self_attention.linear_qkv.weight":
        grouped = value.reshape(2, 4, 8, -1)  # [groups, 2 q heads + k + v, head_dim, hidden]
        return {prefix + "self_attn.q_proj.weight": grouped[:, :2].reshape(32, -1),
                prefix + "self_attn.k_proj.weight": grouped[:, 2].reshape(16, -1),
                prefix + "self_attn.v_proj.weight": grouped[:, 3].reshape(16, -1)}
    if rest == "mlp.linear_fc1.weight":
        gate, up = value.chunk(2)
        return {prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up}
    names = {"input_layernorm.weight": "input_layernorm.weight", "pre_mlp_layernorm.weight":
             "post_attention_layernorm.weight", "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
             "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
    return {prefix + names[rest]: value}


def optimizer_states(opt, model) -> dict[str, list[tuple]]:
    """This rank's part of megatron-core's own per-parameter state: for each parameter (by name) it owns elements
    of, its shape, the range of its flattened elements the rank owns, and the optimizer's states of them
    (``param``: the fp32 main parameter; ``exp_avg``, ``exp_avg_sq``)."""
    out = {}
    for name, param in model.named_parameters():
        if param not in opt.model_param_gbuf_map:
            continue
        owned = opt._get_model_param_range_map(param)["param"]
        states = opt._get_main_param_and_optimizer_states(param)
        out[name] = (tuple(param.shape), owned.start, owned.end,
                     {k: states[k].detach().clone() for k in ("param", "exp_avg", "exp_avg_sq")})
    return out


def megatron_source(out: str) -> None:
    """6 steps on the default process group, saving after step 3 (``<out>/step-3`` fully parallel,
    ``<out>/step-3-plain`` not); rank 0 writes ``<out>/expected.pt``: the losses, the final weights (HF names)
    and logits of :func:`_megatron.tokens`; every rank ``<out>/states{rank}.pt``: its part of the optimizer's
    per-parameter state at the save."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel()
    model = meg.build("llama", 1)
    g = torch.Generator().manual_seed(5)  # the same weights on both data-parallel ranks
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # CUDA shim 1: the grad buffers' device
    with _CudaOnCpu():  # CUDA shim 2: the optimizer's device="cuda" scalars and its Tensor.type() check
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET),
            model)
        opt = _optimizer(ddp)

        def saved(step: int) -> None:
            if step == SAVED:
                _save(model, opt, f"{out}/step-{SAVED}", fully_parallel=True)
                _save(model, opt, f"{out}/step-{SAVED}-plain", fully_parallel=False)
                torch.save(optimizer_states(opt.chained_optimizers[0], model), f"{out}/states{rank}.pt")

        _train(rank, world, model, ddp, opt, range(1, STEPS + 1), f"{out}/expected.pt", saved)
    meg._done()


def _optimizer(ddp):
    """megatron-core's DistributedOptimizer (Adam) over ``ddp``, with the settings the resumes match, and its
    constant learning-rate and weight-decay schedule."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
        clip_grad=CLIP, use_distributed_optimizer=True), [ddp])
    OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=100,
                            lr_decay_style="constant", start_wd=WD, end_wd=WD, wd_incr_steps=100,
                            wd_incr_style="constant")
    return opt


def _train(rank: int, world: int, model, ddp, opt, steps: range, result: str, after=lambda step: None) -> None:
    """Megatron's training steps ``steps`` on this rank's batches (``after(step)`` once each is done); rank 0
    saves the losses, the weights under HF names and the logits to ``result``."""
    mask = torch.ones(meg.SEQ, meg.SEQ, dtype=torch.bool).triu(1)[None, None]
    losses = []
    with meg._cpu_forward():
        for step in steps:
            ids = batch(step, rank, world)
            ddp.zero_grad_buffer()
            opt.zero_grad()
            loss = _loss(ddp(ids, torch.arange(meg.SEQ)[None].expand_as(ids), mask), ids)
            loss.backward()
            ddp.finish_grad_sync()
            assert opt.step()[0]
            losses.append(_mean(loss, world))
            after(step)
        logits = meg._forward(model, 1)
    if rank == 0:
        weights = {k: v for n, p in model.named_parameters() for k, v in to_hf(n, p.detach().clone()).items()}
        torch.save({"losses": losses, "model": weights, "logits": logits}, result)


def _save(model, opt, path: str, fully_parallel: bool) -> None:
    """As Megatron-LM saves: the model's and the optimizer's sharded state dicts, and ``iteration``;
    ``fully_parallel``: each data-parallel rank writes a share of the tensors (Megatron-LM's default,
    ``--ckpt-fully-parallel-save``), which lists them in the checkpoint rank by rank, not in the model's order."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    os.makedirs(path, exist_ok=True)
    msd = model.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    with meg._cpu_save():
        strategy = get_default_save_sharded_strategy("torch_dist")
        if fully_parallel:
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            strategy = FullyParallelSaveStrategyWrapper(strategy, group)
        dist_checkpointing.save({**msd, "optimizer": osd, "iteration": SAVED}, path, sharded_strategy=strategy)
    meg._stop_writer_manager()


def per_parameter_states(out: Path, prefix: str = "states") -> dict[str, dict[str, torch.Tensor]]:
    """megatron-core's per-parameter state that :func:`optimizer_states` wrote for every rank
    (``<out>/<prefix><rank>.pt``), each rank's range put in place, under HF names."""
    whole: dict[str, dict[str, torch.Tensor]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in range(2):
        for name, (shape, start, end, states) in torch.load(out / f"{prefix}{rank}.pt", weights_only=True).items():
            shapes[name] = shape
            for slot, value in states.items():
                numel = int(torch.tensor(shape).prod())
                whole.setdefault(name, {}).setdefault(slot, torch.full((numel,), float("nan")))[start:end] = value
    hf: dict[str, dict[str, torch.Tensor]] = {}
    for name, slots in whole.items():
        for slot, flat in slots.items():
            for key, value in to_hf(name, flat.reshape(shapes[name])).items():
                hf.setdefault(key, {})[slot] = value
    return hf

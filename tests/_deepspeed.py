"""DeepSpeed 0.19.8's ZeRO checkpoint files, laid out from its source without DeepSpeed (which needs a g++ build
and a ``--no-deps`` install beside torch 2.13, so it cannot run here).

What is reproduced (DeepSpeed 0.19.8, ``deepspeed/runtime/``):
- file names and who writes them, ``engine.py:4319-4360`` (``_get_ckpt_name``, ``_get_rank_zero_ckpt_name``) and
  ``latest`` (``engine.py:4960-4962``);
- the model states, ``engine.py:5377-5528`` (``_save_checkpoint``, ``_get_zero_param_shapes``,
  ``_get_shared_params``, ``_save_zero_checkpoint``): ``module`` (stage 1/2: the bit16 parameters as views of
  the flat group buffer; stage 3: 0-element placeholders), ``buffer_names``, ``param_shapes`` (flat-buffer
  order, one dict per group), ``frozen_param_shapes``/``frozen_param_fragments`` (stage >= 2), ``shared_params``
  (rank 0; ``{}`` on other ZeRO-3 ranks);
- stage 1/2 optimizer state, ``zero/stage_1_and_2.py:425-592`` (flat groups with ``param_alignment_paddings``,
  padded to ``2 * ws``, cut into equal partitions) and ``3358-3403`` (``state_dict``: lean fp32 partitions,
  ``base_optimizer_state`` keeping the padded moments, ``param_slice_mappings``);
- stage 3 optimizer state, ``zero/stage3.py:957-1233`` and ``3431-3447`` (each parameter partitioned on its own,
  ``ceil(n / ws)`` per rank, padding on the last; ``fp32_flat_groups`` per sub-group carrying a ``ds_id``);
- the pickled DeepSpeed classes (``ZeroStageEnum``, ``LossScaler``, ``fragment_address``) as stand-ins registered
  under DeepSpeed's module names for the test only, so the pickles name the same globals.

The ground truth is what the layout starts from: per-parameter fp32 masters and Adam moments, bf16 module
weights, buffers; ``zero_to_fp32`` must give back the masters (frozen parameters in their module dtype).
"""

from __future__ import annotations

import enum
import math
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

VERSION = "0.19.8"


# --------------------------------------------------------------------------------------------------------
# DeepSpeed's pickled classes, under DeepSpeed's module names


class ZeroStageEnum(int, enum.Enum):  # runtime/zero/config.py:81-87
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScaler:  # runtime/fp16/loss_scaler.py
    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = scale
        self.dynamic = False


@dataclass
class fragment_address:  # noqa: N801  (utils/tensor_fragment.py:12, DeepSpeed's own name)
    numel: int
    start: int


_STANDINS = {"deepspeed.runtime.zero.config": [ZeroStageEnum], "deepspeed.runtime.fp16.loss_scaler": [LossScaler],
             "deepspeed.utils.tensor_fragment": [fragment_address]}


def register_standins(monkeypatch) -> None:
    """Put the stand-ins where pickle looks for DeepSpeed's classes (``sys.modules``), for this test only."""
    for module, classes in _STANDINS.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules:
                monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        for cls in classes:
            monkeypatch.setattr(cls, "__module__", module)
            monkeypatch.setattr(sys.modules[module], cls.__name__, cls, raising=False)


# --------------------------------------------------------------------------------------------------------
# The model and its state


class Net(nn.Module):
    """Odd sizes, so that partitions straddle parameters and need padding; a tied head, a frozen layer, a
    parameter of the root module, two persistent buffers and a non-persistent one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 7)
        self.fc1 = nn.Linear(7, 11)
        self.norm = nn.LayerNorm(11)
        self.frozen = nn.Linear(11, 6)
        self.fc2 = nn.Linear(17, 7)
        self.gate = nn.Parameter(torch.ones(3))
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 11))
        self.register_buffer("steps", torch.tensor([3, 1, 4], dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


@dataclass(frozen=True)
class Config:
    stage: int
    world_size: int
    bf16: bool = True
    align: bool = False
    """``zero_optimization.parameter_alignment`` (stage 1/2)."""


@dataclass
class Truth:
    """What a checkpoint was made from, keyed by the engine's parameter names."""

    fp32: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list[list[str]] = field(default_factory=list)

    def zero_to_fp32(self, stage: int) -> dict[str, torch.Tensor]:
        """What ``get_fp32_state_dict_from_zero_checkpoint`` returns (zero_to_fp32.py:394-418, 563-611), in its
        order, but with floating buffers in their saved dtype and stage 1's frozen parameters included, as
        ckptkit gives them."""
        out = dict(self.buffers) | dict(self.frozen) | {n: self.fp32[n] for g in self.groups for n in g}
        return out | {"head.weight": out["embed.weight"]}


def _random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * 3


def make_truth(config: Config, seed: int = 0) -> tuple[Net, Truth]:
    gen = torch.Generator().manual_seed(seed)
    net = Net()
    names = {id(p): n for n, p in net.named_parameters()}  # tied head: named by its first name, as DeepSpeed does
    decay = [names[id(p)] for p in (net.embed.weight, net.fc1.weight, net.fc2.weight)]
    no_decay = ["gate", "fc1.bias", "norm.weight", "norm.bias", "fc2.bias"]
    truth = Truth(groups=[decay, no_decay])
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    params = dict(net.named_parameters())
    for name in decay + no_decay:
        truth.fp32[name] = _random(tuple(params[name].shape), gen)
        truth.exp_avg[name] = _random(tuple(params[name].shape), gen)
        truth.exp_avg_sq[name] = _random(tuple(params[name].shape), gen).abs()
    for name in ("frozen.weight", "frozen.bias"):
        truth.frozen[name] = _random(tuple(params[name].shape), gen).to(dtype)
    truth.buffers = {"scale": net.scale.clone(), "steps": net.steps.clone()}
    return net, truth


# --------------------------------------------------------------------------------------------------------
# The files


def _module_state(net: Net, truth: Truth, params: dict[str, torch.Tensor]) -> OrderedDict:
    """``model.state_dict()`` key order (a module's own parameters, then its buffers, then its children)."""
    values = {**truth.buffers, **truth.frozen, **params, "head.weight": params["embed.weight"]}
    return OrderedDict((k, values[k]) for k in net.state_dict())


def _param_groups(truth: Truth) -> list[dict]:
    hyper = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
             "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    return [{"weight_decay": wd, **hyper, "params": [g]} for g, wd in enumerate((0.01, 0.0))]


def _ds_config(config: Config) -> dict:
    zero: dict = {"stage": config.stage}
    if config.align:
        zero["parameter_alignment"] = True
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": zero, "bf16": {"enabled": config.bf16}}


def _model_states(net: Net, truth: Truth, config: Config, module: OrderedDict, frozen_fragments, shared) -> dict:
    shapes = [OrderedDict((n, truth.fp32[n].shape) for n in g) for g in truth.groups]
    frozen_shapes = OrderedDict((n, t.shape) for n, t in truth.frozen.items()) if config.stage >= 2 else None
    return {
        "module": module, "buffer_names": list(truth.buffers), "optimizer": None, "param_shapes": shapes,
        "frozen_param_shapes": frozen_shapes, "shared_params": shared, "frozen_param_fragments": frozen_fragments,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": 3,
        "global_samples": 6 * config.world_size, "dp_world_size": config.world_size, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_config": _ds_config(config),
        "ds_version": VERSION,
    }


def _optim_name(config: Config, rank: int) -> str:
    return f"{'bf16_' if config.bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def write_checkpoint(root: Path, config: Config, tag: str = "global_step3", seed: int = 0) -> Truth:
    """Write ``root/latest`` and ``root/<tag>/`` as DeepSpeed's engine saves them; return the truth."""
    net, truth = make_truth(config, seed)
    out = root / tag
    out.mkdir(parents=True)
    (root / "latest").write_text(tag)  # no trailing newline, as engine.py writes it
    if config.stage <= 2:
        _write_stage12(out, net, truth, config)
    else:
        _write_stage3(out, net, truth, config)
    return truth


def _write_stage12(out: Path, net: Net, truth: Truth, config: Config) -> None:
    ws, dtype = config.world_size, torch.bfloat16 if config.bf16 else torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    align = 16 // math.gcd(16, itemsize) if config.align else 1
    bit16_params: dict[str, torch.Tensor] = {}
    parts: dict[str, list[list[torch.Tensor]]] = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
    lean, pads_all, mappings = [], [], [[] for _ in range(ws)]
    for names in truth.groups:
        starts, pads, at = {}, [], 0
        for i, name in enumerate(names):
            starts[name] = at
            at += truth.fp32[name].numel()
            pads.append((-at) % align if i < len(names) - 1 else 0)
            at += pads[-1]
        used = at
        padded = -(-used // (2 * ws)) * (2 * ws)  # align_dense_tensors to nccl_start_alignment_factor * ws
        size = padded // ws
        flat16 = torch.zeros(padded, dtype=dtype)
        for name in names:
            view = flat16[starts[name]:starts[name] + truth.fp32[name].numel()]
            view.copy_(truth.fp32[name].flatten())
            bit16_params[name] = view.view(truth.fp32[name].shape)
        for kind, values in (("fp32", truth.fp32), ("exp_avg", truth.exp_avg), ("exp_avg_sq", truth.exp_avg_sq)):
            flat = torch.zeros(padded)
            for name in names:
                flat[starts[name]:starts[name] + values[name].numel()] = values[name].flatten()
            parts[kind].append([flat[r * size:(r + 1) * size].clone() for r in range(ws)])
        lengths = [max(0, min(size, used - r * size)) for r in range(ws)]
        lean.append(lengths)
        pads_all.append(pads)
        for r in range(ws):
            lo, hi = r * size, r * size + lengths[r]
            mapping = OrderedDict()
            for name in names:
                a, b = max(lo, starts[name]), min(hi, starts[name] + truth.fp32[name].numel())
                if a < b:
                    mapping[name] = fragment_address(numel=b - a, start=a - lo)
            mappings[r].append(mapping)
    module = _module_state(net, truth, bit16_params)
    frozen_fragments = OrderedDict((n, module[n]) for n in truth.frozen) if config.stage >= 2 else None
    torch.save(_model_states(net, truth, config, module, frozen_fragments, {"head.weight": "embed.weight"}),
               out / "mp_rank_00_model_states.pt")
    for r in range(ws):
        state = {g: {"step": torch.tensor(3.0), "exp_avg": parts["exp_avg"][g][r],
                     "exp_avg_sq": parts["exp_avg_sq"][g][r]} for g in range(len(truth.groups))}
        osd = {
            "loss_scaler": LossScaler(), "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
            "base_optimizer_state": {"state": state, "param_groups": _param_groups(truth)},
            # The saved partition is the padded one cut short (a view): its storage keeps the tail padding.
            "single_partition_of_fp32_groups": [parts["fp32"][g][r][:lean[g][r]] for g in range(len(truth.groups))],
            "zero_stage": ZeroStageEnum(config.stage), "group_paddings": [len(p[r]) - n[r] for p, n in
                                                                          zip(parts["fp32"], lean, strict=True)],
            "param_alignment_paddings": pads_all, "partition_count": [ws] * len(truth.groups), "ds_version": VERSION,
            "param_slice_mappings": mappings[r],
        }
        torch.save({"optimizer_state_dict": osd, "ds_config": _ds_config(config), "ds_version": VERSION},
                   out / _optim_name(config, r))


def _write_stage3(out: Path, net: Net, truth: Truth, config: Config) -> None:
    ws, dtype = config.world_size, torch.bfloat16 if config.bf16 else torch.float32

    def partition(t: torch.Tensor, r: int) -> torch.Tensor:
        pn = -(-t.numel() // ws)
        padded = torch.cat([t.flatten(), torch.zeros(pn * ws - t.numel(), dtype=t.dtype)])
        return padded[r * pn:(r + 1) * pn]

    placeholders = {n: torch.empty(0, dtype=dtype) for n in truth.fp32}
    for r in range(ws):
        module = _module_state(net, truth, placeholders)
        for n in truth.frozen:
            module[n] = torch.empty(0, dtype=dtype)
        frozen_fragments = OrderedDict((n, partition(t, r).clone()) for n, t in truth.frozen.items())
        shared = {"head.weight": "embed.weight"} if r == 0 else {}
        torch.save(_model_states(net, truth, config, module, frozen_fragments, shared),
                   out / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        flat = {kind: [torch.cat([partition(values[n], r) for n in g]) for g in truth.groups]
                for kind, values in (("fp32", truth.fp32), ("exp_avg", truth.exp_avg),
                                     ("exp_avg_sq", truth.exp_avg_sq))}
        for g, t in enumerate(flat["fp32"]):
            t.ds_id = f"{g}_{r}"  # a Python attribute: torch.save pickles it through _rebuild_from_type_v2
        state = {g: {"step": torch.tensor(3.0), "exp_avg": flat["exp_avg"][g], "exp_avg_sq": flat["exp_avg_sq"][g]}
                 for g in range(len(truth.groups))}
        osd = {"zero_stage": ZeroStageEnum(3), "loss_scaler": LossScaler(), "dynamic_loss_scale": False,
               "overflow": False, "partition_count": ws,
               "optimizer_state_dict": {"state": state, "param_groups": _param_groups(truth)},
               "fp32_flat_groups": flat["fp32"]}
        torch.save({"optimizer_state_dict": osd, "ds_config": _ds_config(config), "ds_version": VERSION},
                   out / _optim_name(config, r))


def replace_in(path: Path, edit) -> None:
    """Load a file written above with torch (the stand-ins registered), ``edit`` its dict, save it back."""
    state = torch.load(path, weights_only=False)
    edit(state)
    torch.save(state, path)



def torch_zero_to_fp32(tag: Path) -> dict[str, torch.Tensor]:
    """zero_to_fp32's merge done over again with torch (``torch.load`` of every file, ``torch.cat``), written
    from DeepSpeed's description, not its code: the oracle for what a checkpoint's bytes say."""
    models = [torch.load(f, weights_only=False) for f in sorted(tag.glob("*_model_states.pt"))]
    optims = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in sorted(tag.glob("*_optim_states.pt"))]
    m0, stage, ws = models[0], int(optims[0]["zero_stage"]), len(optims)
    out = {k: v for k, v in m0["module"].items() if k in m0["buffer_names"]}
    shapes = [(n, s) for g in m0["param_shapes"] for n, s in g.items()]
    if stage <= 2:
        taken = {*out, *dict(shapes), *m0["shared_params"]}
        out |= m0["frozen_param_fragments"] or {k: v for k, v in m0["module"].items() if k not in taken}
        pads = optims[0]["param_alignment_paddings"]
        for g, group in enumerate(m0["param_shapes"]):
            flat, at = torch.cat([o["single_partition_of_fp32_groups"][g] for o in optims]), 0
            for (name, shape), pad in zip(group.items(), pads[g], strict=True):
                out[name] = flat[at:at + shape.numel()].view(shape)
                at += shape.numel() + pad
    else:
        for name, shape in m0["frozen_param_shapes"].items():
            out[name] = torch.cat([m["frozen_param_fragments"][name] for m in models])[:shape.numel()].view(shape)
        flats = [torch.cat(o["fp32_flat_groups"]) for o in optims]
        at = 0
        for name, shape in shapes:
            pn = -(-shape.numel() // ws)
            out[name] = torch.cat([f[at:at + pn] for f in flats])[:shape.numel()].view(shape)
            at += pn
    for alias, owner in m0["shared_params"].items():
        out[alias] = out[owner]
    return out

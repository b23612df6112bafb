"""A rank's model + optimizer state: saved in a :class:`Format`, loaded back from one, and captured whole.

Call order on a source: ``full_state`` first (FSDP1 cannot take a full state dict after a sharded one in
the same process), then ``save``, then (outside the ranks, for LOCAL) ``write_flat_layout``. On a target:
``load``, then ``full_state``. ``full_state``, ``save`` and ``load`` are collective: all ranks of the
process group call them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    ValueType,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

from ..formats.local.derive import derive_layout
from ..formats.local.layout import FLAT_PARAM, LAYOUT_FILE
from ..training.fsdp1_offload import settle_offloaded_fsdp1
from .configs import WRAP_MIN_NUM_PARAMS, AutoWrap, Format, TrainConfig
from .model import Block, TinyTransformer

__all__ = ["CHECKPOINT_NAMES", "TIED_KEYS", "checkpoint_path", "full_state", "load", "save", "write_flat_layout"]

CHECKPOINT_NAMES = {Format.FULL: "full.pt", Format.SHARDED: "sharded", Format.LOCAL: "local", Format.HF: "hf"}
"""What a checkpoint of each form is called inside a run's directory (FULL is one file, the others directories)."""
TIED_KEYS = frozenset({"lm_head.weight"})
"""Model keys an HF export may leave out because the config ties them to the input embedding."""


def checkpoint_path(directory: Path | str, form: Format) -> Path:
    return Path(directory) / CHECKPOINT_NAMES[form]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int | None) -> dict[str, Any]:
    """``{"model", "optim", "step"}`` with every tensor whole and copied to the CPU (complete on rank 0).

    ``optimizer=None`` captures the model alone: asking torch for the state of an optimizer that has not
    stepped makes it take a zero step first, which would start AdamW's step count early.
    """
    # No cpu_offload, on any device: on CPU, FSDP1's offload_to_cpu frees the unsharded storage it is about to
    # read (torch 2.13: "storage of size 0"); on CUDA it refuses NO_SHARD ("offload_to_cpu=True and NO_SHARD is
    # not supported yet", fsdp/_unshard_param_utils.py). The tiny model's full state fits any GPU; the copies
    # below bring it to the CPU.
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        msd, osd = get_model_state_dict(model, options=options), None
    else:
        msd, osd = get_state_dict(model, optimizer, options=options)
    # Copies: a plain or DDP model's state dict aliases the parameters, which go on training.
    state = {"model": msd, "optim": osd, "step": step}
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to("cpu", copy=True), state)


def save(form: Format, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, path: Path) -> None:
    """Write this rank's part of a ``form`` checkpoint at ``path`` (a file for FULL, else a directory)."""
    if form is Format.FULL:
        state = full_state(model, optimizer, step)
        if dist.get_rank() == 0:
            torch.save(state, path)
    elif form is Format.SHARDED:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd, "step": step}, checkpoint_id=str(path))
    elif form is Format.LOCAL:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            msd = model.state_dict()
        path.mkdir(parents=True, exist_ok=True)
        # FSDP1's optimizer holds flat-parameter shards; its own state_dict is the flattened optimizer state.
        torch.save({"model": msd, "optim": optimizer.state_dict(), "step": step}, path / f"rank{dist.get_rank()}.pt")
    else:
        raise ValueError(f"cannot save form {form.value}: the harness saves full, sharded or local checkpoints")
    dist.barrier()  # the checkpoint is complete once every rank has written its part


def load(form: Format, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> int | None:
    """Load a ``form`` checkpoint at ``path`` into this rank's model and optimizer; the saved step (None for
    HF, which holds the model alone and leaves the optimizer fresh).

    Into FSDP1 with parameter offloading, the flat parameters are settled on their pinned shards first
    (:func:`ckptkit.training.fsdp1_offload.settle_offloaded_fsdp1`): without it torch resumes off the
    trajectory even from a checkpoint it saved itself.
    """
    settle_offloaded_fsdp1(model)
    if form is Format.FULL:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(model, FullyShardedDataParallel) and model.cpu_offload.offload_params:
            # set_state_dict refuses an FSDP1 model whose parameters are offloaded to the CPU while its buffers
            # stay on the GPU ("Multiple devices found", torch 2.11 on CUDA): FSDP1's own full-state API loads it.
            with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(
                    model, optimizer, state["optim"]))
            return state["step"]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(full_state_dict=True))
        return state["step"]
    if form is Format.SHARDED:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd, "step": -1}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return state["step"]
    if form is Format.LOCAL:
        # Not weights_only: LOCAL files pickle ShardedTensors, which only a process group can rebuild.
        state = torch.load(_rank_file(path, dist.get_rank()), map_location="cpu", weights_only=False)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            # With use_orig_params=True, torch 2.13 loads the parameters through their views in the same file
            # but calls the _flat_param entries unexpected, even in a file it saved itself: allow just those.
            result = model.load_state_dict(state["model"], strict=False)
        unexpected = [k for k in result.unexpected_keys if not k.endswith(FLAT_PARAM)]
        if result.missing_keys or unexpected:
            raise KeyError(f"{path}: LOCAL state does not fit the model: missing {sorted(result.missing_keys)}, "
                           f"unexpected {sorted(unexpected)}")
        optimizer.load_state_dict(state["optim"])
        return state["step"]
    if form is Format.HF:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors files; expected an HF export")
        weights: dict[str, ValueType] = {k: v for f in files for k, v in load_file(f).items()}
        result = set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        missing = set(result.missing_keys) - TIED_KEYS
        if missing or result.unexpected_keys:
            raise KeyError(f"{path}: HF weights do not fit the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(result.unexpected_keys)}")
        return None
    raise ValueError(f"cannot load form {form!r}")


def write_flat_layout(config: TrainConfig, path: Path) -> None:
    """Write ckptkit's ``flat_layout.json`` into the LOCAL checkpoint at ``path``, as ckptkit does beside every
    LOCAL checkpoint it saves, from the model and wrap policy ``config`` trained with.

    Call it outside the ranks: deriving the layout starts a fake process group of its own.
    """
    _, auto_wrap, use_orig_params = config.fsdp1_options
    wrap = {AutoWrap.NONE: "none", AutoWrap.SIZE: f"size:{WRAP_MIN_NUM_PARAMS}",
            AutoWrap.BLOCK: f"block:{Block.__module__}:{Block.__qualname__}"}[auto_wrap]
    # The factory is called with no arguments: TinyTransformer() is the model training.build makes (MODEL).
    layout = derive_layout(f"{TinyTransformer.__module__}:{TinyTransformer.__qualname__}", wrap,
                           world_size=config.world_size, use_orig_params=use_orig_params,
                           param_dtype=config.param_dtype.torch_name if config.param_dtype else None)
    (path / LAYOUT_FILE).write_bytes(layout.to_json())


def _rank_file(directory: Path, rank: int) -> Path:
    """The one file of ``directory`` whose name's last number is ``rank`` (``rank0.pt``, ``model_rank_3.pt``)."""
    matches = [p for p in directory.iterdir() if (m := re.search(r"(\d+)\D*$", p.name)) and int(m.group(1)) == rank]
    if len(matches) != 1:
        found = sorted(p.name for p in matches)
        raise FileNotFoundError(f"{directory}: expected one file for rank {rank}, found {found}")
    return matches[0]

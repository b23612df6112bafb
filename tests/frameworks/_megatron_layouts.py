"""Checkpoints as Megatron-LM lays them out around megatron-core's models, made with megatron-core's own code on
gloo CPU ranks (see ``_megatron.py`` for the CPU patches):

- a ``torch_dist`` checkpoint that holds ``ShardedObject``s beside the model: Megatron-LM's ``rng_state``
  (built as its ``get_rng_state`` builds it for ``ckpt_format=torch_dist``) and Transformer Engine-style
  ``_extra_state`` values (a ``uint8`` tensor, as TE 1.x+ serializes its FP8 metadata; an ``io.BytesIO``, as
  older TE did), saved with ``dist_checkpointing.save`` and loaded back with ``dist_checkpointing.load``;
"""

from __future__ import annotations

import io
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import _megatron as M


def rng_state(seed: int) -> list[dict[str, Any]]:
    """One rank's RNG state as Megatron-LM's ``get_rng_state`` collects it (``data_parallel_random_init`` off:
    a list of one). ``cuda_rng_state`` is a CPU generator's state on these CUDA-less machines (the same
    ``ByteTensor`` type), and ``rng_tracker_states`` holds the model-parallel tracker's one state."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {"model-parallel-rng": torch.Generator().manual_seed(seed + 1).get_state()}}]


def _rng_object(tp: int, data: Any):
    """``rng_state`` as Megatron-LM wraps it for ``torch_dist``: one object per pipeline and tensor rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", data, (ps.get_pipeline_model_parallel_world_size(), tp),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def extra_state(key: str, layer: int) -> Any:
    """A Transformer Engine-style ``_extra_state`` for the linear layer ``key`` of ``layer``: TE serializes its
    FP8 metadata with ``pickle`` into a ``uint8`` tensor (an ``io.BytesIO`` in TE before 1.0)."""
    payload = pickle.dumps({"scale_fwd": [1.0 + layer, 0.5], "amax_history_fwd": [[layer, 2.0]], "key": key})
    if ".linear_fc1." in key:
        return io.BytesIO(payload)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).clone()


def _with_objects(model, tp: int, seed: int) -> dict[str, Any]:
    """``model``'s sharded state dict, its linear layers' ``_extra_state`` filled as TE fills them (layer
    ``n``'s from its offset), with Megatron-LM's ``rng_state`` and common state beside it."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = model.sharded_state_dict()
    for value in state.values():
        if isinstance(value, ShardedObject) and value.key.endswith("._extra_state"):
            value.data = extra_state(value.key, value.global_offset[0])
    state["rng_state"] = _rng_object(tp, rng_state(seed + dist.get_rank()))
    return {**state, "args": M.megatron_lm_args("llama", tp), "checkpoint_version": 3.0, "iteration": 5}


def save_objects(rank: int, world: int, tp: int, out: str) -> None:
    """Llama at ``tp`` saved with ``dist_checkpointing.save`` (torch_dist), with ShardedObjects beside it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    M._init(rank, world, tp)
    state = _with_objects(M.build("llama", tp), tp, seed=10)
    os.makedirs(out, exist_ok=True)
    with M._cpu_save():
        dist_checkpointing.save(state, out, sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    M._stop_writer_manager()
    M._done()


def load_objects(rank: int, world: int, tp: int, ckpts: list[str], result: str) -> None:
    """megatron-core's own ``dist_checkpointing.load`` of each of ``ckpts`` at ``tp``, asking for the model, its
    ``_extra_state`` objects and ``rng_state`` (templates unlike the saved values: one not loaded shows).
    Saves to ``result``/rank{rank}.pt, per checkpoint, the parameters' parts, the objects loaded, and what was
    saved."""
    from megatron.core import dist_checkpointing

    M._init(rank, world, tp)
    out = []
    for ckpt in ckpts:
        model = M.build("llama", tp, seed=1)
        template = _with_objects(model, tp, seed=99)
        for k in ("args", "checkpoint_version", "iteration"):
            template.pop(k)
        state = dist_checkpointing.load(template, ckpt)
        objects = {k: state.pop(k) for k in list(state) if k.endswith("._extra_state") or k == "rng_state"}
        common = {k: state.pop(k) for k in list(state) if k not in model.state_dict()}
        model.load_state_dict(state, strict=False)
        expected = {k: extra_state(_stacked(k), int(k.split(".")[2])) for k in objects if k != "rng_state"}
        expected["rng_state"] = rng_state(10 + rank)
        out.append({"params": M._local(model), "objects": _plain(objects), "expected": _plain(expected),
                    "common": common})
    torch.save(out, Path(result) / f"rank{rank}.pt")
    M._done()


def _stacked(key: str) -> str:
    """``decoder.layers.3.x._extra_state`` as the layer-stacked ShardedObject's key names it."""
    head, _, rest = key.partition("decoder.layers.")
    return f"{head}decoder.layers.{rest.partition('.')[2]}"


def _plain(value: Any) -> Any:
    """``value`` with ``io.BytesIO`` leaves as their bytes, numpy arrays as lists: comparable after a reload."""
    if isinstance(value, io.BytesIO):
        return ("BytesIO", value.getvalue())
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def saved_objects(tmp: Path, tp: int = 2) -> Path:
    from _spawn import spawn

    out = tmp / f"objects-tp{tp}"
    spawn(save_objects, 2, tp, str(out))
    return out


def loaded_objects(tmp: Path, tp: int, ckpts: list[Path]) -> list[list[dict[str, Any]]]:
    """Per checkpoint, each rank's result of :func:`load_objects` (one spawn for them all)."""
    from _spawn import spawn

    result = tmp / f"loaded-objects-tp{tp}"
    result.mkdir()
    spawn(load_objects, 2, tp, [str(c) for c in ckpts], str(result))
    # (weights_only=False: numpy's RNG state and megatron's own classes; these files are the test's own.)
    ranks = [torch.load(result / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return [list(per_ckpt) for per_ckpt in zip(*ranks, strict=True)]

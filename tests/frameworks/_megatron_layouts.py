"""Checkpoints as Megatron-LM lays them out around megatron-core's models, made with megatron-core's own code on
gloo CPU ranks (see ``_megatron.py`` for the CPU patches):

- a ``torch_dist`` checkpoint that holds ``ShardedObject``s beside the model: Megatron-LM's ``rng_state``
  (built as its ``get_rng_state`` builds it for ``ckpt_format=torch_dist``) and Transformer Engine-style
  ``_extra_state`` values (a ``uint8`` tensor, as TE 1.x+ serializes its FP8 metadata; an ``io.BytesIO``, as
  older TE did), saved with ``dist_checkpointing.save`` and loaded back with ``dist_checkpointing.load``;
- Megatron-LM's legacy ``torch`` format (``--ckpt-format torch``), as its ``save_checkpoint`` writes it
  (``megatron/training/checkpointing.py`` is not part of megatron-core, so the layout is written here as that
  function lays it out): ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/mp_rank_TT[_PPP]/
  model_optim_rng.pt``, each rank's ``torch.save`` of ``{args, checkpoint_version, iteration, model,
  rng_state, optimizer, opt_param_scheduler}``, ``model`` being the rank's own
  ``state_dict_for_save_checkpoint()``: per-layer keys numbered within the pipeline stage, tensor-parallel
  shards.
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


def _save_objects(tp: int, out: str) -> None:
    """Llama at ``tp`` (parallel state set up) saved with ``dist_checkpointing.save`` (torch_dist), with
    ShardedObjects beside it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    state = _with_objects(M.build("llama", tp), tp, seed=10)
    os.makedirs(out, exist_ok=True)
    with M._cpu_save():
        dist_checkpointing.save(state, out, sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    M._stop_writer_manager()


def load_objects(rank: int, world: int, tp: int, ckpts: list[str], result: str) -> None:
    """megatron-core's own ``dist_checkpointing.load`` of each of ``ckpts`` at ``tp``, asking for the model, its
    ``_extra_state`` objects and ``rng_state`` (templates unlike the saved values: one not loaded shows).
    Saves to ``result``/rank{rank}.pt, per checkpoint, the parameters' parts, the objects loaded, and what was
    saved."""
    from megatron.core import dist_checkpointing

    M._init(rank, world, tp, "llama")
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


def loaded_objects(tmp: Path, tp: int, ckpts: list[Path]) -> list[list[dict[str, Any]]]:
    """Per checkpoint, each rank's result of :func:`load_objects` (one spawn for them all)."""
    from _spawn import spawn

    result = tmp / f"loaded-objects-tp{tp}"
    result.mkdir()
    spawn(load_objects, 2, tp, [str(c) for c in ckpts], str(result))
    # (weights_only=False: numpy's RNG state and megatron's own classes; these files are the test's own.)
    ranks = [torch.load(result / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return [list(per_ckpt) for per_ckpt in zip(*ranks, strict=True)]


LEGACY_LAYERS = 4


def _legacy_model(tp: int, pp: int):
    """A Llama GPTModel of :data:`LEGACY_LAYERS` layers, this rank's pipeline stage of it, random weights."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = dataclasses.replace(M._config("llama", tp), num_layers=LEGACY_LAYERS, pipeline_model_parallel_size=pp,
                                 pipeline_dtype=torch.float32)
    torch.manual_seed(0)
    model = GPTModel(config=config, vocab_size=M.VOCAB, max_sequence_length=M.SEQ * 2,
                     transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=10000)
    # Random weights; a replicated one (a norm) the same on every tensor-parallel rank, as training keeps it.
    stage, rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    split, replicated = torch.Generator().manual_seed(1000 + 10 * stage + rank), torch.Generator().manual_seed(stage)
    with torch.no_grad():
        for p in model.parameters():
            g = split if getattr(p, "tensor_model_parallel", False) else replicated
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def legacy_args(tp: int, pp: int):
    args = M.megatron_lm_args("llama", tp)
    args.num_layers, args.pipeline_model_parallel_size, args.ckpt_format = LEGACY_LAYERS, pp, "torch"
    return args


def save_legacy(rank: int, world: int, tp: int, pp: int, out: str, dist_out: str, objects_out: str) -> None:
    """This rank's part of a model at ``tp`` x ``pp`` saved as Megatron-LM's ``save_checkpoint`` saves it with
    ``ckpt_format=torch`` at iteration 10 (under ``out``); the same model saved with ``dist_checkpointing.save``
    (torch_dist, under ``dist_out``); in ``out``/oracle-rank{rank}.pt, megatron-core's own declaration of
    where this rank's tensors lie in the global ones (its sharded state dict's global shapes and offsets); and,
    at ``tp`` alone, the logits of its forward and a torch_dist checkpoint with ShardedObjects (``objects_out``)."""
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = _legacy_model(tp, pp)
    args = legacy_args(tp, pp)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 10,
             "model": model.state_dict_for_save_checkpoint(), "rng_state": rng_state(rank),
             "optimizer": optimizer.state_dict(), "opt_param_scheduler": {"num_steps": 10}}
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    os.makedirs(Path(out) / "iter_0000010" / name, exist_ok=True)
    torch.save(state, Path(out) / "iter_0000010" / name / "model_optim_rng.pt")
    if rank == 0:
        (Path(out) / "latest_checkpointed_iteration.txt").write_text("10")
    torch.save(M._local(model), Path(out) / f"oracle-rank{rank}.pt")
    sharded = {**model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": 10}
    os.makedirs(dist_out, exist_ok=True)
    with M._cpu_save():
        dist_checkpointing.save(sharded, dist_out, sharded_strategy=get_default_save_sharded_strategy("torch_dist"))
    M._stop_writer_manager()
    dist.barrier()
    ps.destroy_model_parallel()
    _forward(tp, dist_out, Path(out) / "logits.pt")
    _save_objects(tp, objects_out)  # in the same ranks: starting megatron-core's ranks is most of a test's time
    dist.barrier()
    ps.destroy_model_parallel()


def _forward(tp: int, ckpt: str, out: Path) -> None:
    """megatron-core's own load of the torch_dist ``ckpt`` into a fresh model at ``tp`` (one pipeline stage),
    and its forward over :func:`_megatron.tokens`; rank 0 saves the logits over the whole vocabulary."""
    from megatron.core import dist_checkpointing, parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = _legacy_model(tp, 1)
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    ids = M.tokens()
    mask = torch.ones(M.SEQ, M.SEQ, dtype=torch.bool).triu(1)[None, None]  # True: masked out
    model.eval()
    with torch.no_grad(), M._cpu_forward():
        logits = M._gather_vocab(model(ids, torch.arange(M.SEQ)[None].expand_as(ids), mask))
    if dist.get_rank() == 0:
        torch.save(logits, out)


def saved_legacy(tmp: Path, tp: int = 2, pp: int = 2) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A legacy checkpoint at ``tp`` x ``pp``, the same model as torch_dist, and megatron-core's global tensors
    (layer-stacked, under its sharded state dict's keys) assembled from every rank's declared parts, with
    ``"logits"``: megatron-core's forward of the model (loaded from torch_dist at ``tp``). Beside them,
    ``tmp``/objects-tp{tp}: a torch_dist checkpoint with ShardedObjects (:func:`_with_objects`)."""
    from _spawn import spawn

    out, dist_out = tmp / f"legacy-tp{tp}pp{pp}", tmp / f"legacy-dist-tp{tp}pp{pp}"
    spawn(save_legacy, tp * pp, tp, pp, str(out), str(dist_out), str(tmp / f"objects-tp{tp}"))
    oracle = M.assemble([torch.load(out / f"oracle-rank{r}.pt") for r in range(tp * pp)])
    for r in range(tp * pp):
        (out / f"oracle-rank{r}.pt").unlink()
    oracle["logits"] = torch.load(out / "logits.pt")
    (out / "logits.pt").unlink()
    return out, dist_out, oracle

"""verl 0.9.1's FSDP checkpoint saves, reproduced call for call on real gloo ranks (verl itself pulls ray,
tensordict and pinned torch versions, so it cannot be installed beside torch 2.13). Module-level functions,
so that spawned ranks can import them.

What is reproduced, from the verl 0.9.1 wheel:
- the mesh, ``verl/workers/engine/fsdp/utils.py:35-52`` ``create_device_mesh``: ``(W,)`` named ``("fsdp",)``,
  or ``(W // fsdp_size, fsdp_size)`` named ``("ddp", "fsdp")``;
- the wrapping: FSDP2 ``verl/utils/fsdp_utils.py`` ``apply_fsdp2`` (``fully_shard`` on each decoder layer, then
  the root, no ``shard_placement_fn``); FSDP1 ``verl/workers/engine/fsdp/transformer_impl.py:437-492``
  (``FSDP(module, device_mesh=..., sharding_strategy=FULL_SHARD|HYBRID_SHARD, use_orig_params=False)``, then
  ``FSDP.set_state_dict_type(SHARDED_STATE_DICT)``);
- the save, ``verl/utils/checkpoint/fsdp_checkpoint_manager.py:311-417``: under ``SHARDED_STATE_DICT`` (FSDP1)
  each rank calls ``torch.save(model.state_dict())``, ``torch.save(optimizer.state_dict())`` and
  ``torch.save({"lr_scheduler": ..., "rng": ...})`` to ``{model,optim,extra_state}_world_size_W_rank_R.pt``;
  rank 0 writes ``huggingface/`` (config and tokenizer ``save_pretrained``) and ``fsdp_config.json``
  (``{"FSDP_version": v, "world_size": W}``, ``json.dump(indent=4)``).

The ground truth is gathered before the save, as verl's own round trip would see it: ``full_tensor()`` of
every DTensor (FSDP2), or FSDP1's FULL_STATE_DICT (taken first: on CPU FSDP1 cannot gather after a sharded
state dict).
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

VOCAB = {"<s>": 0, "</s>": 1, "<pad>": 2, "a": 3, "b": 4, "c": 5, "<unk>": 6}


def llama_config(tied: bool):
    from transformers import LlamaConfig

    # Odd dim-0 sizes (verl's own samples use the same): embed/lm_head 7 rows, k/v 2 rows (fewer than 3 ranks),
    # gate/up 5 rows; 4 rows of q/o split 2, 2, 0 over 3 ranks.
    config = LlamaConfig(vocab_size=7, hidden_size=4, intermediate_size=5, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=2, max_position_embeddings=16, tie_word_embeddings=tied,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16  # as the config of a downloaded model says, over verl's fp32 masters
    return config


def tiny_llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(tied)).to(torch.float32)
    with torch.no_grad():  # every element distinct and recognisable
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * 0.001 + i)
    return model


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(VOCAB, unk_token="<unk>")), bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def _mesh(world: int, fsdp_size: int):
    if fsdp_size < 0 or fsdp_size >= world:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh("cpu", (world // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def _wrap(model: torch.nn.Module, version: int, mesh):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if version == 2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    strategy = ShardingStrategy.FULL_SHARD if mesh.ndim == 1 else ShardingStrategy.HYBRID_SHARD
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), sharding_strategy=strategy,
                device_mesh=mesh, use_orig_params=False)


def _gathered(model, optim, version: int) -> tuple[dict, dict]:
    """The full model and optimizer state, keyed by parameter name."""
    if version == 2:
        names = [n for n, _ in model.named_parameters()]
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
        state = {names[i]: {k: (t.full_tensor() if isinstance(t, DTensor) else t).clone() for k, t in s.items()}
                 for i, s in optim.state_dict()["state"].items()}
        return full, {"state": state}
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel as FSDP,
        ShardedStateDictConfig,
        StateDictType,
    )

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        full = {k: v.clone() for k, v in model.state_dict().items()}
        full_optim = FSDP.optim_state_dict(model, optim)
    FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
    return full, full_optim


def save_like_verl(rank: int, world: int, jobs: list[tuple[str, int, int, bool]]) -> None:
    """For each ``(directory, FSDP version, fsdp_size, tied)``: one AdamW step of the tiny Llama under verl's
    mesh and wrapping, the gathered state to ``directory/expected.pt``, then verl's save into ``directory``.
    A DTensor placed ``Partial()`` goes to ``directory/partial`` (not a checkpoint layout; ckptkit must refuse it)."""
    from torch.optim.lr_scheduler import LambdaLR

    for directory, version, fsdp_size, tied in jobs:
        out = Path(directory)
        mesh = _mesh(world, fsdp_size)
        torch.manual_seed(0)
        model = _wrap(tiny_llama(tied), version, mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        sched = LambdaLR(optim, lambda s: min(1.0, (s + 1) / 10))  # verl's warmup schedule is a LambdaLR
        ids = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad()
        full, full_optim = _gathered(model, optim, version)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"model": full, "optim": full_optim}, out / "expected.pt")
        dist.barrier()
        # fsdp_checkpoint_manager.py:316-361: the three per-rank files.
        torch.save(model.state_dict(), out / f"model_world_size_{world}_rank_{rank}.pt")
        torch.save(optim.state_dict(), out / f"optim_world_size_{world}_rank_{rank}.pt")
        rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
        extra = {"lr_scheduler": sched.state_dict(), "rng": rng}
        torch.save(extra, out / f"extra_state_world_size_{world}_rank_{rank}.pt")
        if rank == 0:  # fsdp_checkpoint_manager.py:364-417
            llama_config(tied).save_pretrained(out / "huggingface")
            tokenizer().save_pretrained(out / "huggingface")
            with open(out / "fsdp_config.json", "w") as f:
                json.dump({"FSDP_version": version, "world_size": world}, f, indent=4)
        partial = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()] * mesh.ndim)
        (out / "partial").mkdir(exist_ok=True)
        torch.save({"w": partial}, out / "partial" / f"model_world_size_{world}_rank_{rank}.pt")
        # A parameter beside a persistent buffer, which FSDP leaves a plain tensor on every rank.
        placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
        sharded = distribute_tensor(torch.arange(35.0).reshape(7, 5), mesh, placements)
        (out / "buffers").mkdir(exist_ok=True)
        torch.save({"w": sharded, "scale": torch.linspace(0.5, 1.5, 3)},
                   out / "buffers" / f"model_world_size_{world}_rank_{rank}.pt")
        dist.barrier()

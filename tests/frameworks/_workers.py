"""Rank functions that train a tiny Llama for 2 steps under a framework and save with the framework's own code.

Each gathers ``expected.pt`` = ``{"model": full state dict, "optimizer": full FQN-keyed optimizer state}``
with ``get_state_dict(full_state_dict=True)`` on the FSDP root *before* the framework saves (FSDP1 on CPU
cannot take a full state dict after a sharded one). The CPU tricks each framework needs live here, inside
the spawned ranks only; every one was hit for real with torch 2.13 (error texts quoted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 64


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)


def tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def _batches(rank: int, n: int = 2):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(n)]


def _full(model, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # No cpu_offload: FSDP1 offloading parameters already on the CPU crashes (SIGSEGV in param_hook's clone).
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optimizer": osd}


def _save_expected(rank: int, state: dict[str, Any], path: Path) -> None:
    if rank == 0:
        torch.save(state, path)
    dist.barrier()


def _pin_no_offload() -> None:
    """FSDP1 FULL_STATE_DICT with ``offload_to_cpu=True`` on CPU tensors segfaults, and accelerate and Lightning
    always ask for it. FSDP checks the config's exact type (a subclass raises "Expected state_dict_config of type
    ...FullStateDictConfig"), so the field itself is pinned to False."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    for cls in (FullStateDictConfig, FullOptimStateDictConfig):
        cls.__setattr__ = lambda self, k, v: object.__setattr__(self, k, False if k == "offload_to_cpu" else v)


def _force_accelerate_fsdp(plugin) -> None:
    """``Accelerator(cpu=True)`` picks MULTI_CPU and silently drops the FSDP plugin; its device ``cpu:0`` then
    fails FSDP1 ("Inconsistent compute device and `device_id` on rank 0: cpu vs cpu:0"). Force both."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    state.device = PartialState._shared_state["device"] = torch.device("cpu")


# ---------------------------------------------------------------------------------------------- accelerate


def accelerate_save(rank: int, world: int, version: int, out: str) -> None:
    """accelerate 1.15 ``Accelerator.save_state`` with FSDP ``version``: FULL_STATE_DICT into ``out/full``, then
    SHARDED_STATE_DICT into ``out/sharded`` (the plugin switched between the two saves)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    _pin_no_offload()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version, state_dict_type="FULL_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], use_orig_params=True if version == 1 else None,
        cpu_ram_efficient_loading=False, **({"reshard_after_forward": "FULL_SHARD"} if version == 1 else {}))
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    _force_accelerate_fsdp(plugin)
    model = tiny_llama()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for ids in _batches(rank):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    _save_expected(rank, _full(model, opt), Path(out) / "expected.pt")
    acc.save_state(str(Path(out) / "full"))
    plugin.state_dict_config = plugin.optim_state_dict_config = None  # else the FULL configs are kept
    plugin.set_state_dict_type("SHARDED_STATE_DICT")
    acc.save_state(str(Path(out) / "sharded"))
    acc.wait_for_everyone()


# ------------------------------------------------------------------------------------------- HF Trainer


def trainer_save(rank: int, world: int, out: str) -> None:
    """transformers 5.23 ``Trainer`` with ``fsdp="full_shard auto_wrap"`` (FSDP2, SHARDED_STATE_DICT), saving
    ``checkpoint-2/`` after 2 steps; expected.pt is gathered in ``on_step_end`` of the save step."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class CpuFsdpTrainer(Trainer):
        # The Trainer builds its own Accelerator, which drops the plugin on CPU (see _force_accelerate_fsdp).
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            _force_accelerate_fsdp(FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    class Expect(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == args.max_steps:  # the Trainer saves right after this event
                _save_expected(rank, _full(model, getattr(optimizer, "optimizer", optimizer)),
                               Path(out) / "expected.pt")

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (16, 8), generator=g)]
    args = TrainingArguments(
        output_dir=str(Path(out) / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=2, report_to=[],
        use_cpu=True, logging_strategy="no", save_strategy="steps", fsdp="full_shard auto_wrap",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": "SHARDED_STATE_DICT"},
        ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True)
    CpuFsdpTrainer(model=tiny_llama(), args=args, train_dataset=data, callbacks=[Expect()]).train()
    dist.barrier()


# -------------------------------------------------------------------------------------- Lightning Fabric


def _fabric(world: int, state_dict_type: str):
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class CpuFSDPStrategy(FSDPStrategy):
        """The connector refuses FSDP off-GPU by ``type(strategy) is FSDPStrategy`` ("FSDP is only available on
        GPU"); a subclass passes."""

    strategy = CpuFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, state_dict_type=state_dict_type,
                               process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _fabric_module(fabric):
    """Fabric passes ``device_id=root_device.index``, None on CPU ("FSDP needs a non-CPU accelerator device");
    wrapped here with ``device_id=cpu``, ``setup_module`` sees FSDP submodules and wraps no further."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = fabric.setup_module(FSDP(tiny_llama(), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                     use_orig_params=True, device_id=torch.device("cpu")))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def fabric_save(rank: int, world: int, out: str) -> None:
    """Lightning 2.6 Fabric, FSDPStrategy (FSDP1): ``fabric.save`` of model, optimizer, scheduler and plain values,
    full into ``out/ckpt.pt``, then sharded into ``out/sharded/``."""
    _pin_no_offload()
    fabric = _fabric(world, "full")
    model, opt, sched = _fabric_module(fabric)
    for ids in _batches(rank):
        fabric.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        sched.step()
    _save_expected(rank, _full(model.module, opt.optimizer), Path(out) / "expected.pt")
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 2, "hparams": {"lr": 1e-2, "name": "tiny"}}
    fabric.save(Path(out) / "ckpt.pt", state)
    fabric.strategy._state_dict_type = "sharded"
    fabric.save(Path(out) / "sharded", state)
    fabric.barrier()


def fabric_load(rank: int, world: int, paths: list[str], expected: str) -> list[dict[str, Any]]:
    """``fabric.load`` each of ``paths`` into a fresh model; what came back against ``expected.pt``. Full files go
    first: an FSDP1 module cannot take a full state dict after a sharded one on CPU."""
    _pin_no_offload()
    fabric = _fabric(world, "full")
    ref = torch.load(expected, weights_only=True)
    out = []
    for path in paths:
        fabric.strategy._state_dict_type = "sharded" if Path(path).is_dir() else "full"
        model, opt, sched = _fabric_module(fabric)
        state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0, "hparams": None}
        rest = fabric.load(path, state)
        got = _full(model.module, opt.optimizer)
        scheduler = state["scheduler"] if isinstance(state["scheduler"], dict) else sched.state_dict()
        out.append({"path": path, "model": [k for k, v in ref["model"].items() if not torch.equal(v, got["model"][k])],
                    "optimizer": [f"{k}.{s}" for k, st in ref["optimizer"]["state"].items() for s, v in st.items()
                                  if not torch.equal(v, got["optimizer"]["state"][k][s])],
                    "step": state["step"], "hparams": state["hparams"], "last_epoch": scheduler["last_epoch"],
                    "rest": rest})
    return out


# ------------------------------------------------------------------------------------- Lightning Trainer


def _lightning_trainer(world: int, callbacks: list, max_steps: int, ckpt_dir: str):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class CpuFSDPStrategy(FSDPStrategy):
        # As for Fabric: a subclass passes the GPU check; the model is wrapped with device_id=cpu first.
        def _setup_model(self, model):
            if not any(isinstance(m, FSDP) for m in model.modules()):
                model = FSDP(model, sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                             **self.kwargs)
            return super()._setup_model(model)

    class TinyLM(L.LightningModule):
        def __init__(self, lr: float = 1e-2) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = tiny_llama()

        def training_step(self, batch, _):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

    g = torch.Generator().manual_seed(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (16, 8), generator=g)),
                                         batch_size=2)
    strategy = CpuFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, state_dict_type="sharded",
                               process_group_backend="gloo")
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=max_steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[*callbacks, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)])
    return trainer, TinyLM(), loader


def _trainer_full(trainer) -> dict[str, Any]:
    # On the FSDP root: get_state_dict on the inner LightningModule returns flat 1-D parameters.
    return _full(trainer.strategy.model, trainer.optimizers[0])


def lightning_trainer_save(rank: int, world: int, out: str) -> None:
    """Lightning 2.6 Trainer, FSDPStrategy (FSDP1), ``ModelCheckpoint`` at step 2 (sharded: ``epoch=0-step=2.ckpt/``);
    the callback that gathers expected.pt also saves the full ``full.ckpt`` through ``trainer.save_checkpoint``."""
    import lightning as L

    _pin_no_offload()

    class Expect(L.Callback):  # Lightning runs checkpoint callbacks last, so this goes before ModelCheckpoint
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                _save_expected(rank, _trainer_full(trainer), Path(out) / "expected.pt")
                trainer.strategy._state_dict_type = "full"
                trainer.save_checkpoint(Path(out) / "full.ckpt")
                trainer.strategy._state_dict_type = "sharded"

    trainer, module, loader = _lightning_trainer(world, [Expect()], 2, str(Path(out) / "ckpts"))
    trainer.fit(module, loader)


def lightning_trainer_load(rank: int, world: int, ckpt: str, expected: str) -> dict[str, Any]:
    """``Trainer.fit(ckpt_path=ckpt)``: the state at ``on_train_start`` against ``expected.pt``, then one step on."""
    import lightning as L

    _pin_no_offload()
    seen: dict[str, Any] = {}

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            ref, got = torch.load(expected, weights_only=True), _trainer_full(trainer)
            seen["model"] = [k for k, v in ref["model"].items() if not torch.equal(v, got["model"][k])]
            seen["optimizer"] = [f"{k}.{s}" for k, st in ref["optimizer"]["state"].items() for s, v in st.items()
                                 if not torch.equal(v, got["optimizer"]["state"][k][s])]
            seen["global_step"] = trainer.global_step
            seen["last_epoch"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch

    trainer, module, loader = _lightning_trainer(world, [Check()], 3, str(Path(ckpt).parent / f"resumed{world}"))
    trainer.fit(module, loader, ckpt_path=ckpt)
    return {**seen, "final_step": trainer.global_step}


# -------------------------------------------------------------------------------------------- torchtitan


def torchtitan_save(rank: int, world: int, out: str) -> None:
    """torchtitan's ``CheckpointManager.save`` calls (v0.2.2 ``torchtitan/components/checkpoint.py``; v0.3.0
    ``torchtitan/components/checkpointer/dcp.py``, same layout): ``dcp.save`` of the model's state dict merged
    at the top level (``ModelWrapper``, ``get_model_state_dict``) beside ``optimizer``
    (``get_optimizer_state_dict(flatten_optimizer_state_dict=True)``), ``lr_scheduler`` (the LambdaLR state),
    ``dataloader`` (``{"dp_rank_R": pickled bytes, "world_size": W}``) and ``train_state``
    (``{"step", "ntokens_seen"}``), into ``step-2/``. FSDP2 ``fully_shard`` per decoder layer and at the root,
    as torchtitan's ``apply_fsdp`` does; transformers' Llama stands in for torchtitan's model."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    for ids in _batches(rank):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    _save_expected(rank, _full(model, opt), Path(out) / "expected.pt")
    states = {
        **get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
        "lr_scheduler": sched.state_dict(),
        "dataloader": {f"dp_rank_{rank}": pickle.dumps({"sampler_iter_yielded": 4}), "world_size": world},
        "train_state": {"step": 2, "ntokens_seen": 64},
    }
    dcp.save(states, checkpoint_id=str(Path(out) / "step-2"))
    dist.barrier()

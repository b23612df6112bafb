"""``ckptkit.save``: the one call a training loop's save hook needs, on every rank.

State goes through torch's ``get_state_dict``, which gives the same fully qualified names for a plain
module, DDP, FSDP1 and FSDP2: that is what lets a checkpoint saved under one wrapper and world size load
under another (:mod:`.load`). A save writes into a staging directory shared by all ranks, adds
``ckptkit.json`` (format, world size, step, per-tensor CRC-32s), then rank 0 publishes it (completion
marker, rename, ``latest``) and only afterwards rotates older steps.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ..core.manifest import FormName
from ..core.plan import Region, row_blocks
from ..errors import UsageError
from ..formats import detect
from ..io import publish as rotation
from ..io.publish import replace_with
from ..io.sources import Files, read_region

__all__ = ["FULL_FILE", "MANIFEST", "SIDE_KEYS", "SaveHandle", "save"]

MANIFEST = "ckptkit.json"
FULL_FILE = "checkpoint.pt"
_FORMS = ("full", "sharded", "hf", "local")
SIDE_KEYS = ("scheduler", "extra", "step")
"""Top-level keys a save writes beside ``model`` and ``optim``."""


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


_ASYNC_GROUPS: dict[int, Any] = {}


def _async_group() -> Any:
    """A gloo group of its own for background saves: their collectives must not interleave with training's
    on the default group. Made once per default group (new_group is itself a collective)."""
    key = id(dist.group.WORLD)
    if key not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[key] = dist.new_group(backend="gloo")
    return _ASYNC_GROUPS[key]


def _cpu_copy(tree: Any) -> Any:
    """Clone every tensor to CPU memory so training may change the originals while files are written."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: _cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cpu_copy(v) for v in tree)
    return tree


@dataclass
class SaveHandle:
    """What ``save`` returns. ``wait()`` (on every rank) finishes the files, publishes and rotates."""

    path: Path
    _publish: Callable[[], None] = field(repr=False)
    _pending: Future | None = field(default=None, repr=False)
    """The background write of an async save; ``result()`` re-raises its error in the caller's thread."""
    _done: bool = False

    def wait(self) -> Path:
        if not self._done:
            if self._pending is not None:
                self._pending.result()
            self._publish()
            self._done = True
        return self.path


def save(path: str | os.PathLike, model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
         scheduler: Any = None, extra_state: Any = None, form: FormName = "sharded", step: int | None = None,
         keep_last: int | None = None, max_total_gb: float | None = None, async_save: bool = False,
         hf_assets: str | os.PathLike | None = None) -> SaveHandle:
    """Save model (+ optimizer, scheduler, extra state) in ``form``; call on every rank.

    ``form`` is ``sharded`` (DCP), ``full`` (one ``torch.save`` file from rank 0), ``hf`` (safetensors
    weights, plus config and tokenizer from ``hf_assets``) or ``local`` (FSDP1 only: each rank's
    LOCAL_STATE_DICT and the flat layout that lets ckptkit read it at any world size).

    With ``step``, ``path`` is a root: the checkpoint goes to ``path/step-NNNNNNNN``, ``latest`` moves to it
    once it is complete, and ``keep_last`` / ``max_total_gb`` then remove older steps (never the new one).
    Without ``step``, ``path`` is the checkpoint directory itself. ``async_save=True`` returns once the state
    is copied to CPU memory; call ``handle.wait()`` on every rank before the next save. (FSDP1's sharded
    state cannot be staged by torch's async stager; that one case writes before returning.)
    """
    if form not in _FORMS:
        raise UsageError(f"form must be one of {', '.join(_FORMS)}, got {form!r}")
    rank, world = _rank_world()
    root = Path(path)
    final = rotation.step_dir(root, step) if step is not None else root
    stage = final.parent / f".{final.name}.ckptkit-partial"
    if rank == 0:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    _barrier()

    def publish() -> None:
        _publish(root, final, stage, form, world, step, keep_last, max_total_gb)

    def done() -> SaveHandle:
        handle = SaveHandle(final, publish)
        handle.wait()
        return handle

    side = {k: v for k, v in (("scheduler", scheduler.state_dict() if scheduler is not None else None),
                              ("extra", extra_state), ("step", step)) if v is not None}
    if form == "local":
        # ShardedTensors cannot be staged by copying (see the sharded form): the files are written now.
        _write_local(model, optimizer, side, stage, rank)
        return done()
    full = form in ("full", "hf")
    # Offload only from an accelerator: FSDP1's CPU offload of CPU parameters crashes (torch 2.13, SIGSEGV).
    on_device = any(p.device.type != "cpu" for p in model.parameters())
    options = StateDictOptions(full_state_dict=full, cpu_offload=full and on_device)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    state: dict[str, Any] = {"model": msd, **({"optim": osd} if optimizer is not None else {}), **side}

    if form == "sharded":
        # torch's async stager cannot copy FSDP1's ShardedTensors (torch 2.13): those save synchronously.
        sharded_tensors = any(type(v).__name__ == "ShardedTensor" for v in msd.values())
        if async_save and not sharded_tensors:
            group = _async_group() if dist.is_available() and dist.is_initialized() else None
            response = dcp.async_save(state, checkpoint_id=str(stage), process_group=group)
            # An AsyncSaveResponse comes back only from a stager that stages in the background (not the default).
            future = response if isinstance(response, Future) else response.upload_completion
            return SaveHandle(final, publish, _pending=future)
        dcp.save(state, checkpoint_id=str(stage))
        return done()

    def write(snapshot: dict[str, Any]) -> None:
        if rank != 0:
            return
        if form == "full":
            torch.save(snapshot, stage / FULL_FILE)
        else:
            _write_hf(snapshot["model"], stage, hf_assets)

    snapshot = _cpu_copy(state) if rank == 0 else {}
    if async_save:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-save") as pool:
            pending = pool.submit(write, snapshot)  # leaving the block does not wait: shutdown(wait=False)
            pool.shutdown(wait=False)
        return SaveHandle(final, publish, _pending=pending)
    write(snapshot)
    return done()


def _publish(root: Path, final: Path, stage: Path, form: str, world: int, step: int | None,
            keep_last: int | None, max_total_gb: float | None) -> None:
    """After every rank has written: rank 0 adds ckptkit.json, publishes, then rotates."""
    rank, _ = _rank_world()
    _barrier()
    if rank == 0:
        _write_manifest(stage, form, world, step)
        if step is None:
            (stage / rotation.COMPLETE).write_text("complete\n")
            replace_with(final, stage)
        else:
            rotation.publish(stage, final)
            max_bytes = int(max_total_gb * 1e9) if max_total_gb is not None else None
            rotation.rotate(root, keep_last=keep_last, max_total_bytes=max_bytes)
    _barrier()


def _write_local(model: torch.nn.Module, optimizer: Any, side: dict[str, Any], stage: Path, rank: int) -> None:
    """FSDP1 LOCAL_STATE_DICT: every rank writes its own file; rank 0 puts the flat layout beside them."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    from ..formats.local.derive import layout_of
    from ..formats.local.layout import LAYOUT_FILE

    if not isinstance(model, FSDP):
        raise UsageError(f"form='local' is FSDP1's LOCAL_STATE_DICT, but the model is a {type(model).__name__}; "
                         "use 'sharded' for FSDP2, DDP and plain modules")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    torch.save({**state, **side}, stage / f"rank{rank}.pt")
    if rank == 0:
        (stage / LAYOUT_FILE).write_bytes(layout_of(model).to_json())


def _write_hf(model_sd: dict[str, torch.Tensor], stage: Path, hf_assets: str | os.PathLike | None) -> None:
    from huggingface_hub import save_torch_state_dict

    # save_torch_state_dict keeps one name for tensors that share storage (a tied lm_head), as
    # save_pretrained does; load() restores the alias from the model's own tying.
    save_torch_state_dict(model_sd, stage)
    if hf_assets is not None:
        from ..ops.export import ASSET_FILES

        for name in ASSET_FILES:
            if (Path(hf_assets) / name).is_file():
                shutil.copy2(Path(hf_assets) / name, stage / name)


def _write_manifest(stage: Path, form: str, world: int, step: int | None) -> None:
    manifest = detect(stage).read(stage)
    checksums = {}
    with Files() as files:
        for t in manifest.tensors:
            crc = 0
            for block in row_blocks(Region.whole(t), 64 << 20):
                crc = zlib.crc32(read_region(block, files), crc)
            checksums[t.key] = {"dtype": t.dtype.name, "shape": list(t.shape), "crc32": f"{crc:08x}"}
    info = {"format": form, "world_size": world, "step": step, "tensors": checksums}
    (stage / MANIFEST).write_text(json.dumps(info, indent=1) + "\n")

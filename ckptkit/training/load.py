"""``ckptkit.save`` / ``ckptkit.load``: the one call a training loop's save hook needs.

Both are called on every rank. State goes through torch's ``get_state_dict`` / ``set_state_dict``, which
give the same fully qualified names for a plain module, DDP, FSDP1 and FSDP2 — that is what lets a
checkpoint saved under one wrapper and world size load under another. A save writes into a staging
directory shared by all ranks, adds ``ckptkit.json`` (format, world size, step, per-tensor CRC-32s), then
rank 0 publishes it (completion marker, rename, ``latest``) and only afterwards rotates older steps.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..io import publish as rotation
from ..core.tree import flatten, unflatten
from ..errors import UsageError
from ..io.publish import replace_with
from ..io.sources import Files, read_region
from ..formats import detect, object_value
from ..core.manifest import Format, Manifest, TensorEntry, map_tensor_refs
from ..ops.names import strip_wrapper_names
from ..core.plan import Region, row_blocks

__all__ = ["LoadResult", "SaveHandle", "load", "save"]

MANIFEST = "ckptkit.json"
FULL_FILE = "checkpoint.pt"
_FORMS = ("full", "sharded", "hf", "local")
_SIDE = ("scheduler", "extra", "step")  # top-level keys beside "model" and "optim"


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
    _finish: Any = field(repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _future: Any = field(default=None, repr=False)
    _done: bool = False

    def wait(self) -> Path:
        if not self._done:
            if self._thread is not None:
                self._thread.join()
                if getattr(self._thread, "error", None):
                    raise self._thread.error
            if self._future is not None:
                self._future.result()
            self._finish()
            self._done = True
        return self.path


@dataclass(frozen=True)
class LoadResult:
    path: Path
    """The checkpoint directory that was loaded (``latest`` resolved)."""
    step: int | None
    extra_state: Any


def save(path: str | os.PathLike, model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
         scheduler: Any = None, extra_state: Any = None, form: str = "sharded", step: int | None = None,
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

    def finish() -> None:
        _finish(root, final, stage, form, world, step, keep_last, max_total_gb)

    def done() -> SaveHandle:
        handle = SaveHandle(final, finish)
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
            future = dcp.async_save(state, checkpoint_id=str(stage), process_group=group)
            return SaveHandle(final, finish, _future=future)
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
        thread = threading.Thread(target=_capture(write), args=(snapshot,), daemon=True)
        thread.start()
        return SaveHandle(final, finish, _thread=thread)
    write(snapshot)
    return done()


def _finish(root: Path, final: Path, stage: Path, form: str, world: int, step: int | None,
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


def _capture(fn):
    def run(*args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # re-raised by SaveHandle.wait() in the caller's thread
            threading.current_thread().error = e
    return run


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


def _tensor(entry: TensorEntry, files: Files) -> torch.Tensor:
    data = read_region(Region.whole(entry), files)
    dtype = getattr(torch, entry.dtype.name)
    return (torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)).reshape(entry.shape)


def _to_torch(value: Any, files: Files) -> Any:
    """A value read by ckptkit with its tensor leaves (byte spans) turned into torch tensors."""
    return map_tensor_refs(value, lambda ref: _tensor(ref.as_entry(("<tensor inside an object>",)), files))


def _read_all(manifest: Manifest, tops: tuple[str, ...] | None) -> dict[str, Any]:
    """The entries of a manifest under top-level keys ``tops`` (all when None) as torch objects."""
    items = []
    with Files() as files:
        for t in manifest.tensors:
            if tops is None or str(t.path[0]) in tops:
                items.append((t.path, _tensor(t, files)))
        for o in manifest.objects:
            if tops is None or str(o.path[0]) in tops:
                items.append((o.path, _to_torch(object_value(o), files)))
    return unflatten(items) if items else {}


def load(path: str | os.PathLike, model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
         scheduler: Any = None, strict: bool = True, load_optimizer: bool = True,
         load_scheduler: bool = True) -> LoadResult:
    """Load a checkpoint of any form, saved at any world size, into ``model`` (+ optimizer, scheduler).

    ``path`` may be a root: ``latest`` (or the newest complete step) is used. Returns the step and
    ``extra_state`` that were saved. Call on every rank.
    """
    ckpt = rotation.resolve(Path(path))
    manifest = detect(ckpt).read(ckpt)  # once: for DCP this reads every chunk's header
    fmt = manifest.format
    optimizer = optimizer if load_optimizer else None
    side = _read_all(manifest, _SIDE) if fmt is not Format.HF else {}
    if fmt is Format.SHARDED:
        msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
        target: dict[str, Any] = {"model": msd}
        if optimizer is not None:
            target["optim"] = osd
        _check_keys(manifest, target, strict)
        dcp.load(target, checkpoint_id=str(ckpt))
        options = StateDictOptions(strict=strict)
        set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=target["model"],
                       optim_state_dict=target.get("optim", {}), options=options)
    else:
        state = _read_all(manifest, ("model", "optim")) if fmt is not Format.HF else {"model": _read_all(manifest, None)}
        model_sd = _with_tied_aliases(model, state.get("model", {}))
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=model_sd,
                       optim_state_dict=state.get("optim", {}) if optimizer is not None else {}, options=options)
    if scheduler is not None and load_scheduler and "scheduler" in side:
        scheduler.load_state_dict(side["scheduler"])
    return LoadResult(ckpt, side.get("step"), side.get("extra"))


def _with_tied_aliases(model: torch.nn.Module, model_sd: dict[str, Any]) -> dict[str, Any]:
    """Fill keys a save left out because they alias another parameter (a tied ``lm_head``)."""
    named = list(model.named_parameters(remove_duplicate=False))
    by_param: dict[int, list[str]] = {}
    for name, p in named:
        by_param.setdefault(id(p), []).append(strip_wrapper_names(name))
    out = dict(model_sd)
    for names in by_param.values():
        present = [n for n in names if n in out]
        for n in names:
            if n not in out and present:
                out[n] = out[present[0]]
    return out


def _check_keys(manifest: Manifest, target: dict[str, Any], strict: bool) -> None:
    """DCP raises on the first missing key; list them all (strict), or drop them from the target (not)."""
    have = set(manifest.keys)
    missing = [p for p, _ in flatten(target, lambda v: isinstance(v, torch.Tensor))
               if ".".join(map(str, p)) not in have and not any(k.startswith(".".join(map(str, p)) + ".") for k in have)]
    if missing and strict:
        names = [".".join(map(str, p)) for p in missing]
        raise UsageError(f"{manifest.root}: checkpoint lacks {len(names)} keys the model/optimizer needs: "
                         f"{', '.join(names[:10])}{' ...' if len(names) > 10 else ''} (pass strict=False to skip them)")
    for path in missing:
        node = target
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

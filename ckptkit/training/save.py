"""``ckptkit.save``: the one call a training loop's save hook needs, on every rank.

State goes through torch's ``get_state_dict``, which gives the same fully qualified names for a plain
module, DDP, FSDP1 and FSDP2: that is what lets a checkpoint saved under one wrapper and world size load
under another (:mod:`.load`). Rank 0 stages a directory beside the target
(:mod:`ckptkit.io.storage.local.staging`), every rank writes its part there and records the CRC-32 of every
tensor it writes as it writes it
(:mod:`ckptkit.ops.checksums`); then rank 0 adds ``ckptkit.json`` (format, world size, step, save number,
checksums), publishes (completion marker, atomic rename, ``latest``) and only afterwards rotates older saves.
Every rank learns rank 0's outcome, so a failed publish raises everywhere instead of leaving ranks waiting.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ..core.manifest import FormName, key_of
from ..core.tree import flatten
from ..errors import CheckpointError, UsageError
from ..formats import detect
from ..formats.replace import check_replaceable
from ..io.execute import gloo_group
from ..io.storage import storage_at
from ..io.storage.local import staging as local
from ..ops import checksums
from ..ops.checksums import MANIFEST, Recorder
from . import rotation

__all__ = ["FULL_FILE", "MANIFEST", "SIDE_KEYS", "TRAINING_STATE", "SaveHandle", "save", "single_process_quiet"]

FULL_FILE = "checkpoint.pt"
_FORMS = ("full", "sharded", "hf", "local")
TRAINING_STATE = "training_state"
"""The DCP directory that a ``form="hf"`` save writes beside the safetensors weights: the optimizer, scheduler,
extra state and step, which safetensors cannot hold."""
SIDE_KEYS = ("scheduler", "extra", "step")
"""Top-level keys a save writes beside ``model`` and ``optim``."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """torch's DCP without a process group, minus its warning that it "assumes the intent is to save (load) in a
    single process": one process is a use ckptkit.save and ckptkit.load support, not a mistake to warn of."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        yield


def _quiet_async_single_process() -> None:
    """The same for an async save, whose ``dcp.save`` warns later, in torch's writer thread, after any ``with``
    here has ended: a filter for that one message of torch's DCP stays in place for the process."""
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning,
                            module=r"torch\.distributed\.checkpoint\.")


def local_path(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a local path; a URL is refused: saves and loads publish and read step directories by renames
    and descriptors, which object stores do not have."""
    storage, root = storage_at(os.fspath(path))
    if storage.scheme != "file":
        raise UsageError(f"{path}: {what} works on a local or shared filesystem; save there, then copy a "
                         "checkpoint to an object store with 'ckptkit convert' or 'ckptkit export-hf' (which "
                         "take URLs)")
    return root


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


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
    """What ``save`` returns. ``wait()`` (on every rank) finishes the files, publishes and rotates.

    Attributes:
        path: The checkpoint directory the save publishes.
    """

    path: Path
    _publish: Callable[[], None] = field(repr=False)
    _pending: Future | None = field(default=None, repr=False)
    """The background write of an async save; ``result()`` re-raises its error in the caller's thread."""
    _done: bool = False

    def wait(self) -> Path:
        if not self._done:
            self._done = True
            self._publish()
        return self.path


def _shared(value: Any, group: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _outcome(error: BaseException | None, group: Any) -> None:
    """Raise on every rank if any rank failed; rank 0's error text names what went wrong."""
    message = f"rank {_rank_world()[0]}: {error}" if error is not None else None
    if _distributed():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, message, group=group)
        failed = [m for m in every if m]
    else:
        failed = [message] if message else []
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"the save failed on another rank: {'; '.join(failed)}")


def _stage(final: Path, *, replace_checkpoint_only: bool, group: Any) -> local.Staging:
    """Rank 0 stages beside ``final``; every rank gets the staging directory (or rank 0's error)."""
    rank, _ = _rank_world()
    staging, error = None, None
    if rank == 0:
        try:
            if replace_checkpoint_only:
                check_replaceable(final, writer="ckptkit.save (without step=)")
            staging = local.stage(final, replace=True)
        except Exception as e:
            error = e
    where = _shared(str(staging.path) if staging else f"error: {error}", group)
    if error is not None:
        raise error
    if not os.path.isabs(where):
        raise CheckpointError(f"rank 0 could not stage {final}: {where.removeprefix('error: ')}")
    return staging or local.Staging(final, Path(where), owner=False)


def save(path: str | os.PathLike, model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
         scheduler: Any = None, extra_state: Any = None, form: FormName = "sharded", step: int | None = None,
         keep_last: int | None = None, max_total_gb: float | None = None, async_save: bool = False,
         hf_assets: str | os.PathLike | None = None) -> SaveHandle:
    """Save model (+ optimizer, scheduler, extra state) in ``form``; call on every rank.

    ``form`` is ``sharded`` (DCP), ``full`` (one ``torch.save`` file from rank 0), ``hf`` (safetensors
    weights, plus every file but weights of the model directory ``hf_assets``, as ``export-hf --hf-assets``
    copies them; the optimizer, scheduler, extra state and step go beside them into a DCP ``training_state/``
    directory, which :func:`ckptkit.load` resumes from) or ``local`` (FSDP1 only: each rank's
    LOCAL_STATE_DICT and the flat layout that lets ckptkit read it at any world size).

    With ``step``, ``path`` is a run directory: the checkpoint goes to ``path/step-NNNNNNNN``, ``latest`` moves
    to it once it is complete, and ``keep_last`` / ``max_total_gb`` then remove the least recent saves (never
    the new one). Saving a step that exists replaces it atomically. Without ``step``, ``path`` is the
    checkpoint directory itself. ``async_save=True`` returns once the state is copied to CPU memory; call
    ``handle.wait()`` on every rank before the next save. (FSDP1's sharded state cannot be staged by torch's
    async stager; that one case writes before returning.)

    Args:
        path: The run directory (with ``step``) or the checkpoint directory; local or a shared filesystem.
        model: The model: a plain module, DDP, FSDP1 or FSDP2.
        optimizer: Its optimizer, saved keyed by parameter name.
        scheduler: An object with ``state_dict()``, saved beside the model.
        extra_state: Any picklable value, returned by :func:`ckptkit.load` as ``extra_state``.
        form: ``sharded`` (DCP), ``full``, ``hf`` or ``local``.
        step: The training step: the checkpoint goes to ``path/step-NNNNNNNN``.
        keep_last: Keep this many most recent saves.
        max_total_gb: Keep the most recent saves whose sizes sum to at most this many GB.
        async_save: Return once the state is copied to CPU memory; the write goes on in the background.
        hf_assets: An HF model directory whose config and tokenizer files a ``hf`` save copies.

    Returns:
        A handle whose ``wait()``, called on every rank, finishes the write, publishes and rotates.

    Raises:
        UsageError: ``form`` is unknown, ``path`` is a URL, or (without ``step``) ``path`` exists and holds
            what is not a checkpoint ckptkit reads, an empty directory or an empty file.
        CheckpointError: Publishing failed on rank 0; raised on every rank.
    """
    if form not in _FORMS:
        raise UsageError(f"form must be one of {', '.join(_FORMS)}, got {form!r}")
    root = local_path(path, "ckptkit.save")
    final = rotation.step_dir(root, step) if step is not None else root
    group = gloo_group()
    staging = _stage(final, replace_checkpoint_only=step is None, group=group)
    job = _Save(root, final, staging, Recorder(), form, step, keep_last, max_total_gb, group)
    try:
        side = {k: v for k, v in (("scheduler", scheduler.state_dict() if scheduler is not None else None),
                                  ("extra", extra_state), ("step", step)) if v is not None}
        return _write(job, model, optimizer, side, async_save=async_save, hf_assets=hf_assets)
    except Exception as e:
        # Through the publish step all the same: every rank then learns of it and raises, none waits forever.
        return job.done(e)
    except BaseException:
        staging.abort()  # Ctrl-C, SystemExit: this process is going; a later save recovers the rest
        raise


@dataclass(frozen=True, slots=True)
class _Save:
    """One save under way: where it publishes, what its ranks record, and how it rotates afterwards."""

    root: Path
    final: Path
    staging: local.Staging
    recorder: Recorder
    form: str
    step: int | None
    keep_last: int | None
    max_total_gb: float | None
    group: Any

    def finish(self, pending: Future | None = None, error: BaseException | None = None) -> None:
        """Wait for the write in the background, if any, then publish (:func:`_publish`)."""
        try:
            if pending is not None:
                pending.result()
        except Exception as e:
            error = e
        _publish(self, error)

    def done(self, error: BaseException | None = None) -> SaveHandle:
        """The handle of a save whose files are written (or that failed with ``error``), published already."""
        handle = SaveHandle(self.final, lambda: self.finish(None, error))
        handle.wait()
        return handle

    def later(self, pending: Future) -> SaveHandle:
        """The handle of an async save: ``wait()`` waits for ``pending``, then publishes."""
        return SaveHandle(self.final, lambda: self.finish(pending))


def _write(job: _Save, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, side: dict[str, Any], *,
           async_save: bool, hf_assets: str | os.PathLike | None) -> SaveHandle:
    """Every rank writes its part of ``job``'s form into the staging directory; the handle publishes."""
    rank = _rank_world()[0]
    if job.form == "local":
        # ShardedTensors cannot be staged by copying (see the sharded form): the files are written now.
        _write_local(model, optimizer, side, job.staging.path, rank, job.recorder)
        return job.done()
    full = job.form in ("full", "hf")
    # Offload only from an accelerator: FSDP1's CPU offload of CPU parameters crashes (torch 2.13, SIGSEGV).
    on_device = any(p.device.type != "cpu" for p in model.parameters())
    options = StateDictOptions(full_state_dict=full, cpu_offload=full and on_device)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=options)
    state: dict[str, Any] = {"model": msd, **({"optim": osd} if optimizer is not None else {}), **side}
    if job.form == "sharded":
        return _write_sharded(job, state, async_save=async_save)
    snapshot = _cpu_copy(state) if rank == 0 else {}
    if async_save:
        # No ``with`` block: leaving one calls shutdown(wait=True), which would wait for the write right here.
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptkit-save")
        pending = pool.submit(_write_snapshot, job, snapshot, rank, hf_assets)
        pool.shutdown(wait=False)  # the thread ends with the write; the handle's wait() collects its outcome
        return job.later(pending)
    _write_snapshot(job, snapshot, rank, hf_assets)
    return job.done()


def _write_sharded(job: _Save, state: dict[str, Any], *, async_save: bool) -> SaveHandle:
    """A DCP save of ``state`` by every rank, recording checksums as it writes; async where torch can stage it."""
    writer = checksums.checksum_writer(job.staging.path, job.recorder)
    # torch's async stager cannot copy FSDP1's ShardedTensors (torch 2.13): those save synchronously.
    sharded_tensors = any(type(v).__name__ == "ShardedTensor" for v in state["model"].values())
    if async_save and not sharded_tensors:
        if job.group is None:
            _quiet_async_single_process()
        with single_process_quiet():
            response = dcp.async_save(state, storage_writer=writer, process_group=job.group)
        # An AsyncSaveResponse comes back only from a stager that stages in the background.
        future = response if isinstance(response, Future) else response.upload_completion
        return job.later(future)
    with single_process_quiet():
        dcp.save(state, storage_writer=writer)
    return job.done()


def _write_snapshot(job: _Save, snapshot: dict[str, Any], rank: int, hf_assets: str | os.PathLike | None) -> None:
    """Rank 0 writes the full state ``snapshot`` (a CPU copy): one ``torch.save`` file, or HF safetensors with
    the training state beside them; other ranks write nothing."""
    if rank != 0:
        return
    if job.form == "full":
        for p, leaf in flatten(snapshot, lambda v: isinstance(v, torch.Tensor)):
            if isinstance(leaf, torch.Tensor):
                job.recorder.tensor(key_of(p), leaf)
        torch.save(snapshot, job.staging.path / FULL_FILE)
    else:
        for key, t in snapshot["model"].items():
            job.recorder.tensor(key, t)
        _write_hf(snapshot["model"], job.staging.path, hf_assets)
        training = {k: v for k, v in snapshot.items() if k != "model"}
        if training:  # safetensors holds weights only: the rest goes beside them, for load() to resume
            # Rank 0 writes the whole of it alone (no_dist), which torch would warn "assumes a single process".
            with single_process_quiet():
                dcp.save(training, checkpoint_id=str(job.staging.path / TRAINING_STATE), no_dist=True)


def _publish(job: _Save, error: BaseException | None) -> None:
    """After every rank has written: rank 0 writes ckptkit.json, publishes, then rotates; every rank raises if
    any rank failed, and the staging directory goes."""
    rank, world = _rank_world()
    merged = job.recorder
    if _distributed():
        every: list[Any] = [None] * world
        dist.all_gather_object(every, None if error is not None else job.recorder, group=job.group)
        merged = Recorder()
        for r in every:
            if r is not None:
                merged.merge(r)
        failed = any(r is None for r in every)
    else:
        failed = error is not None
    if rank == 0 and not failed:
        try:
            if job.form == "hf":
                merged.keep_only(set(detect(job.staging.path).read(job.staging.path).keys))
            save_number = rotation.next_save(job.root) if job.step is not None else 1
            checksums.write_record(job.staging.path, merged, form=job.form, world_size=world, step=job.step,
                                   save=save_number)
            job.staging.commit(replace=True, marker=rotation.marker_text(save=save_number, step=job.step))
            if job.step is not None:
                rotation.point_latest(job.root, job.final)
                max_bytes = int(job.max_total_gb * 1e9) if job.max_total_gb is not None else None
                rotation.rotate(job.root, keep=job.final, keep_last=job.keep_last, max_total_bytes=max_bytes)
        except Exception as e:
            error = e
    if rank == 0 and (failed or error is not None):
        job.staging.abort()
    _outcome(error, job.group)


def _write_local(model: torch.nn.Module, optimizer: Any, side: dict[str, Any], stage: Path, rank: int,
                 recorder: Recorder) -> None:
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
    recorder.leaves(f"rank{rank}.pt", {**state, **side})
    torch.save({**state, **side}, stage / f"rank{rank}.pt")
    if rank == 0:
        (stage / LAYOUT_FILE).write_bytes(layout_of(model).to_json())


def _write_hf(model_sd: dict[str, torch.Tensor], stage: Path, hf_assets: str | os.PathLike | None) -> None:
    from huggingface_hub import save_torch_state_dict

    # save_torch_state_dict keeps one name for tensors that share storage (a tied lm_head), as
    # save_pretrained does; load() restores the alias from the model's own tying.
    save_torch_state_dict(model_sd, stage)
    if hf_assets is not None:
        from ..ops.assets import find_assets

        for rel, f in find_assets(Path(hf_assets)).files:
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, stage / rel)

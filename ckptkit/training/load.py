"""``ckptkit.load``: a checkpoint of any form, saved at any world size, into the model at hand, on every rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..core.dtypes import by_name
from ..core.manifest import Format, Manifest, ObjectEntry, TensorEntry, map_tensor_refs
from ..core.plan import Region
from ..core.tree import unflatten
from ..errors import UsageError
from ..formats import detect, object_value, run_directory
from ..formats._accelerate import PARTS, is_save_state, trainer_step
from ..formats.deepspeed import DeepSpeedIO, tag_directory
from ..io.execute import gloo_group
from ..io.sources import Files, read_region
from ..models.quantized import as_values_against
from ..models.wrappers import strip_wrapper_names
from ..ops import checksums
from ..ops._step import optimizer_step, recorded_step
from ..ops.select import ModelSelection, optimizer_sections, select_model
from .fsdp1_offload import settle_offloaded_fsdp1
from .save import SIDE_KEYS, TRAINING_STATE, local_path, single_process_quiet

__all__ = ["LoadResult", "load"]


@dataclass(frozen=True)
class LoadResult:
    """What :func:`ckptkit.load` returns."""

    path: Path
    """The checkpoint directory that was loaded (``latest`` resolved)."""
    step: int | None
    extra_state: Any
    optimizer_loaded: bool = False
    """Whether optimizer state was loaded (an HF folder or a model-only checkpoint has none)."""


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
         load_scheduler: bool = True, verify_checksums: bool = True) -> LoadResult:
    """Load a checkpoint of any form, saved at any world size, into ``model`` (+ optimizer, scheduler).

    ``path`` may be a run directory: ``latest`` (or the most recent complete save) is used, after recovering
    from a save killed at any point. The model part is found by the rule :func:`ckptkit.export_hf` uses
    (:mod:`ckptkit.ops.select`), so a plain ``model.state_dict()`` file, an HF folder and other frameworks'
    checkpoints load too. Optimizer state is loaded when the checkpoint has some (``optim``, ``optimizer``,
    ``optimizer_0`` ...) keyed by the model's parameter names; ``LoadResult.optimizer_loaded`` says whether it
    was. Returns the step and ``extra_state`` that were saved. Call on every rank.

    With ``verify_checksums`` (the default), every tensor is checked against the CRC-32s ``ckptkit.save``
    recorded in ``ckptkit.json`` (each rank checks a share) and a mismatch raises :class:`ChecksumError`
    naming the file and key.

    Into FSDP1 with ``CPUOffload(offload_params=True)``, the flat parameters are first settled on the
    pinned shards they train from (:func:`ckptkit.training.fsdp1_offload.settle_offloaded_fsdp1`), without
    which torch's own loaders resume off the trajectory (pending confirmation on a GPU).

    Raises :class:`ckptkit.CheckpointError` listing the keys when, under ``strict``, the model needs keys the
    checkpoint lacks or the checkpoint holds model keys the model does not have, or the optimizer state
    present does not fit the optimizer; and, given an optimizer, when the checkpoint holds no optimizer state,
    so that training never goes on from a fresh optimizer unnoticed.

    Args:
        path: A checkpoint directory or file, or a run directory whose ``latest`` names the step.
        model: The model to load into: a plain module, DDP, FSDP1 or FSDP2, at any world size.
        optimizer: Its optimizer, loaded when the checkpoint holds optimizer state.
        scheduler: An object with ``load_state_dict()``, loaded from a ``scheduler`` entry.
        strict: Refuse model keys that do not match, and optimizer state that is missing or does not fit.
        load_optimizer: Load the optimizer state; False leaves ``optimizer`` as it is.
        load_scheduler: Load the scheduler state.
        verify_checksums: Check every tensor against the checksums ``ckptkit.json`` recorded.

    Returns:
        The directory loaded, the saved step and ``extra_state``, and whether optimizer state was loaded.

    Raises:
        CheckpointError: Under ``strict``, the keys do not match, or ``optimizer`` is given and the checkpoint
            holds no optimizer state or state that does not fit.
        FormatError: ``latest`` names no step directory of the run, or a file is not what its format says.
        ChecksumError: A tensor's bytes differ from the checksum recorded when it was saved.
        UsageError: ``path`` is a URL.
    """
    ckpt = _resolve(local_path(path, "ckptkit.load"))
    manifest = detect(ckpt).read(ckpt)  # once: for DCP this reads every chunk's header
    if verify_checksums:
        checksums.verify_on_every_rank(ckpt, manifest, gloo_group())
    # First: an FSDP1 model offloading its parameters is settled before any load (see fsdp1_offload).
    settle_offloaded_fsdp1(model)
    # An HF folder's top-level keys are weights: its training state, if any, is the DCP saved beside them.
    training = _training_state(ckpt) if manifest.format is Format.HF else manifest
    side = _read_all(training, SIDE_KEYS) if training is not None else {}
    optimizer_loaded = _load_state(ckpt, manifest, training, model, optimizer if load_optimizer else None, strict)
    if scheduler is not None and load_scheduler and "scheduler" in side:
        scheduler.load_state_dict(side["scheduler"])
    step = side["step"] if "step" in side else _saved_step(ckpt, manifest, training)
    return LoadResult(ckpt, step, side.get("extra"), optimizer_loaded)


def _load_state(ckpt: Path, manifest: Manifest, training: Manifest | None, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer | None, strict: bool) -> bool:
    """Set the model's state from ``manifest``, and the optimizer's (unless None) from ``training`` where it
    holds optimizer state that fits; returns whether it did."""
    fmt = manifest.format
    msd, optim_state = get_state_dict(model, optimizer if optimizer is not None else [])
    osd: dict[str, Any] = dict(optim_state)  # {"state": {param name: {slot: value}}, "param_groups": [...]}
    sel = select_model(manifest)
    model_src = _model_sources(manifest, sel, model, msd, strict)
    optim_src = (_optimizer_sources(training, sel, osd, strict)
                 if optimizer is not None and training is not None else None)
    if optimizer is not None and optim_src is None and strict:
        held = f"{len(sel.tensors)} model tensors" + (f"; beside them {'; '.join(sel.left_out)}" if sel.left_out
                                                       else ", nothing else")
        raise UsageError(f"{ckpt}: holds no optimizer state for the model ({held}); pass load_optimizer=False "
                         "(or no optimizer) to load the weights alone")
    with Files() as files:
        if fmt is Format.SHARDED:
            # DCP reads each rank's part of every tensor into the tensors get_state_dict gave, keyed as saved.
            saved_key = dict(sel.saved_keys)
            target = {saved_key[e.key]: msd[n] for n, e in model_src.items()}
            if optim_src is not None:
                target.update({e.key: osd["state"][n][slot] for n, slots in optim_src.state.items()
                               for slot, e in slots.items() if isinstance(e, TensorEntry)})
            with single_process_quiet():
                for directory, keys in _dcp_parts(ckpt, target):
                    dcp.load(keys, checkpoint_id=str(directory))
            model_sd = {n: msd[n] for n in model_src}
            options = StateDictOptions(strict=strict)
        else:
            model_sd = {n: _tensor(e, files) for n, e in model_src.items()}
            options = StateDictOptions(full_state_dict=True, strict=strict)
        optim_sd = _optimizer_state(optim_src, osd, files, fmt is Format.SHARDED) if optim_src else {}
    optimizers = [optimizer] if optimizer is not None and optim_src is not None else []
    set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    return optim_src is not None


def _dcp_parts(ckpt: Path, target: dict[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
    """Each DCP checkpoint of ``ckpt`` with the keys of ``target`` it holds: an accelerate ``save_state``
    directory keeps the model and the optimizer in one each (:mod:`ckptkit.formats._accelerate`)."""
    if not is_save_state(ckpt):
        return [(ckpt, target)]
    parts = [(ckpt / d, {k: v for k, v in target.items() if k.split(".", 1)[0] == g}) for g, d in PARTS]
    return [(d, keys) for d, keys in parts if keys]


def _training_state(ckpt: Path) -> Manifest | None:
    """The training state a ``form="hf"`` save wrote beside the weights, if there is one."""
    directory = ckpt / TRAINING_STATE
    return detect(directory).read(directory) if directory.is_dir() else None


def _saved_step(ckpt: Path, manifest: Manifest, training: Manifest | None) -> int | None:
    """The step a checkpoint that holds no ``step`` of ckptkit's own records: another framework's
    (:func:`ckptkit.ops._step.recorded_step`: torchtitan's ``train_state``, megatron-core's ``iteration``,
    DeepSpeed's ``global_steps``, ...), the HF Trainer's ``global_step``, the one ``ckptkit.save`` recorded in
    ``ckptkit.json``, or else the optimizer's own step."""
    found = recorded_step(manifest) or (recorded_step(training) if training is not None else None)
    if found is not None:
        return found.value
    trainer = trainer_step(ckpt)
    if trainer is not None:
        return trainer
    record = checksums.read_record(ckpt)
    if record is not None and record.step is not None:
        return record.step
    found = optimizer_step(training) if training is not None else None
    return found.value if found is not None else None


def _resolve(path: Path) -> Path:
    """``path`` or the step its ``latest`` names, once a save killed midway has been recovered from (every rank
    recovers what its host left; the barrier keeps any rank from resolving before the owner's host has); a
    DeepSpeed save directory's tag, as its own ``latest`` names it."""
    if path.is_dir() and DeepSpeedIO.detect(path):  # DeepSpeed's own latest names its tag (global_stepN)
        return tag_directory(path)
    run_directory.recover_run(path)
    group = gloo_group()
    if group is not None:
        torch.distributed.barrier(group=group)
    return run_directory.resolve(path)


def _as_values(manifest: Manifest, tensors: tuple[TensorEntry, ...], msd: dict[str, Any]) -> dict[str, TensorEntry]:
    """The model's tensors by key, each FP8 or MXFP4 weight that the model holds in a floating dtype read as its
    values in that dtype, its scales left out (:func:`ckptkit.models.quantized.as_values_against`), as
    transformers' ``from_pretrained`` dequantizes a release: never float8 codes copied as if they were values."""
    side = {t.key: t for t in tensors}
    model = {n: TensorEntry(n, (n,), by_name(str(v.dtype).removeprefix("torch.")), tuple(v.shape), ())
             for n, v in msd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    values, n = as_values_against(side, model, numeric=False)
    if n and manifest.format is Format.SHARDED:
        raise UsageError(f"{manifest.root}: {n} FP8 or MXFP4 weights with their scales, which the model holds as "
                         "values: a DCP is loaded as it is; write it with its values first (ckptkit convert SRC DST "
                         "--to sharded --dtype bf16)")
    return values


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


def _listing(names: list[str]) -> str:
    return ", ".join(names[:10]) + (" ..." if len(names) > 10 else "")


def _model_sources(manifest: Manifest, sel: ModelSelection, model: torch.nn.Module, msd: dict[str, Any],
                   strict: bool) -> dict[str, TensorEntry]:
    """The checkpoint entry for each key of the model's state dict; under ``strict``, every key must have
    one and every model key of the checkpoint must be used, else the error lists them all."""
    values = _as_values(manifest, sel.tensors, msd)
    have = _with_tied_aliases(model, values)
    missing = [n for n in msd if n not in have]
    unexpected = [k for k in values if k not in msd]
    if strict and (missing or unexpected):
        problems = [f"checkpoint lacks {len(missing)} keys the model needs: {_listing(missing)}"] if missing else []
        problems += [f"it holds {len(unexpected)} model keys the model does not have: {_listing(unexpected)}"
                     ] if unexpected else []
        raise UsageError(f"{manifest.root}: " + "; ".join(problems) + f" ({sel.rule}; pass strict=False to skip "
                         "them)")
    found = {n: have[n] for n in msd if n in have}
    if not found:
        raise UsageError(f"{manifest.root}: none of its {len(sel.tensors)} model keys ({_listing(list(have))}) "
                         f"is a key of the model ({_listing(list(msd))}); {sel.rule}")
    return found


@dataclass(frozen=True)
class _OptimizerSources:
    """Where the optimizer's state lies in the checkpoint, by the model's parameter names."""

    state: dict[str, dict[str, TensorEntry | ObjectEntry]]
    """Parameter name to slot (``exp_avg``, ``step`` ...) to entry."""
    groups: list[dict[str, ObjectEntry]] | None
    """Each param group's hyperparameters (``params`` aside), in the optimizer's group order; None keeps the
    optimizer's own."""


def _optimizer_sources(manifest: Manifest, sel: ModelSelection, osd: dict[str, Any],
                       strict: bool) -> _OptimizerSources | None:
    """The optimizer state in the checkpoint that fits ``osd`` (``get_state_dict``'s, keyed by parameter name);
    None when there is none, or (not ``strict``) when it does not fit."""
    sections = optimizer_sections(manifest)
    if not sections:
        return None
    section = sections[0]
    state: dict[str, dict[str, TensorEntry | ObjectEntry]] = {}
    numbered: dict[int, dict[str, ObjectEntry]] = {}
    by_param: dict[str, dict[str, ObjectEntry]] = {}  # torchtitan flattens param groups per parameter
    for e in manifest.entries:
        rest = e.key[len(section) + 1:] if e.key.startswith(section + ".") else ""
        if rest.startswith("state.") and "." in rest[6:]:
            fqn, slot = rest[6:].rsplit(".", 1)
            state.setdefault(fqn, {})[slot] = e
        elif rest.startswith("param_groups.") and "." in rest[13:] and isinstance(e, ObjectEntry):
            head, field = rest[13:].rsplit(".", 1)
            (numbered.setdefault(int(head), {}) if head.isdigit() else by_param.setdefault(head, {}))[field] = e
    saved_as = dict(sel.sources)
    missing = [f"{section}.state.{saved_as.get(n, n)}.{slot}" for n, slots in osd["state"].items()
               for slot in slots if slot not in state.get(saved_as.get(n, n), {})]
    groups: list[dict[str, ObjectEntry]] | None = None
    if numbered:
        groups = [numbered[i] for i in sorted(numbered)]
        if len(groups) != len(osd["param_groups"]):
            missing.append(f"{section}.param_groups: {len(groups)} saved, the optimizer has {len(osd['param_groups'])}")
    elif by_param:
        firsts = [saved_as.get(g["params"][0], g["params"][0]) for g in osd["param_groups"] if g["params"]]
        missing += [f"{section}.param_groups.{p}" for p in firsts if p not in by_param]
        groups = [by_param.get(p, {}) for p in firsts]
    if missing:
        if strict:
            raise UsageError(f"{manifest.root}: the optimizer state in {section!r} does not fit the optimizer: it "
                             f"lacks {len(missing)} entries: {_listing(missing)} (pass load_optimizer=False, or "
                             "strict=False to load the model alone)")
        return None
    return _OptimizerSources({n: state[saved_as.get(n, n)] for n in osd["state"]},
                             [{k: v for k, v in g.items() if k != "params"} for g in groups] if groups else None)


def _optimizer_state(src: _OptimizerSources, osd: dict[str, Any], files: Files, loaded: bool) -> dict[str, Any]:
    """``osd`` with the saved values: tensors read here, or (``loaded``) already read into ``osd`` by DCP."""
    def value(n: str, slot: str, e: TensorEntry | ObjectEntry) -> Any:
        if isinstance(e, TensorEntry):
            return osd["state"][n][slot] if loaded else _tensor(e, files)
        return _to_torch(object_value(e), files)

    state = {n: {slot: value(n, slot, e) for slot, e in slots.items() if slot in osd["state"][n]}
             for n, slots in src.state.items()}
    # Saved hyperparameters the optimizer has (a scheduler made before the save adds initial_lr; torch's
    # full-state path refuses keys the optimizer's own groups lack); params stay the optimizer's own names.
    groups = osd["param_groups"] if src.groups is None else [
        {**own, **{k: _to_torch(object_value(e), files) for k, e in saved.items() if k in own}, "params": own["params"]}
        for saved, own in zip(src.groups, osd["param_groups"], strict=True)]
    return {"state": state, "param_groups": groups}

"""``ckptkit.load``: a checkpoint of any form, saved at any world size, into the model at hand, on every rank."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..core.manifest import Format, Manifest, Path_, TensorEntry, map_tensor_refs
from ..core.plan import Region
from ..core.tree import flatten, unflatten
from ..errors import UsageError
from ..formats import detect, object_value
from ..io import publish as rotation
from ..io.sources import Files, read_region
from ..ops import checksums
from ..ops.names import strip_wrapper_names
from .save import SIDE_KEYS, gloo_group

__all__ = ["LoadResult", "load"]


@dataclass(frozen=True)
class LoadResult:
    path: Path
    """The checkpoint directory that was loaded (``latest`` resolved)."""
    step: int | None
    extra_state: Any


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
    from a save killed at any point. Returns the step and ``extra_state`` that were saved. Call on every rank.
    With ``verify_checksums`` (the default), every tensor is checked against the CRC-32s ``ckptkit.save``
    recorded in ``ckptkit.json`` (each rank checks a share) and a mismatch raises :class:`ChecksumError`
    naming the file and key.
    """
    ckpt = _resolve(Path(path))
    manifest = detect(ckpt).read(ckpt)  # once: for DCP this reads every chunk's header
    if verify_checksums:
        checksums.verify_on_every_rank(ckpt, manifest, gloo_group())
    fmt = manifest.format
    optimizer = optimizer if load_optimizer else None
    side = _read_all(manifest, SIDE_KEYS) if fmt is not Format.HF else {}
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
        state = {"model": _read_all(manifest, None)} if fmt is Format.HF else _read_all(manifest, ("model", "optim"))
        model_sd = _with_tied_aliases(model, state.get("model", {}))
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=model_sd,
                       optim_state_dict=state.get("optim", {}) if optimizer is not None else {}, options=options)
    if scheduler is not None and load_scheduler and "scheduler" in side:
        scheduler.load_state_dict(side["scheduler"])
    return LoadResult(ckpt, side.get("step"), side.get("extra"))


def _resolve(path: Path) -> Path:
    """``path`` or the step its ``latest`` names, once a save killed midway has been recovered from (every rank
    recovers what its host left; the barrier keeps any rank from resolving before the owner's host has)."""
    for directory in (path.parent, path):
        with contextlib.suppress(OSError):  # a read-only checkpoint: nothing to recover, or nothing we may
            rotation.recover(directory)
    group = gloo_group()
    if group is not None:
        torch.distributed.barrier(group=group)
    return rotation.resolve(path)


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
    missing: list[Path_] = []
    for path, _ in flatten(target, lambda v: isinstance(v, torch.Tensor)):
        name = ".".join(map(str, path))
        if name not in have and not any(key.startswith(name + ".") for key in have):
            missing.append(path)
    if missing and strict:
        names = [".".join(map(str, p)) for p in missing]
        raise UsageError(f"{manifest.root}: checkpoint lacks {len(names)} keys the model/optimizer needs: "
                         f"{', '.join(names[:10])}{' ...' if len(names) > 10 else ''} (pass strict=False to skip them)")
    for path in missing:
        node = target
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]

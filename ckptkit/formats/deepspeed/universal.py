"""DEEPSPEED_UNIVERSAL: DeepSpeed's universal checkpoint, read and written without torch.

The layout DeepSpeed 0.19's ``ds_to_universal`` writes (``deepspeed/checkpoint/ds_to_universal.py``), and which its
engine loads at any ZeRO stage and data-parallel size with ``"checkpoint": {"load_universal": true}``::

    SAVE_DIR/latest_universal                       the tag, e.g. "global_step3"
    SAVE_DIR/<tag>/mp_rank_00_model_states.pt       the engine's own state (global_steps, ...) for ZeRO 1 and 2
    SAVE_DIR/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt     the same, under the name ZeRO-3 looks for
    SAVE_DIR/<tag>/zero/optimizer_state.pt          the optimizer's param groups (hyperparameters)
    SAVE_DIR/<tag>/zero/<param>/fp32.pt             {"param": the fp32 master weight, "cat_dim": 0}
    SAVE_DIR/<tag>/zero/<param>/exp_avg.pt          {"param": Adam's first moment, "cat_dim": 0}
    SAVE_DIR/<tag>/zero/<param>/exp_avg_sq.pt       {"param": Adam's second moment, "cat_dim": 0}
    SAVE_DIR/<tag>/zero/<param>/step.pt             the optimizer's step (a 0-d tensor, not a dict)

Each parameter is whole, under the name the engine's module gives it, so writing one from any checkpoint with
per-parameter Adam state is a copy of byte ranges: a parameter's moments are its optimizer entries
(``optim.state.<name>.exp_avg``). What DeepSpeed's loader reads (``checkpoint/universal_checkpoint.py``
``load_hp_checkpoint_state``; ``runtime/base_optimizer.py`` and ``zero/stage3.py``): ``param`` of each file and the
step file, for every parameter its optimizer holds; from ``optimizer_state.pt``, ``ds_version`` and
``param_groups`` (ZeRO 1 and 2; their hyperparameters replace the engine's) and ``optimizer_state_dict``'s
``param_groups`` and first ``step`` (ZeRO-3); from the model states, ``global_steps``, ``skipped_steps``,
``dp_world_size`` and ``mp_world_size``. Loss scaling and gradient clipping are left to the engine's config (a
checkpoint DeepSpeed wrote carries its own ``clip_grad``). Buffers and parameters without optimizer state are
kept in the model states' ``module``, which a universal load does not read: the engine keeps its own.

Read back as ``model.<param>`` (fp32), ``optim.state.<param>.{exp_avg,exp_avg_sq,step}`` and
``optim.param_groups``, as torch's ``get_state_dict`` names them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...codecs.torchzip_read import read_archive
from ...codecs.torchzip_write import PartsTensor, archive_parts
from ...core.dtypes import by_name
from ...core.manifest import Format, Manifest, ObjectEntry, TensorEntry, TensorRef
from ...core.plan import Bytes, FilePlan, Region, WritePlan
from ...core.tree import ListIndex
from ...errors import FormatError, IncompleteCheckpointError, UsageError
from ..base import FormatIO, FormatOptions, Target, object_value, plain_object
from .universal_source import Source, read_step, source_of
from .zero import _GLOBALS, read_tag

__all__ = ["DeepSpeedUniversalIO", "UniversalOptions"]

LATEST = "latest_universal"
_ZERO = "zero"
_OPTIMIZER = "optimizer_state.pt"
_MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_SLOTS = ("exp_avg", "exp_avg_sq")
_VERSION = "0.19.8"
"""The DeepSpeed release whose loader this layout is written for (its ``ds_version`` check wants one)."""
_FLOAT32 = by_name("float32")


@dataclass(frozen=True, kw_only=True, slots=True)
class UniversalOptions(FormatOptions):
    step: int
    """The optimizer's step: the engine's ``global_steps``, and the tag ``global_step<step>``."""
    dp_world_size: int = 1
    """The source's data-parallel size, recorded as DeepSpeed records it (a universal load ignores it)."""


def _is_tag(path: Path) -> bool:
    return (path / _ZERO / _OPTIMIZER).is_file() and any((path / n).is_file() for n in _MODEL_FILES)


class DeepSpeedUniversalIO(FormatIO):
    format = Format.DEEPSPEED_UNIVERSAL
    names = ("deepspeed-universal",)

    @classmethod
    def detect(cls, path: Path) -> bool:
        # A save directory that also has DeepSpeed's own `latest` is the ZeRO checkpoint that names.
        return path.is_dir() and (_is_tag(path) or ((path / LATEST).is_file() and not (path / "latest").exists()))

    def read(self, path: Path) -> Manifest:
        return _read(_tag_dir(path.absolute()))

    def options(self, target: Target, manifest: Manifest) -> UniversalOptions:
        return UniversalOptions(step=read_step(source_of(manifest)), dp_world_size=manifest.world_size or 1)

    def not_held(self, manifest: Manifest) -> tuple[str, ...]:
        src = source_of(manifest)
        notes = [f"{len(src.others)} model tensors without optimizer state (buffers, frozen or tied parameters: "
                 f"{', '.join(src.others[:3])}) kept in the model states' module, which DeepSpeed's universal load "
                 "does not read: the engine keeps its own"] if src.others else []
        if len(src.groups) > 1:
            firsts = ", ".join(names[0] for _, names in src.groups if names)
            notes.append(f"{len(src.groups)} param groups, whose first parameters are {firsts}: DeepSpeed's load gives "
                         "their hyperparameters to the engine's groups by position, so build those in this order; "
                         "under ZeRO-3 its load gives the first group's to every group and one step tensor to all, so "
                         "set the others' and copy the step after it")
        if src.left_out:
            notes.append("left out: " + ", ".join(src.left_out) + " (a universal checkpoint holds the model and "
                         "the optimizer; gradient clipping and loss scaling come from the engine's config)")
        return tuple(notes)

    def plan(self, manifest: Manifest, options: UniversalOptions) -> WritePlan:
        if options.cast is not None and options.cast != _FLOAT32:
            raise UsageError(f"a universal checkpoint holds fp32 masters and moments; cannot cast to {options.cast}")
        return _plan(source_of(manifest), options)


# --------------------------------------------------------------------------------------------------------
# Writing


def _fp32(entry: TensorEntry) -> Region:
    if not entry.dtype.is_floating:
        raise FormatError(f"{entry.key!r}: a {entry.dtype} tensor; a universal checkpoint holds fp32 state")
    return Region.whole(entry, None if entry.dtype == _FLOAT32 else _FLOAT32)


def _step_value(src: Source, name: str) -> Region | PartsTensor:
    """Parameter ``name``'s step as DeepSpeed's loader takes it: a 0-d tensor, which torch's Adam wants of every
    parameter's ``step`` (a source that keeps it as a number, megatron-core's param groups, gets a float32 one)."""
    step = src.steps[name]
    if isinstance(step, TensorEntry):
        return Region.whole(step)
    value = object_value(step)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FormatError(f"{step.key}: the step is {value!r:.40}; a universal checkpoint holds a number")
    return PartsTensor(_FLOAT32, (Bytes(struct.pack("<f", value)),), shape=())


def _plan(src: Source, options: UniversalOptions) -> WritePlan:
    tag = f"global_step{options.step}"
    files = []
    for name, weight in src.weights.items():
        base = f"{tag}/{_ZERO}/{name}"
        files.append(FilePlan(f"{base}/fp32.pt", archive_parts({"cat_dim": 0, "param": _fp32(weight)})))
        for slot in _SLOTS:
            files.append(FilePlan(f"{base}/{slot}.pt", archive_parts({"cat_dim": 0,
                                                                      "param": _fp32(src.moments[name][slot])})))
        files.append(FilePlan(f"{base}/step.pt", archive_parts(_step_value(src, name))))
    first = next(iter(src.weights))
    groups = [{**g, "params": names} for g, names in src.groups]
    optimizer = {"ds_version": _VERSION, "param_groups": groups,
                 "optimizer_state_dict": {"state": {0: {"step": _step_value(src, first)}}, "param_groups": groups}}
    files.append(FilePlan(f"{tag}/{_ZERO}/{_OPTIMIZER}", archive_parts(optimizer)))
    states = {"module": {n: Region.whole(t) for n, t in src.other_tensors.items()},
              "buffer_names": list(src.others), "optimizer": None, "lr_scheduler": None, "global_steps": options.step,
              "skipped_steps": 0, "dp_world_size": options.dp_world_size, "mp_world_size": 1,
              "ds_version": _VERSION}
    files += [FilePlan(f"{tag}/{n}", archive_parts(states)) for n in _MODEL_FILES]
    files.append(FilePlan(LATEST, (Bytes(tag.encode()),)))
    return WritePlan(tuple(files), commit=LATEST)


# --------------------------------------------------------------------------------------------------------
# Reading


def _tag_dir(path: Path) -> Path:
    """The tag directory: ``path`` itself, or the one its ``latest_universal`` names."""
    if _is_tag(path):
        return path
    latest = path / LATEST
    if not latest.is_file():
        raise FormatError(f"{path}: no {LATEST} file and no zero/{_OPTIMIZER}: not a universal checkpoint")
    tag = read_tag(latest)
    if not _is_tag(path / tag):
        raise IncompleteCheckpointError(f"{latest}: names tag {tag!r}, but {path / tag} holds no zero/{_OPTIMIZER} "
                                        "and mp_rank_00_model_states.pt")
    return path / tag


def _load(file: Path) -> Any:
    return read_archive(str(file), extra_globals=_GLOBALS)


def _dict(file: Path) -> dict:
    tree = _load(file)
    if not isinstance(tree, dict):
        raise FormatError(f"{file}: expected a dict, found {type(tree).__name__}")
    return tree


def _param(file: Path) -> TensorRef:
    tree = _dict(file)
    if not isinstance(tree.get("param"), TensorRef):
        raise FormatError(f"{file}: expected {{'param': tensor, ...}}, found keys {sorted(map(str, tree))[:6]}")
    return tree["param"]


def _read(tag: Path) -> Manifest:
    states = _dict(next(tag / n for n in _MODEL_FILES if (tag / n).is_file()))
    module: dict = states["module"] if isinstance(states.get("module"), dict) else {}
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    with_state = []
    for name in _in_order((p.name for p in (tag / _ZERO).iterdir() if p.is_dir()), states.get("param_shapes")):
        folder = tag / _ZERO / name
        has_state = all((folder / f"{s}.pt").is_file() for s in _SLOTS)
        if not has_state and isinstance(module.get(name), TensorRef):
            continue  # a buffer or frozen parameter ds_to_universal also wrote as fp32: its own dtype is in module
        if not (folder / "fp32.pt").is_file():
            raise IncompleteCheckpointError(f"{folder}: no fp32.pt, the parameter's weight")
        tensors.append(_param(folder / "fp32.pt").as_entry(("model", name)))
        if has_state:
            with_state.append(name)
            _optimizer_state(folder, name, tensors, objects)
    read = {e.path for e in tensors}
    tensors += [t.as_entry(("model", n)) for n, t in module.items()
                if isinstance(t, TensorRef) and ("model", n) not in read]
    objects += _groups(_dict(tag / _ZERO / _OPTIMIZER).get("param_groups"), with_state, tag)
    details = [("tag", tag.name), ("global_steps", str(states.get("global_steps"))),
               ("left out", "the engine's own state in the model states file (lr_scheduler, ds_config, ...)")]
    return Manifest(Format.DEEPSPEED_UNIVERSAL, str(tag), tuple(tensors), tuple(objects), None, tuple(details))


def _optimizer_state(folder: Path, name: str, tensors: list[TensorEntry], objects: list[ObjectEntry]) -> None:
    """Adds parameter ``name``'s moments and step, from ``folder``, as ``optim.state.<name>.*``."""
    tensors += [_param(folder / f"{s}.pt").as_entry(("optim", "state", name, s)) for s in _SLOTS]
    step = _load(folder / "step.pt") if (folder / "step.pt").is_file() else None
    path = ("optim", "state", name, "step")
    if isinstance(step, TensorRef):
        tensors.append(step.as_entry(path))
    elif isinstance(step, (int, float)):
        objects.append(ObjectEntry(f"optim.state.{name}.step", path, step))
    else:
        raise IncompleteCheckpointError(f"{folder}: no step.pt holding the optimizer's step (found "
                                        f"{type(step).__name__})")


def _in_order(names: Any, param_shapes: Any) -> list[str]:
    """The parameters in the engine's order where the model states record it (``param_shapes``, one dict per
    group, as DeepSpeed saves them), else by name."""
    known = [n for g in param_shapes for n in g] if isinstance(param_shapes, list) and all(
        isinstance(g, dict) for g in param_shapes) else []
    rank = {n: i for i, n in enumerate(known)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def _groups(groups: Any, names: list[str], tag: Path) -> list[ObjectEntry]:
    """``optim.param_groups``: DeepSpeed records each group's parameters by flat-group index; one group holds
    them all, and several are kept as they are (which parameter is in which is not recorded)."""
    where = str(tag / _ZERO / _OPTIMIZER)
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise FormatError(f"{where}: expected 'param_groups', a list of dicts, found {type(groups).__name__}")
    out = []
    for i, group in enumerate(groups):
        params = names if len(groups) == 1 and not all(isinstance(p, str) for p in group.get("params", [0])) \
            else group.get("params")
        for k, v in {**group, "params": params}.items():
            out.append(plain_object(("optim", "param_groups", ListIndex(i), k), v, where))
    return out

"""Optimizer state carried through a key mapping, so that a renamed checkpoint resumes with its optimizer.

Optimizer state names its parameters as the model's state dict does (torch's ``get_state_dict``): tensors
``<section>.state.<param>.<slot>`` and hyperparameters ``<section>.param_groups.<i>.<field>`` (its ``params``
field lists the parameters), or, flattened as torchtitan saves them, ``<section>.param_groups.<param>.<field>``.
Under a key mapping each part follows its parameter:

- an **element-wise** state tensor (the weight's shape: Adam's ``exp_avg``, ``exp_avg_sq``, an fp32 master
  copy) goes through the very mapping the weights go through, so it is renamed, split, joined, transposed
  and has its rotary q/k rows reordered exactly as its weight;
- a **scalar** state (``step``) and a parameter's hyperparameters are copied to each tensor its parameter
  becomes (a tensor joined from several takes the first one's);
- any other state tensor (Adafactor's factored rows, Shampoo's preconditioners) cannot follow a split or a
  row reorder, and is refused by name; so is state that names no parameter of the model (kept by index).

Each param group holds ``initial_lr``, which a torch LR scheduler adds to the groups of the optimizer it is
built on, and which the loads that match the saved groups' fields to the live ones want (torchtitan's
``load_flat_optim_state_dict``, ``set_state_dict`` of a flattened state dict): the group's own where it was
saved, else the base rate the source's scheduler kept (a torch scheduler's ``base_lrs``, megatron-core's
``max_lr``), else the group's ``lr``.

Written into torchtitan's names, the state takes torchtitan's own layout (``optimizer``, param groups
flattened per parameter), which its ``CheckpointManager`` loads, with the ``train_state`` and ``lr_scheduler``
it loads beside them (:mod:`._titan_state`); otherwise it keeps the source's. The rest of the training state
(scheduler, train state, dataloader, the step) is carried as saved. Pure planning: nothing is read but the
small ``params`` lists, the base rates and the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..core.manifest import Manifest, ObjectEntry, TensorEntry
from ..errors import UsageError
from ..formats import object_value
from ..models.completeness import listed
from ..models.mapping import MappedKeys
from ._titan_state import titan_train_state
from .select import ModelSelection, optimizer_sections, training_groups

__all__ = ["Carried", "Entry", "carry_training_state"]

Entry = TensorEntry | ObjectEntry
MapFn = Callable[[tuple[TensorEntry, ...]], MappedKeys]
"""The conversion's key mapping, applied to tensors named like the model's (selected) weights."""
TITAN_SECTION = "optimizer"
_STATE, _GROUPS = "state.", "param_groups."
_INITIAL_LR = "initial_lr"
_STEPS = ("step", "global_step")
"""Top-level values that record the training step (``ckptkit.save``'s, Lightning's), carried as training state."""


@dataclass(frozen=True)
class Carried:
    """The training state under the mapped names, and notes for the report."""

    entries: tuple[Entry, ...]
    groups: tuple[str, ...]
    """The source's top-level groups carried."""
    notes: tuple[str, ...]


@dataclass
class _Section:
    """One optimizer state dict of the checkpoint, by the parameter names it was saved under."""

    name: str
    state: dict[str, dict[str, Entry]] = dataclasses.field(default_factory=dict)
    per_param: dict[str, dict[str, Entry]] = dataclasses.field(default_factory=dict)
    numbered: dict[str, dict[str, Entry]] = dataclasses.field(default_factory=dict)
    other: list[Entry] = dataclasses.field(default_factory=list)


def _section(manifest: Manifest, name: str) -> _Section:
    sec = _Section(name)
    for e in manifest.entries:
        if not e.key.startswith(name + "."):
            continue
        rest = e.key[len(name) + 1:]
        if rest.startswith(_STATE) and "." in rest[len(_STATE):]:
            fqn, slot = rest[len(_STATE):].rsplit(".", 1)
            sec.state.setdefault(fqn, {})[slot] = e
        elif rest.startswith(_GROUPS) and "." in rest[len(_GROUPS):]:
            head, field = rest[len(_GROUPS):].rsplit(".", 1)
            (sec.numbered if head.isdigit() else sec.per_param).setdefault(head, {})[field] = e
        else:
            sec.other.append(e)
    return sec


def _moved(e: Entry, start: int, old: str, new: str) -> Entry:
    """``e`` with ``old`` at ``start`` of its key replaced by ``new``, its path following (``old`` is a
    parameter's name, so it lies within one element of the path: a dict key, or a flattened key)."""
    key = e.key[:start] + new + e.key[start + len(old):]
    path, offset = list(e.path), 0
    for i, part in enumerate(path):
        text = str(part)
        if offset <= start and start + len(old) <= offset + len(text):
            path[i] = text[:start - offset] + new + text[start - offset + len(old):]
            return dataclasses.replace(e, key=key, path=tuple(path))
        offset += len(text) + 1
    return dataclasses.replace(e, key=key, path=(key,))


def _placed(e: Entry, section: str, tail: str) -> Entry:
    """``e`` as torchtitan's flattened optimizer state keeps it: ``optimizer`` / ``<tail>``."""
    return dataclasses.replace(e, key=f"{section}.{tail}", path=(section, tail))


class _Outputs:
    """Which output tensors each of the model's parameters (by its name in the checkpoint) became."""

    def __init__(self, sel: ModelSelection, model: MappedKeys) -> None:
        self.selected = {within: new for new, within in sel.sources}
        for new, _ in sel.sources:  # state saved under the names with wrappers stripped (get_state_dict's)
            self.selected.setdefault(new, new)
        origin = {new: old for old, new in model.renamed}
        self.of: dict[str, list[str]] = {}
        for t in model.tensors:
            self.of.setdefault(origin.get(t.key, t.key), []).append(t.key)
        self.weights = {t.key: t for t in sel.tensors}

    def outputs(self, fqn: str) -> list[str]:
        return self.of.get(self.selected[fqn], [])


def carry_training_state(manifest: Manifest, sel: ModelSelection, model: MappedKeys, map_fn: MapFn,
                         into_titan: bool) -> Carried:
    """The training state of ``manifest`` for an output whose model part is ``model`` (``sel`` mapped by
    ``map_fn``): optimizer state mapped as the module docstring says, the other training state as saved.

    Raises:
        UsageError: optimizer state that names no parameter of the model, or a state tensor that is neither
            element-wise nor a scalar.
    """
    outs = _Outputs(sel, model)
    names = optimizer_sections(manifest)
    titan = TITAN_SECTION if into_titan and len(names) == 1 else None
    base_lrs = _base_lrs(manifest)
    entries: list[Entry] = []
    notes: list[str] = []
    for name in names:
        sec = _section(manifest, name)
        carried = (_state(manifest, sec, outs, map_fn, titan) + _groups(sec, outs, titan, base_lrs)
                   + tuple(sec.other))
        entries += carried
        notes.append(f"optimizer {name!r} carried under the mapped names" + (
            f", as torchtitan keeps it ({titan!r}, param groups per parameter)" if titan else "") +
            f": {len(sec.state)} parameters' state ({', '.join(sorted({s for v in sec.state.values() for s in v}))})")
    tops = {n.split(".", 1)[0] for n in names}
    unread = [g for g in training_groups(manifest, optimizer=True) if g not in tops]
    if unread:
        raise UsageError(f"{manifest.root}: optimizer state {listed(unread)} is not laid out as "
                         "state.<parameter>.<slot>, so a key mapping cannot carry it; convert the model alone with "
                         "--to hf")
    steps = [g for g in _STEPS if any(o.path == (g,) for o in manifest.objects)]
    rest = [g for g in training_groups(manifest) if g not in tops] + steps
    entries += [e for e in manifest.entries if str(e.path[0]) in rest]
    if rest:
        notes.append(f"training state carried as saved: {', '.join(rest)}")
    if titan:
        added, said = titan_train_state(manifest, rest)
        entries += added
        notes += said
    return Carried(tuple(entries), (*sorted(tops), *rest), tuple(notes))


def _base_lrs(manifest: Manifest) -> list[float] | None:
    """The base learning rate of each param group that a torch LR scheduler saved (its ``base_lrs``), if the
    checkpoint holds one scheduler's."""
    found = [v for o in manifest.objects if o.path[-1] == "base_lrs" and isinstance(v := object_value(o), list)
             and all(isinstance(x, (int, float)) for x in v)]
    return found[0] if len(found) == 1 else None


def _state(manifest: Manifest, sec: _Section, outs: _Outputs, map_fn: MapFn, titan: str | None) -> tuple[Entry, ...]:
    unknown = [f"{sec.name}.state.{f}" for f in sec.state if f not in outs.selected]
    if unknown:
        raise UsageError(f"{manifest.root}: optimizer state {listed(unknown)} names no parameter the model's "
                         f"weights are saved as (e.g. {next(iter(outs.selected))!r}): a key mapping carries "
                         "optimizer state by parameter name, not by index or a fused parameter's name; convert "
                         "the model alone with --to hf")
    moments: dict[str, list[TensorEntry]] = {}
    saved: dict[tuple[str, str], tuple[str, Entry]] = {}  # (weight, slot): (parameter as saved, entry)
    scalars: list[tuple[str, str, Entry]] = []
    for fqn, slots in sec.state.items():
        weight = outs.weights[outs.selected[fqn]]
        for slot, e in slots.items():
            if isinstance(e, TensorEntry) and e.shape == weight.shape:
                moments.setdefault(slot, []).append(dataclasses.replace(e, key=weight.key, path=(weight.key,)))
                saved[weight.key, slot] = fqn, e
            elif isinstance(e, ObjectEntry) or math.prod(e.shape) == 1:
                scalars.append((fqn, slot, e))
            else:
                raise UsageError(f"{manifest.root}: optimizer state {e.key!r} of shape {list(e.shape)} is not "
                                 f"element-wise with its parameter ({list(weight.shape)}), as a factored or "
                                 "preconditioner state (Adafactor, Shampoo) is not: a key mapping cannot carry it; "
                                 "convert the model alone with --to hf")
    out: list[Entry] = []
    for slot, tensors in moments.items():
        try:
            mapped = map_fn(tuple(tensors))
        except UsageError as error:
            raise UsageError(f"optimizer state {sec.name}.state.*.{slot}: {error}") from None
        origin = {new: old for old, new in mapped.renamed}
        for t in mapped.tensors:
            if t.derived is not None and t.derived.op == "zeros":  # a buffer written at its initial value: no state
                continue
            fqn, e = saved[origin.get(t.key, t.key), slot]
            placed = _state_entry(e, sec.name, fqn, t.key, slot, titan)
            out.append(dataclasses.replace(t, key=placed.key, path=placed.path))
    for fqn, slot, e in scalars:
        out += [_state_entry(e, sec.name, fqn, new, slot, titan) for new in outs.outputs(fqn)]
    return tuple(out)


def _state_entry(e: Entry, section: str, fqn: str, new: str, slot: str, titan: str | None) -> Entry:
    """State entry ``e`` of parameter ``fqn`` as the state of ``new``."""
    if titan is not None:
        return _placed(e, titan, f"{_STATE}{new}.{slot}")
    return _moved(e, len(section) + 1 + len(_STATE), fqn, new)


def _groups(sec: _Section, outs: _Outputs, titan: str | None, base_lrs: list[float] | None) -> tuple[Entry, ...]:
    """The param groups' entries under the mapped names: per parameter, or numbered with ``params`` renamed;
    each with its ``initial_lr`` (see the module docstring)."""
    start = len(sec.name) + 1 + len(_GROUPS)
    out: list[Entry] = []
    for fqn, fields in sec.per_param.items():
        for new in outs.outputs(fqn) if fqn in outs.selected else ():
            out += [_placed(e, titan, f"{_GROUPS}{new}.{f}") if titan else _moved(e, start, fqn, new)
                    for f, e in _with_initial_lr(fields, None).items()]
    for index, fields in sec.numbered.items():
        params = fields.get("params")
        listed_params = object_value(params) if isinstance(params, ObjectEntry) else None
        if not isinstance(listed_params, list) or not all(isinstance(p, str) for p in listed_params):
            raise UsageError(f"{params.key if params else sec.name + '.param_groups.' + index}: expected the "
                             f"group's parameter names, found {listed_params!r:.60}; a key mapping carries "
                             "optimizer state by its parameters' names")
        renamed = [new for p in listed_params if p in outs.selected for new in outs.outputs(p)]
        base = base_lrs[int(index)] if base_lrs is not None and len(base_lrs) == len(sec.numbered) else None
        fields = _with_initial_lr(fields, base)
        if titan:
            out += [_placed(e, titan, f"{_GROUPS}{new}.{f}") for new in renamed for f, e in fields.items()
                    if f != "params"]
        else:
            out += [e for f, e in fields.items() if f != "params"]
            out.append(ObjectEntry(params.key, params.path, list(dict.fromkeys(renamed))))  # type: ignore[union-attr]
    return tuple(out)


def _with_initial_lr(fields: dict[str, Entry], base: float | None) -> dict[str, Entry]:
    """A group's ``fields`` with ``initial_lr``: as saved, else ``base`` (the source scheduler's), megatron-core's
    ``max_lr`` or the group's ``lr``."""
    if _INITIAL_LR in fields or "lr" not in fields:
        return fields
    lr, peak = fields["lr"], fields.get("max_lr")
    value = base if base is not None else object_value(peak) if isinstance(peak, ObjectEntry) else (
        object_value(lr) if isinstance(lr, ObjectEntry) else None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return fields
    key = lr.key[:-len("lr")] + _INITIAL_LR
    path = (*lr.path[:-1], str(lr.path[-1])[:-len("lr")] + _INITIAL_LR)
    return {**fields, _INITIAL_LR: ObjectEntry(key, path, float(value))}

"""What a universal checkpoint is written from: each parameter's weight, Adam moments and step, found in any
checkpoint that keeps per-parameter optimizer state the way torch's ``get_state_dict`` names it.

The optimizer section is ``<optim>.state.<param>.<slot>`` with ``<optim>`` one of the names training loops give
it (``optim``, ``optimizer``, ...), and ``<optim>.param_groups``; each parameter's weight is ``<model>.<param>``
under the model section that holds all of them (``model``, ``state_dict``, ``module``), or a flat top-level key
(torchtitan). Only the step's value is read (it names the tag and the engine's ``global_steps``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ...core.manifest import Manifest, ObjectEntry, TensorEntry
from ...errors import FormatError, IncompleteCheckpointError, UsageError
from ..base import object_value, scalar_value
from ..megatron import has_buckets

__all__ = ["Source", "read_step", "source_of"]

_OPTIMIZERS = ("optim", "optimizer", "optimizer_0", "optim_state", "optimizer_state_dict")
_MODELS = ("model", "state_dict", "model_state_dict", "module", "")
_SLOTS = frozenset({"exp_avg", "exp_avg_sq", "step"})

Entry = TensorEntry | ObjectEntry


@dataclass(frozen=True)
class Source:
    """A checkpoint's parameters with their optimizer state, by the engine's parameter names."""

    weights: dict[str, TensorEntry]
    """Parameter name to its weight, in the checkpoint's order."""
    moments: dict[str, dict[str, TensorEntry]]
    """Parameter name to ``exp_avg`` and ``exp_avg_sq``."""
    steps: dict[str, Entry]
    """Parameter name to its step: a 0-d tensor, or a number."""
    groups: tuple[tuple[dict[str, Any], list[str]], ...]
    """Each param group's hyperparameters and the parameters in it."""
    other_tensors: dict[str, TensorEntry]
    """Model tensors without optimizer state (buffers, frozen or tied parameters), by name."""
    left_out: tuple[str, ...]
    """Top-level groups that are neither the model nor the optimizer."""

    @property
    def others(self) -> list[str]:
        return list(self.other_tensors)


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _state(manifest: Manifest, head: str) -> dict[str, dict[str, Entry]]:
    state: dict[str, dict[str, Entry]] = {}
    for e in manifest.entries:
        if e.key.startswith(head):
            name, _, slot = e.key[len(head):].rpartition(".")
            state.setdefault(name, {})[slot] = e
    for name, slots in state.items():
        unknown = sorted(set(slots) - _SLOTS)
        if unknown:
            raise UsageError(f"{manifest.root}: {head}{name}.{unknown[0]}: DeepSpeed's universal checkpoint carries "
                             "Adam's exp_avg, exp_avg_sq and step, not this optimizer's state")
        missing = sorted(_SLOTS - set(slots))
        if missing:
            raise IncompleteCheckpointError(f"{manifest.root}: {head}{name} has no {missing[0]} (found "
                                            f"{', '.join(sorted(slots))}); Adam keeps exp_avg, exp_avg_sq and step")
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise FormatError(f"{manifest.root}: {head}{name!r}: not a parameter name")
    return state


_LAST: list[tuple[Manifest, Source]] = []
"""The last manifest asked about and its answer: a conversion asks three times (options, notes, plan)."""


def source_of(manifest: Manifest) -> Source:
    """The parameters of ``manifest`` with their optimizer state (see the module docstring); the same manifest
    object asked about again gets the same answer without working it out again.

    Raises:
        UsageError: The checkpoint holds no optimizer state (or megatron-core's buckets, which a preset splits), or
            an optimizer other than Adam's kind.
        IncompleteCheckpointError: A parameter lacks a moment, its step or its weight.
        FormatError: A moment's shape is not its weight's.
    """
    if _LAST and _LAST[0][0] is manifest:
        return _LAST[0][1]
    source = _source_of(manifest)
    _LAST[:] = [(manifest, source)]
    return source


def _source_of(manifest: Manifest) -> Source:
    optim = next((p for p in _OPTIMIZERS if any(t.key.startswith(p + ".state.") for t in manifest.tensors)), None)
    if optim is None and has_buckets(manifest):
        raise UsageError(f"{manifest.root}: megatron-core's DistributedOptimizer keeps its state in buckets, not per "
                         "parameter; convert with its family's Megatron preset (--preset megatron-llama ...) and "
                         "--hf-assets, which splits them into each parameter's state under HF names")
    if optim is None:
        raise UsageError(f"{manifest.root}: holds no optimizer state (optim.state.<param>.exp_avg, ...), which a "
                         "universal checkpoint carries; for the weights alone write --to full and load them with "
                         "the engine's module.load_state_dict")
    state = _state(manifest, optim + ".state.")
    tensors = {t.key: t for t in manifest.tensors}
    model = next((p for p in _MODELS if all(_joined(p, n) in tensors for n in state)), None)
    if model is None:
        name = next(n for n in state if _joined("model", n) not in tensors)
        hint = (" (torch's optimizer.state_dict() numbers the parameters; save get_state_dict's, which names "
                "them)") if name.isdigit() else ""
        raise IncompleteCheckpointError(f"{manifest.root}: optimizer state for {name!r} but no model tensor "
                                        f"model.{name} or {name}{hint}")
    in_model = [t for t in manifest.tensors if (t.key.startswith(model + ".") if model else len(t.path) == 1)]
    names = {t.key: t.key[len(model) + 1:] if model else t.key for t in in_model}
    weights = {names[t.key]: t for t in in_model if names[t.key] in state}
    moments = {n: {s: _tensor(state[n][s], manifest) for s in ("exp_avg", "exp_avg_sq")} for n in weights}
    for n, w in weights.items():
        for m in moments[n].values():
            if m.shape != w.shape:
                raise FormatError(f"{manifest.root}: {m.key} has shape {list(m.shape)}, its weight {w.key} "
                                  f"{list(w.shape)}")
    others = {names[t.key]: t for t in in_model if names[t.key] not in state}
    taken = {t.key for t in in_model} | {e.key for e in manifest.entries if e.key.startswith(optim + ".")}
    left = tuple(dict.fromkeys(str(e.path[0]) for e in manifest.entries if e.key not in taken))
    return Source(weights, moments, {n: state[n]["step"] for n in weights}, _groups(manifest, optim, list(weights)),
                  others, left)


def _tensor(entry: Entry, manifest: Manifest) -> TensorEntry:
    if not isinstance(entry, TensorEntry):
        raise FormatError(f"{manifest.root}: {entry.key} is not a tensor")
    return entry


def _groups(manifest: Manifest, optim: str, names: list[str]) -> tuple[tuple[dict[str, Any], list[str]], ...]:
    """The param groups' hyperparameters and parameter names: listed (``<optim>.param_groups.<i>.<field>``), or
    flattened per parameter (``<optim>.param_groups.<param>.<field>``, torchtitan's), where parameters with the
    same hyperparameters make one group, the groups in the order of their first parameter in the model (as a
    training script that builds a decayed and an undecayed group lists them)."""
    fields: dict[int, dict[str, Any]] = {}
    per_param: dict[str, dict[str, Any]] = {}
    head = f"{optim}.param_groups."
    for o in manifest.objects:
        if len(o.path) == 4 and o.path[:2] == (optim, "param_groups"):
            fields.setdefault(int(o.path[2]), {})[str(o.path[3])] = object_value(o)
        elif o.key.startswith(head) and (split := o.key[len(head):].rpartition("."))[0] in names:
            per_param.setdefault(split[0], {})[split[2]] = object_value(o)
    if not fields and per_param:
        return _grouped(per_param, names)
    if not fields:
        return (({}, names),)
    out = []
    for i in sorted(fields):
        params = fields[i].pop("params", None)
        listed = [p for p in params if p in names] if isinstance(params, list) and len(fields) > 1 else names
        out.append((fields[i], listed))
    return tuple(out)


def _grouped(per_param: dict[str, dict[str, Any]], names: list[str]) -> tuple[tuple[dict[str, Any], list[str]], ...]:
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for name in (n for n in names if n in per_param):
        hyper = {k: v for k, v in per_param[name].items() if k != "params"}
        same = next((g for g in groups if g[0] == hyper), None)
        if same is None:
            groups.append((hyper, [name]))
        else:
            same[1].append(name)
    return tuple(groups)


def read_step(src: Source) -> int:
    """The optimizer's step, read from the checkpoint: the same for every parameter, as DeepSpeed keeps it.

    Raises:
        FormatError: Steps differ between parameters, or one is not a whole number.
    """
    from ...io.sources import Files

    with Files() as files:
        values = {name: scalar_value(entry, files) for name, entry in src.steps.items()}
    return _one_step(values)


def _one_step(values: dict[str, float]) -> int:
    """The step every parameter has; the first parameter whose step is not whole, or differs from the step most
    parameters have, is named."""
    odd = next((n for n, v in values.items() if not float(v).is_integer()), None)
    if odd is not None:
        raise FormatError(f"{odd}: optimizer step {values[odd]} is not a whole number of steps")
    counts = Counter(float(v) for v in values.values())
    if not counts:
        raise FormatError("no parameter has an optimizer step")
    step, n = counts.most_common(1)[0]
    others = [name for name, v in values.items() if float(v) != step]
    if others:
        more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
        raise FormatError(f"{others[0]}: optimizer step {values[others[0]]:g}{more} where {n} parameters have step "
                          f"{step:g}; DeepSpeed keeps one step for every parameter")
    return int(step)

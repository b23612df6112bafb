"""The model part of a checkpoint: one rule, used by ``export-hf``, ``convert --to hf``, ``verify --model-only``
and ``ckptkit.load``.

A checkpoint's top level is split into groups by the first element of each entry's path (a DCP key's
first segment, a ``torch.save`` dict's top-level key). A group is **training state**, never weights, when

- its name is one training loops give such state: ``optimizer``, ``optim``, ``optim_state``,
  ``optimizer_states``, ``lr_scheduler``, ``scheduler``, ``dataloader``, ``train_state``, ``rng``,
  ``extra_state``, ``loops``, ``callbacks``, ``scaler`` ... (also with ``_0``, ``_1`` ... after it:
  accelerate's ``optimizer_0``, Lightning's ``optimizer_0``);
- or it is ``state`` beside ``param_groups`` (a bare ``optimizer.state_dict()``, as oumi's ``optimizer/``);
- or every tensor in it ends in an optimizer slot name (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
  ``step`` ...).

Then, with ``model_key="auto"``, the model is the first rule that finds tensors:

1. **a model section**: the first of ``model``, ``state_dict``, ``model_state_dict``, ``module`` that is a
   nested group holding tensors (ckptkit, Lightning, accelerate's ``pytorch_model_fsdp_0`` DCP);
2. **the top-level tensors** beside the training state (torchtitan: model keys flat, beside
   ``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``; a plain ``model.state_dict()``; HF);
3. **every tensor outside the training state** (a model saved as a nested dict).

A checkpoint whose tensors are all training state is refused: exporting it would make a "model" of
optimizer moments. ``model_key`` names the model explicitly by a dotted path: nested keys first
(``model``, ``ema.model``), else a prefix of the flattened keys (``state_dict.model`` picks
``state_dict.model.<rest>``).

Names then lose wrapper segments (:mod:`ckptkit.models.wrappers`). In a Lightning Trainer checkpoint (it records
``pytorch-lightning_version``) the model section holds LightningModule names, ``<attribute>.<HF name>``;
rule 1 strips that attribute when every key shares it. The selection records which rule chose the model
and what it left out, for the report.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.manifest import Format, Manifest, ObjectEntry, TensorEntry
from ..errors import UsageError
from ..models.wrappers import strip_names

__all__ = ["MODEL_KEYS", "OPTIMIZER_SLOTS", "ModelSelection", "meta_groups", "model_keys",
           "optimizer_sections", "select_model", "training_groups"]

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
"""Model sections tried, in order, by rule 1."""
_TRAINING_NAMES = re.compile(
    r"(optim|optimizers?|optim_states?|optimizer_states?|optimizer_state_dict|opt_state|lr_schedulers?|schedulers?"
    r"|dataloaders?|data_loader|sampler|train_state|trainer_state|rng|rng_states?|random_states?|extra_state"
    r"|loops|callbacks|scaler|grad_scaler)(_\d+)?")
OPTIMIZER_SLOTS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step"})
"""Last key segments of optimizer state tensors (Adam/AdamW, SGD with momentum)."""
LIGHTNING_MARK = "pytorch-lightning_version"
# Where frameworks put the model beside an optimizer-only directory, for the refusal message.
_MODEL_BESIDE = ("pytorch_model_fsdp_0", "model")

Entry = TensorEntry | ObjectEntry


@dataclass(frozen=True)
class ModelSelection:
    """The model part of a checkpoint, under the names a Hugging Face checkpoint uses."""

    tensors: tuple[TensorEntry, ...]
    """The model's tensors, renamed (``key`` and ``path`` are the new name)."""
    rule: str
    """Which rule chose the model, as the report says it."""
    groups: tuple[str, ...]
    """The top-level groups the model's tensors came from."""
    sources: tuple[tuple[str, str], ...]
    """(new name, name within the section) pairs: optimizer state names its parameters the second way."""
    saved_keys: tuple[tuple[str, str], ...]
    """(new name, key in the checkpoint) pairs."""
    renamed: tuple[tuple[str, int], ...]
    """(what was stripped, how many keys) pairs."""
    left_out: tuple[str, ...]
    """The groups outside the model part, each with what it holds."""

    @property
    def notes(self) -> tuple[str, ...]:
        out = [self.rule, *(f"stripped {prefix!r} from {n} keys" for prefix, n in self.renamed)]
        if self.left_out:
            shown = self.left_out[:8]
            out.append("left out: " + "; ".join(shown) + (f"; and {len(self.left_out) - 8} more" if
                                                          len(self.left_out) > 8 else ""))
        return tuple(out)


def _groups(manifest: Manifest) -> dict[str, list[Entry]]:
    groups: dict[str, list[Entry]] = {}
    for e in manifest.entries:
        groups.setdefault(str(e.path[0]), []).append(e)
    return groups


def _is_optimizer(name: str, entries: list[Entry], tops: set[str]) -> bool:
    if name.startswith("optim") and _TRAINING_NAMES.fullmatch(name):
        return True
    if name in ("state", "param_groups") and "param_groups" in tops:
        return True
    tensors = [e for e in entries if isinstance(e, TensorEntry)]
    return bool(tensors) and all(str(t.path[-1]).rsplit(".", 1)[-1] in OPTIMIZER_SLOTS for t in tensors)


def _is_training_state(name: str, entries: list[Entry], tops: set[str]) -> bool:
    """Whether top-level group ``name`` holding ``entries`` is training state (see the module docstring)."""
    if _TRAINING_NAMES.fullmatch(name) or _is_optimizer(name, entries, tops):
        return True
    # A flat key is its own group; its first dotted segment names its section (DCP without planner data).
    first = name.split(".", 1)[0]
    return len(entries) == 1 and len(entries[0].path) == 1 and first != name and bool(_TRAINING_NAMES.fullmatch(first))


_LISTED_STATE = re.compile(r"(\d+)\.state\.")


def optimizer_sections(manifest: Manifest) -> tuple[str, ...]:
    """The key prefixes of optimizer state dicts (``<prefix>.state.<param>.<slot>``, ``<prefix>.param_groups``):
    a top-level optimizer group, or the first element of one that lists them (Lightning's
    ``optimizer_states.0``). ckptkit's own ``optim`` comes first, then ``optimizer``, ``optimizer_0``, then
    the others by name."""
    groups = _groups(manifest)
    found = []
    for n, es in groups.items():
        if n in ("state", "param_groups") or not _is_optimizer(n, es, set(groups)):
            continue
        if any(e.key.startswith(n + ".state.") for e in es):
            found.append(n)
        elif listed := sorted({int(m.group(1)) for e in es if (m := _LISTED_STATE.match(e.key[len(n) + 1:]))}):
            found.append(f"{n}.{listed[0]}")
    preferred = [n for n in ("optim", "optimizer", "optimizer_0") if n in found]
    return (*preferred, *sorted(n for n in found if n not in preferred))


def training_groups(manifest: Manifest, optimizer: bool = False) -> tuple[str, ...]:
    """The top-level groups of ``manifest`` that are training state (see the module docstring); with
    ``optimizer``, those that are optimizer state only."""
    groups = _groups(manifest)
    test = _is_optimizer if optimizer else _is_training_state
    return tuple(n for n, es in groups.items() if test(n, es, set(groups)))


def meta_groups(manifest: Manifest) -> tuple[str, ...] | None:
    """The top-level groups a SHARDED output also writes into Lightning's ``meta.pt``: those that are neither
    the model part nor optimizer state, as Lightning keeps there all but modules and optimizers.

    None (no ``meta.pt`` beyond what the source carried in one) for a DCP source that has no ``meta.pt``, for
    one whose ``meta.pt`` Lightning wrote (its entries go back as they are), and for another source without
    such groups (an empty ``meta.pt`` is written only where a Lightning DCP had one).
    """
    if any(e.sidecar for e in manifest.entries):
        return None
    if manifest.format is Format.SHARDED and not any(k == "meta.pt" for k, _ in manifest.details):
        return None
    groups = _groups(manifest)
    try:
        model = set(select_model(manifest).groups)
    except UsageError:  # no model part: the groups are state still
        model = set()
    kept = tuple(n for n, es in groups.items() if n not in model and not _is_optimizer(n, es, set(groups)))
    # A Lightning DCP's meta.pt goes on even when empty (Lightning needs the file); from another source, a
    # meta.pt that would hold nothing (an HF model, a bare state dict) is not written.
    return kept if kept or manifest.format is Format.SHARDED else None


def _describe(name: str, entries: list[Entry]) -> str:
    n_t = sum(isinstance(e, TensorEntry) for e in entries)
    n_o = len(entries) - n_t
    if len(entries) == 1 and len(entries[0].path) == 1:
        return f"{name} ({'a tensor' if n_t else 'a value'})"
    parts = [f"{n_t} tensor{'s' * (n_t != 1)}"] if n_t else []
    parts += [f"{n_o} other entr{'ies' if n_o != 1 else 'y'}"] if n_o else []
    return f"{name} ({', '.join(parts)})"


def _within(key: str, prefix: tuple[str, ...]) -> str:
    return key[len(".".join(prefix)) + 1:] if prefix else key


def _refuse(manifest: Manifest, training: dict[str, list[Entry]]) -> UsageError:
    held = "; ".join(_describe(n, training[n]) for n in sorted(training))
    optimizer = any(n in ("state", "param_groups") or n.startswith("optim") for n in training)
    if not optimizer:
        return UsageError(f"{manifest.root}: holds no model weights, only training state ({held}); "
                          "point at the checkpoint that holds the model, or name it with --model-key")
    tensors = [t.key for es in training.values() for t in es if isinstance(t, TensorEntry)]
    example = next((k for k in tensors if not k.endswith(".step")), tensors[0] if tensors else "")
    root = Path(manifest.root)
    beside = [root.parent / n for n in _MODEL_BESIDE if (root.parent / n).is_dir() and root.parent / n != root]
    hint = f"; the model is probably in {beside[0]}" if beside else ""
    return UsageError(f"{manifest.root}: holds optimizer state only (e.g. {example!r}; {held}), no model weights. "
                      "Frameworks save the model beside it: accelerate and the HF Trainer in pytorch_model_fsdp_0/, "
                      f"oumi in model/{hint}")


def select_model(manifest: Manifest, model_key: str = "auto", strip_prefixes: tuple[str, ...] = (),
                 strip_wrappers: bool = True) -> ModelSelection:
    """The model part of ``manifest`` by the rule above, renamed to HF names.

    Raises :class:`UsageError` when ``model_key`` names nothing, when the checkpoint holds only training
    state (naming what it holds and where frameworks keep the model), or when two keys collide after
    stripping.
    """
    groups = _groups(manifest)
    tops = set(groups)
    training = {n: es for n, es in groups.items() if _is_training_state(n, es, tops)}
    lightning = False
    if model_key != "auto":
        chosen, section, rule = _explicit(manifest, model_key)
    else:
        chosen, section, rule, lightning = _automatic(manifest, groups, training)
    if not chosen:
        if model_key == "auto" and training:
            raise _refuse(manifest, training)
        raise UsageError(f"{manifest.root}: no model tensors found (model key {model_key!r})")
    inner = [(t, _within(t.key, section)) for t in chosen]
    counts: Counter[str] = Counter()
    prefixes = tuple(strip_prefixes)
    if lightning:
        attribute = _shared_attribute([k for _, k in inner])
        if attribute:
            prefixes = (attribute, *prefixes)
            rule += f" (a Lightning Trainer checkpoint: LightningModule attribute {attribute!r} stripped)"
    out: list[TensorEntry] = []
    origin: dict[str, str] = {}
    sources = []
    for t, key in inner:
        new = strip_names(key, prefixes, strip_wrappers, counts)
        if new in origin:
            raise UsageError(f"{manifest.root}: {origin[new]!r} and {t.key!r} both become {new!r} "
                             "after stripping prefixes")
        origin[new] = t.key
        sources.append((new, key))
        out.append(dataclasses.replace(t, key=new, path=(new,)))
    taken = {t.key for t in chosen}
    rest: dict[str, list[Entry]] = {}
    for e in manifest.entries:
        if e.key not in taken:
            rest.setdefault(str(e.path[0]), []).append(e)
    left_out = tuple(_describe(n, rest[n]) for n in sorted(rest))
    groups_of = tuple(dict.fromkeys(str(t.path[0]) for t in chosen))
    return ModelSelection(tuple(out), rule, groups_of, tuple(sources), tuple(origin.items()),
                          tuple(sorted(counts.items())), left_out)


def _automatic(manifest: Manifest, groups: dict[str, list[Entry]],
               training: dict[str, list[Entry]]) -> tuple[list[TensorEntry], tuple[str, ...], str, bool]:
    """The model by the rule above: its tensors, the section they are under, the rule that chose them, and
    whether the checkpoint is a Lightning Trainer's."""
    found = next((k for k in MODEL_KEYS if k in groups and k not in training
                  and any(isinstance(e, TensorEntry) and len(e.path) > 1 for e in groups[k])), None)
    if found is not None:
        chosen = [t for t in manifest.tensors if str(t.path[0]) == found]
        return chosen, (found,), f"model taken from top-level key {found!r}", LIGHTNING_MARK in manifest
    outside = [t for t in manifest.tensors if str(t.path[0]) not in training]
    chosen = [t for t in outside if len(t.path) == 1]
    if chosen and training:
        return chosen, (), "model taken from the top-level tensors beside the training state", False
    if chosen:
        return chosen, (), "checkpoint is a flat model state dict", False
    return outside, (), "model taken from every tensor outside the training state", False


def model_keys(model_key: str = "auto", strip_prefixes: tuple[str, ...] = (),
               strip_wrappers: bool = True) -> Callable[[Manifest], set[str]]:
    """For :meth:`FormatIO.read_part`: the keys, as saved, of the model part :func:`select_model` picks (with
    these arguments) from a manifest."""
    return lambda manifest: {k for _, k in select_model(manifest, model_key, strip_prefixes,
                                                        strip_wrappers).saved_keys}


def _explicit(manifest: Manifest, model_key: str) -> tuple[list[TensorEntry], tuple[str, ...], str]:
    """The tensors under ``model_key``: a nested key path first, else a prefix of the flattened keys."""
    parts = tuple(model_key.split("."))
    nested = [t for t in manifest.tensors
              if len(t.path) > len(parts) and tuple(map(str, t.path[:len(parts)])) == parts]
    if nested:
        return nested, parts, f"model taken from key {model_key!r} (--model-key)"
    flat = [t for t in manifest.tensors if t.key.startswith(model_key + ".")]
    if flat:
        return flat, parts, f"model taken from the keys under {model_key + '.'!r} (--model-key)"
    tops = list(dict.fromkeys(str(e.path[0]) for e in manifest.entries))
    raise UsageError(f"{manifest.root}: no model under key {model_key!r}; top-level keys are {tops[:12]} "
                     "(use --model-key with a dotted path, or 'auto')")


def _shared_attribute(keys: list[str]) -> str | None:
    """``"<attr>."`` when every key is ``<attr>.<more>`` for one attribute (a LightningModule's model)."""
    firsts = {k.split(".", 1)[0] for k in keys}
    if len(firsts) == 1 and all("." in k for k in keys):
        return firsts.pop() + "."
    return None

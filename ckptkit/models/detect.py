"""Which preset a checkpoint needs: the framework whose names the keys are, the model family from the config's
``model_type``, and the keys.

``--preset auto`` (``export-hf``'s default, and ``convert --to hf``'s) first recognises a framework by its
names (:data:`FRAMEWORKS`: torchtitan's and Meta's ``tok_embeddings``/``layers.N.attention``, megatron-core's
``decoder.layers.``/``embedding.word_embeddings``). Among that framework's presets in
:data:`ckptkit.models.registry.PRESETS` it takes the one whose ``model_types`` hold the config's ``model_type``
and whose table knows every key; without a ``model_type``, the one whose table knows every key and holds a
tensor for each of its rows (so a table's q/k norms tell it from one without them). Keys in no framework's names (HF's
own) go through as they are. Keys of a recognised framework that no preset maps are :attr:`Detected.unmapped`:
an HF output refuses them, naming the nearest preset. An explicit ``--preset`` is checked the same way: a config
whose ``model_type`` belongs to another family, or keys that only another preset knows, are a family mismatch.
A family that a framework ships and no preset maps is refused by name (:func:`refuse_unmapped`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from .completeness import listed
from .matching import NameTable, nearest, pattern, unknown_keys
from .preset import Preset
from .registry import PRESETS, UNMAPPED, family_of

__all__ = ["FRAMEWORKS", "Detected", "Framework", "check_family", "detect_family", "recognise", "refuse_unmapped"]


@dataclass(frozen=True)
class Framework:
    """A code base whose tensor names ckptkit recognises, and the presets that map them."""

    name: str
    """How messages call the names (``torchtitan``)."""
    sides: tuple[str, ...]
    """The :attr:`Preset.other_side` of its presets."""
    marks: re.Pattern
    """Matched at the start of a key: a name only this code base uses."""


FRAMEWORKS = (
    Framework("torchtitan (or Meta)", ("torchtitan", "Meta"),
              re.compile(r"tok_embeddings\.|layers\.\d+\.(attention|feed_forward|moe|attention_norm|ffn_norm)[._]")),
    Framework("Megatron", ("Megatron",),
              re.compile(r"(language_model\.)?(embedding\.word_embeddings\.|output_layer\.|decoder\.final_layernorm\."
                         r"|(decoder|encoder)\.layers\.(\d+\.)?(self_attention|mlp|pre_mlp_layernorm|input_layernorm)"
                         r"\.)")),
)
"""The frameworks ``--preset auto`` recognises by their names. HF's base models (``layers.N.self_attn``,
``embed_tokens``) and encoder-decoders (``decoder.layers.N.self_attn``) are not among them."""


@dataclass(frozen=True)
class Detected:
    preset: str | None
    """The preset ``--preset auto`` uses; None: none (the keys are HF's names, or no framework's)."""
    why: str
    """How it was decided, for ``inspect`` and the report; for :attr:`unmapped` keys, the refusal."""
    unmapped: bool = False
    """The keys are a recognised framework's names that no preset maps: an HF output refuses them."""


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)")


def _templates(keys: Sequence[str]) -> list[str]:
    """``keys`` with each dotted number as 0: a table's ``{n}`` matches any number, so one key of each kind is
    enough to ask a table about (a 100-layer model's keys, 100 times fewer)."""
    return list(dict.fromkeys(_NUMBER.sub("0", k) for k in keys))


def _fits(p: Preset, keys: Sequence[str], hf: bool) -> bool:
    return not unknown_keys(p, keys, hf)


def _covers(p: Preset, keys: Sequence[str]) -> bool:
    """Every row of ``p`` that a model always holds (not a tied head, one variant of each slot) has a key."""
    table = NameTable(p)
    found = {id(m.row) for k in keys if (m := table.find(table.other, k))}
    slots = {r.group.partition(":")[0] for r in p.rows if r.group and id(r) in found}
    return all(id(r) in found or r.tied_to or r.read_only or (r.group and r.group.partition(":")[0] in slots)
               for r in p.rows)


def recognise(keys: Sequence[str]) -> tuple[Framework, str] | None:
    """The framework whose names ``keys`` are, with the first key that says so; None: no framework's."""
    for framework in FRAMEWORKS:
        key = next((k for k in keys if framework.marks.match(k)), None)
        if key is not None:
            return framework, key
    return None


def _presets(framework: Framework) -> list[Preset]:
    return [p for p in PRESETS.values() if p.other_side in framework.sides]


def _unmapped(framework: Framework, example: str, keys: Sequence[str], presets: list[Preset]) -> Detected:
    near, _ = nearest(_templates(keys), presets)
    unknown = unknown_keys(near, keys)
    return Detected(None, f"the keys are {framework.name} names (e.g. {example!r}), and no preset maps all of them: "
                          f"the nearest, --preset {near.name}, does not know {len(unknown)}: {listed(unknown)}; this "
                          f"family or variant is not mapped yet (the presets of {framework.name} names: "
                          f"{', '.join(p.name for p in presets)}; --preset none writes the names as they are)", True)


def detect_family(keys: Sequence[str], model_type: str | None, source: str = "config.json") -> Detected:
    """The preset for ``keys`` (a model's tensor names) of a model whose config says ``model_type``.

    Args:
        keys: the model part's tensor names.
        model_type: the config's ``model_type``, or None.
        source: where ``model_type`` was read, for messages.

    Returns:
        The preset, or None with why (:attr:`Detected.unmapped` where a framework's names have no preset).

    Raises:
        UsageError: the config names a family whose names the keys are not, while another family's are.
    """
    found = recognise(keys)
    if found is None:
        return Detected(None, "the keys are Hugging Face names" if any(k.startswith("model.") for k in keys)
                        else "no known family's names")
    framework, example = found
    templates = _templates(keys)
    presets = _presets(framework)
    fitting = [p for p in presets if _fits(p, templates, hf=False)]
    whole = [p for p in fitting if _covers(p, templates)] or fitting
    claimed = [p for p in presets if model_type in p.model_types]
    if claimed:
        chosen = [p for p in claimed if p in fitting]
        if chosen:
            return Detected(chosen[0].name, f"model_type {model_type!r} in {source}, {framework.name} names")
        if fitting:
            raise UsageError(f"{source}: model_type {model_type!r} is --preset {claimed[0].name}'s family, but the "
                             f"keys are --preset {whole[0].name}'s")
    if whole:
        return Detected(whole[0].name, f"{framework.name} names of --preset {whole[0].name}'s table"
                        + (f" (model_type {model_type!r} is not a known family)" if model_type else ""))
    return _unmapped(framework, example, keys, claimed + [p for p in presets if p not in claimed])


def check_family(p: Preset, keys: Sequence[str], model_type: str | None, source: str = "config.json") -> None:
    """Refuses an explicit ``--preset`` for another family's checkpoint (by ``model_type``, else by the keys).

    Raises:
        UsageError: the family mismatch, naming the preset that fits.
    """
    kin = [q for q in PRESETS.values() if q.other_side == p.other_side]
    claimed = [q for q in kin if model_type in q.model_types]
    if claimed and p not in claimed and not _reads(p, model_type):
        raise UsageError(f"--preset {p.name}: {source} says model_type {model_type!r}, which is --preset "
                         f"{claimed[0].name}'s family")
    templates = _templates(keys)
    for hf in (False, True):
        if _fits(p, templates, hf):
            return
    others = [q.name for hf in (False, True) for q in PRESETS.values()
              if q is not p and not q.identity and _fits(q, templates, hf)]
    if others:
        raise UsageError(f"--preset {p.name}: the keys are --preset {others[0]}'s family, not {p.name}'s")


def _reads(p: Preset, model_type: str | None) -> bool:
    """Whether ``p``'s family says its table maps checkpoints of ``model_type`` too (:attr:`Family.reads`)."""
    family = family_of(p)
    return family is not None and (p.name, model_type) in family.reads


def refuse_unmapped(keys: Sequence[str], config: dict | None, source: str = "config.json") -> None:
    """Refuses a checkpoint of a family that a framework ships and ckptkit does not map
    (:data:`ckptkit.models.registry.UNMAPPED`): its config names it (``model_type``, or diffusers'
    ``_class_name``), or its keys are that family's own names. ``--preset none`` keeps the names, explicitly.

    Args:
        keys: the model's tensor names.
        config: the model's ``config.json``, or None.
        source: where the config came from, for the message.

    Raises:
        UsageError: the config or the keys name such a family.
    """
    named = [config.get(field) for field in ("model_type", "_class_name")] if config else []
    for u in UNMAPPED:
        by_config = next((n for n in named if isinstance(n, str) and n in u.model_types), None)
        patterns = [pattern(k) for k in u.keys]
        by_key = next((k for k in keys if any(p.fullmatch(k) for p in patterns)), None)
        if by_config or by_key:
            found = f"{source} names {by_config!r}" if by_config else f"the keys are its names ({by_key!r})"
            raise UsageError(f"{u.family} is not mapped: {found}; {u.why}. Pass --preset none to keep the "
                             "checkpoint's own names")

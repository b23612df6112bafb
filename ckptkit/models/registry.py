"""Every model family, found in :mod:`ckptkit.models.families` (one module a family, each exporting a ``FAMILY``),
and what follows from them: the presets by name, the families refused by name, the ``model_type`` maps that
detection and ``convert --to megatron`` use, and transformers' default weight tying. Nothing here names a family."""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import UsageError
from . import families
from .family import Family, Unmapped
from .megatron_args import MEGATRON_SIDE
from .preset import Preset

__all__ = ["DETECT", "FAMILIES", "MEGATRON", "MEGATRON_REFUSED", "PRESETS", "TIE_DEFAULTS", "UNMAPPED", "family_of",
           "kin", "preset", "unknown_preset"]

SIDES = ("torchtitan", "Meta", MEGATRON_SIDE)
"""The frameworks whose tables convert, in the order their presets are listed; tables that check HF's own names
come after them."""


def _families() -> tuple[Family, ...]:
    found = []
    for info in pkgutil.iter_modules(families.__path__):
        if info.name.startswith("_"):
            continue
        family = getattr(importlib.import_module(f"{families.__name__}.{info.name}"), "FAMILY", None)
        if not isinstance(family, Family):
            raise AssertionError(f"{families.__name__}.{info.name} exports no FAMILY")
        found.append(family)
    return tuple(sorted(found, key=lambda f: (f.rank, f.name)))


FAMILIES: tuple[Family, ...] = _families()
"""Every family, in the order their presets are listed (:attr:`Family.rank`, then name)."""


def _side(p: Preset) -> int:
    return SIDES.index(p.other_side) if p.other_side in SIDES else len(SIDES)


def _presets() -> dict[str, Preset]:
    ordered = sorted(((f, i, p) for f in FAMILIES for i, p in enumerate(f.presets)),
                     key=lambda t: (_side(t[2]), FAMILIES.index(t[0]), t[1]))
    found: dict[str, Preset] = {}
    for family, _, p in ordered:
        if p.name in found:
            raise AssertionError(f"preset {p.name!r} is defined twice ({family.name})")
        found[p.name] = p
    return found


PRESETS: dict[str, Preset] = _presets()
"""The presets by name: by framework (torchtitan's, Meta's, megatron-core's, then HF's names checked), then by
family."""

_FAMILY_OF = {p.name: f for f in FAMILIES for p in f.presets}

UNMAPPED: tuple[Unmapped, ...] = tuple(f.unmapped for f in FAMILIES if f.unmapped is not None)
"""The families a framework ships that no preset maps: refused by name."""


def _by_model_type(side: str) -> dict[str, str]:
    return {t: p.name for p in PRESETS.values() if p.other_side == side for t in p.model_types}


DETECT = _by_model_type("torchtitan")
"""``config.json``'s ``model_type`` -> the preset ``--preset auto`` uses for torchtitan names of that family
(:mod:`ckptkit.models.detect`)."""

MEGATRON = _by_model_type(MEGATRON_SIDE)
"""``config.json``'s ``model_type`` -> the preset ``convert --to megatron`` uses when given none."""

MEGATRON_REFUSED: dict[str, str] = {t: f.megatron.no_table for f in FAMILIES
                                    if f.megatron is not None and f.megatron.no_table for t in f.model_types}
"""``model_type`` -> why ``convert --to megatron`` has no table for that family."""

TIE_DEFAULTS: dict[str, bool] = {m.model_type: m.tied for f in FAMILIES for m in f.hf if m.tied is not None}
"""``tie_word_embeddings`` when config.json omits it, per ``model_type`` of the families' HF models."""


def preset(name: str) -> Preset:
    """The preset named ``name``.

    Args:
        name: a key of :data:`PRESETS`.

    Returns:
        The preset.

    Raises:
        UsageError: no preset has that name.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"--preset {name!r}: {unknown_preset(name)}") from None


def unknown_preset(name: str, also: tuple[str, ...] = ()) -> str:
    """Why ``name`` is no preset, in a few words: the nearest name (of :data:`PRESETS` and ``also``), and where
    the list of all of them is."""
    import difflib

    close = difflib.get_close_matches(name, [*also, *PRESETS], n=1, cutoff=0.6)
    guess = f"did you mean {close[0]}? " if close else ""
    return f"unknown; {guess}'ckptkit presets' lists every preset"


def family_of(p: Preset) -> Family | None:
    """The family whose preset ``p`` is (one of :data:`PRESETS`, or one a run's arguments adjusted from it)."""
    return _FAMILY_OF.get(p.name)


def kin(p: Preset) -> list[Preset]:
    """The presets of ``p``'s framework (``p`` among them), in :data:`PRESETS` order."""
    return [q for q in PRESETS.values() if q.other_side == p.other_side]

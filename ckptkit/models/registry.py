"""Every model family's presets, found in :mod:`ckptkit.models.families` (one module a family, each with a
``PRESETS`` tuple, and an ``UNMAPPED`` one naming the families it refuses), and the ``model_type`` maps that
detection and ``convert --to megatron`` use."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ..errors import UsageError
from . import families
from .preset import Preset, Unmapped

__all__ = ["DETECT", "MEGATRON", "MEGATRON_REFUSED", "PRESETS", "UNMAPPED", "preset"]

# The framework modules first, so that ``--help`` and ``ckptkit presets`` list the converting tables before
# the checking ones; every other module follows in name order.
_FIRST = ("torchtitan", "meta", "megatron")


def _family_modules() -> list[ModuleType]:
    names = [m.name for m in pkgutil.iter_modules(families.__path__) if not m.name.startswith("_")]
    ordered = sorted(names, key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n))
    return [importlib.import_module(f"{families.__name__}.{name}") for name in ordered]


_MODULES = _family_modules()


def _load() -> dict[str, Preset]:
    found: dict[str, Preset] = {}
    for module in _MODULES:
        for p in module.PRESETS:
            if p.name in found:
                raise AssertionError(f"preset {p.name!r} is defined twice ({module.__file__})")
            found[p.name] = p
    return found


PRESETS: dict[str, Preset] = _load()
"""The presets by name."""

UNMAPPED: tuple[Unmapped, ...] = tuple(u for module in _MODULES for u in getattr(module, "UNMAPPED", ()))
"""The families a module names as not mapped (its ``UNMAPPED`` tuple): refused by name."""


def _by_model_type(framework: str) -> dict[str, str]:
    return {t: p.name for p in PRESETS.values() if p.other_side == framework for t in p.model_types}


DETECT = _by_model_type("torchtitan")
"""``config.json``'s ``model_type`` -> the preset ``--preset auto`` uses for torchtitan names of that family
(:mod:`ckptkit.models.detect`)."""

MEGATRON = _by_model_type("Megatron")
"""``config.json``'s ``model_type`` -> the preset ``convert --to megatron`` uses when given none."""


MEGATRON_REFUSED: dict[str, str] = {t: why for module in _MODULES for t, why in getattr(module, "REFUSED", {}).items()}
"""``model_type`` -> why ``convert --to megatron`` has no table for that family (a module's ``REFUSED``)."""


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
        raise UsageError(f"--preset {name!r}: unknown; expected one of {', '.join(PRESETS)}") from None

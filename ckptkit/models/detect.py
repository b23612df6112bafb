"""Which preset a checkpoint needs: the model family from ``config.json``'s ``model_type`` and the keys.

``--preset auto`` (``export-hf``'s default, and ``convert --to hf``'s) maps a checkpoint whose keys are
another code base's names of a family in :data:`ckptkit.models.registry.DETECT`; keys already in HF's names go
through as they are. An explicit ``--preset`` is checked the same way: a config whose ``model_type`` belongs
to another family, or keys that only another preset knows, are a family mismatch, refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from .engine import NameTable
from .registry import DETECT, PRESETS
from .table import Preset

__all__ = ["Detected", "check_family", "detect_family"]


@dataclass(frozen=True)
class Detected:
    preset: str | None
    """The preset ``--preset auto`` uses; None: none (the keys are HF's names, or no family is recognised)."""
    why: str
    """How it was decided, for ``inspect`` and the report."""


def _fits(p: Preset, keys: Sequence[str], hf: bool) -> bool:
    """Every key is one of ``p``'s names (its HF side when ``hf``), or a buffer it leaves out."""
    table = NameTable(p)
    side = table.hf if hf else table.other
    return all(table.find(side, k) or any(d.fullmatch(k) for d in table.dropped) for k in keys)


def _families(keys: Sequence[str], hf: bool) -> list[str]:
    return [name for name in dict.fromkeys(DETECT.values()) if _fits(PRESETS[name], keys, hf)]


def detect_family(keys: Sequence[str], model_type: str | None, source: str = "config.json") -> Detected:
    """The preset for ``keys`` (a model's tensor names) of a model whose config says ``model_type``.

    Raises:
        UsageError: the config names a family whose names the keys are not, while another family's are.
    """
    named = DETECT.get(model_type or "")
    if not any(k == "tok_embeddings.weight" or k.startswith("layers.") for k in keys):
        return Detected(None, "the keys are Hugging Face names" if any(k.startswith("model.") for k in keys)
                        else "no known family's names")
    fitting = _families(keys, hf=False)
    if named is not None:
        if fitting and named not in fitting:
            raise UsageError(f"{source}: model_type {model_type!r} is --preset {named}'s family, but the keys are "
                             f"--preset {fitting[0]}'s")
        return Detected(named, f"model_type {model_type!r} in {source}, torchtitan names")
    if fitting:
        return Detected(fitting[0], f"torchtitan names of --preset {fitting[0]}'s table"
                        + (f" (model_type {model_type!r} is not a known family)" if model_type else ""))
    return Detected(None, "torchtitan-like names that no preset knows")


def check_family(p: Preset, keys: Sequence[str], model_type: str | None, source: str = "config.json") -> None:
    """Refuses an explicit ``--preset`` for another family's checkpoint (by ``model_type``, else by the keys).

    Raises:
        UsageError: the family mismatch, naming the preset that fits.
    """
    named = DETECT.get(model_type or "")
    families = {v for v in DETECT.values()}
    if named is not None and p.name in families and named != p.name and not _compatible(p.name, named):
        raise UsageError(f"--preset {p.name}: {source} says model_type {model_type!r}, which is --preset "
                         f"{named}'s family")
    for hf in (False, True):
        if _fits(p, keys, hf):
            return
    others = [name for name in _families(keys, False) + _families(keys, True) if name != p.name]
    if others:
        raise UsageError(f"--preset {p.name}: the keys are --preset {others[0]}'s family, not {p.name}'s")


def _compatible(chosen: str, named: str) -> bool:
    """A Qwen3-MoE table holds Qwen3's dense layers too, so it reads a dense Qwen3 checkpoint."""
    return (chosen, named) == ("torchtitan-qwen3-moe", "torchtitan-qwen3")

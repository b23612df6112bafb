"""``ckptkit presets``: every model family's preset, as a table a user picks ``--preset`` from."""

from __future__ import annotations

from typing import Any

from ..models.preset import Preset
from ..models.registry import PRESETS

__all__ = ["describe", "presets", "render"]


def describe(p: Preset) -> dict[str, Any]:
    """One preset in words: its name, the framework whose names it maps, the families (``model_type``) it is
    detected for, the direction it works in, what it does to the tensors, and its one-line summary."""
    does = [] if p.identity else ["keys renamed"]
    if any(r.transform == "rotary" for r in p.rows):
        does.append("q/k rows reordered (rotary)")
    stacked = {axis for r in p.rows if r.stacked for axis in r.stacked.split(",")}
    if "n" in stacked:
        does.append("layer-stacked tensors split per layer")
    if "e" in stacked:
        does.append("stacked experts split per expert")
    if any(r.split for r in p.rows):
        does.append("fused QKV and gate/up split")
    if any(r.transpose for r in p.rows):
        does.append("experts transposed")
    if any(r.interleave for r in p.rows):
        does.append("gate/up columns interleaved")
    if p.fp8:
        does.append("FP8 dequantized (from HF)")
    if p.mxfp4:
        does.append("MXFP4 dequantized (from HF)")
    if any("freq" in d for d in p.dropped):
        does.append("rotary tables left out")
    if p.refuse:
        does.append("some keys refused")
    return {"name": p.name, "framework": p.other_side, "family": ", ".join(p.model_types) or "-",
            "direction": "checks HF names" if p.identity else f"{p.other_side} <-> HF",
            "transforms": "; ".join(does) or "-", "summary": p.summary}


def presets() -> list[dict[str, Any]]:
    """Every preset, described by :func:`describe`, in ``--preset``'s order."""
    return [describe(p) for p in PRESETS.values()]


def render(rows: list[dict[str, Any]]) -> str:
    """The presets as an aligned table (name, framework, family, direction, transforms)."""
    columns = ("name", "framework", "family", "direction", "transforms")
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns[:-1]}
    lines = ["  ".join(f"{c.upper():<{widths[c]}}" if c in widths else c.upper() for c in columns)]
    lines += ["  ".join(f"{r[c]:<{widths[c]}}" if c in widths else r[c] for c in columns) for r in rows]
    lines.append("auto (the default toward HF) detects the family from config.json's model_type and the keys; "
                 "none maps nothing. --json adds each preset's summary.")
    return "\n".join(lines)

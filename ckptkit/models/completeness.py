"""Whether a checkpoint mapped by a preset's table holds every tensor of the model, and what an import towards
the other side adds that HF has no tensor for: a tied head's copy, a buffer at its initial value
(:mod:`ckptkit.models.preset`). Pure planning, as :mod:`ckptkit.models.apply`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.dtypes import by_name
from ..core.manifest import TensorEntry
from ..core.reshape import zeros
from ..errors import UsageError
from .preset import Preset, Row
from .shape import ModelShape

__all__ = ["Source", "buffers", "check_complete", "fill", "listed"]

_SHOWN = 8


@dataclass(frozen=True)
class Source:
    """A tensor to adapt, and the key the user knows it by (before any rename)."""

    origin: str
    entry: TensorEntry


def listed(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def fill(name: str, binding: dict[str, str]) -> str:
    for k, v in binding.items():
        name = name.replace("{" + k + "}", v)
    return name


def check_complete(p: Preset, present: set[tuple[Row, str | None]], shape: ModelShape | None, towards: bool,
                   by_key: dict[str, Source]) -> list[Source]:
    """Refuses tensors of the table that the checkpoint lacks, layer by layer (a layer holds one variant of
    each slot, whole); returns the tied tensors written from what they are tied to (HF names -> the other's,
    which has no ties)."""
    layers = shape.layers if shape is not None and shape.layers else None
    seen = {int(n) for _, n in present if n is not None}
    if layers is not None and seen and max(seen) >= layers:
        raise UsageError(f"--preset {p.name}: {shape.source if shape else 'the config'} gives {layers} layers, but "
                         f"the checkpoint has layer {max(seen)}")
    numbers = [str(i) for i in range(layers if layers else (max(seen) + 1 if seen else 0))]
    missing: list[str] = []
    added: list[Source] = []
    for n in [None, *numbers]:
        rows = [r for r in p.rows
                if not r.read_only and ("n" in r.placeholders() and "n" not in r.stack_axes) == (n is not None)]
        variants: dict[str, set[str]] = {}
        for r in rows:
            if r.group and (r, n) in present:
                slot, _, variant = r.group.partition(":")
                variants.setdefault(slot, set()).add(variant)
        for slot, held in variants.items():
            if len(held) > 1:
                raise UsageError(f"--preset {p.name}: layer {n} holds both {' and '.join(sorted(held))} {slot} tensors")
        for r in rows:
            if (r, n) in present:
                continue
            if r.group:
                slot, _, variant = r.group.partition(":")
                chosen = variants.get(slot)
                first = None if slot.endswith("?") else _first_variant(rows, slot)  # "slot?": may hold none
                if chosen is None and first != variant or chosen and variant not in chosen:
                    continue
            binding = {"n": n} if n is not None else {}
            name = fill(r.other[0] if towards else r.hf_names[0], binding)
            if r.tied_to and (shape is None or shape.tied is not False):
                tied = by_key.get(r.tied_to)
                if not towards and tied is not None and (shape is None or shape.tied is None):
                    raise UsageError(f"--preset {p.name}: the checkpoint lacks {name!r}, and no config.json says "
                                     f"whether it is tied to {r.tied_to!r} ({p.other_side} keeps both); pass "
                                     "--hf-assets DIR with the model's config.json")
                if not towards and shape is not None and shape.tied and tied is not None:
                    new = fill(r.other[0], binding)
                    added.append(Source(tied.origin, dataclasses.replace(tied.entry, key=new, path=(new,))))
                continue
            missing.append(name)
    if missing:
        raise UsageError(f"--preset {p.name}: the checkpoint lacks {len(missing)} keys of the model"
                         f"{f' ({layers} layers, from {shape.source})' if layers and shape else ''}: "
                         f"{listed(missing)}")
    return added


def buffers(p: Preset, present: set[tuple[Row, str | None]], shape: ModelShape | None) -> list[Source]:
    """The preset's buffers at their initial value, one in each layer that holds them (its group's variant, or
    any tensor where it names no group), for an import towards the other side."""
    layers = sorted({int(n) for _, n in present if n is not None})
    held = {(r.group, n) for r, n in present}
    out: list[Source] = []
    for b in p.buffers:
        for n in [str(i) for i in layers] if "{n}" in b.other else [None]:
            if b.group is not None and (b.group, n) not in held:
                continue
            name = fill(b.other, {"n": n} if n is not None else {})
            if shape is None:
                raise UsageError(f"--preset {p.name}: {name!r} is sized by the model's config; pass --hf-assets DIR "
                                 "with the model's config.json")
            dims = tuple(shape.count(c, f"{name!r} ({p.other_side}'s model holds it)") for c in b.shape)
            out.append(Source(name, zeros(name, by_name(b.dtype), dims)))
    return out


def _first_variant(rows: list[Row], slot: str) -> str:
    return next(r.group.partition(":")[2] for r in rows if r.group and r.group.partition(":")[0] == slot)

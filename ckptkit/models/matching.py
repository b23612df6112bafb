"""A preset's table as regular expressions per side (:class:`NameTable`), and what follows from it for keys
the table does not know: which of some presets knows the most of them, and the advice a refusal gives."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .completeness import listed
from .preset import Preset, Row
from .wrappers import RECOMPUTED

__all__ = ["Match", "NameTable", "advice", "nearest", "pattern", "unknown_keys"]

_SHOWN = 8


def pattern(name: str) -> re.Pattern:
    """A table name as a regular expression: each ``{x}`` placeholder matches a number, captured as ``x``."""
    text = re.escape(name)
    for ph in re.findall(r"\\\{(\w+)\\\}", text):
        text = text.replace(f"\\{{{ph}\\}}", f"(?P<{ph}>\\d+)", 1)
    return re.compile(text)


@dataclass(frozen=True)
class Match:
    """A key matched to a row: the part of the row's names it is, and the numbers its placeholders took."""

    row: Row
    part: int
    binding: dict[str, str]


class NameTable:
    """A preset's rows as regular expressions, per side."""

    def __init__(self, p: Preset) -> None:
        self.hf = [(pattern(n), r, i) for r in p.rows if not r.read_only for i, n in enumerate(r.hf_names)]
        self.other = [(pattern(n), r, i if r.hf_fuses else 0) for r in p.rows for i, n in enumerate(r.other)]
        self.dropped = [pattern(d) for d in (*p.dropped, *(b.other for b in p.buffers))]
        self.refused = [(pattern(n), why) for n, why in p.refuse]

    @staticmethod
    def find(side: list, key: str) -> Match | None:
        for regex, row, part in side:
            if m := regex.fullmatch(key):
                return Match(row, part, m.groupdict())
        return None


def unknown_keys(p: Preset, keys: Sequence[str], hf: bool = False) -> list[str]:
    """The keys that are none of ``p``'s names (its HF side when ``hf``) nor a buffer it leaves out."""
    table = NameTable(p)
    side = table.hf if hf else table.other
    return [k for k in keys if not (table.find(side, k) or any(d.fullmatch(k) for d in table.dropped))]


def nearest(keys: Sequence[str], presets: Sequence[Preset], hf: bool = False) -> tuple[Preset, list[str]]:
    """The preset of ``presets`` whose table knows the most of ``keys`` (the first on a tie), and the keys it
    does not know."""
    return min(((p, unknown_keys(p, keys, hf)) for p in presets), key=lambda s: len(s[1]))


def advice(p: Preset, unknown: Sequence[str], towards: bool, kin: Sequence[Preset] = ()) -> str:
    """What to do about keys that preset ``p``'s table does not know, naming the preset of ``kin`` (the presets
    of ``p``'s framework) that knows the most of them. Only what a consumer rebuilds itself
    (:data:`ckptkit.models.wrappers.RECOMPUTED`) may be left out: leaving out a weight gives a model that loads
    with that weight initialised afresh."""
    weights = [k for k in unknown if not RECOMPUTED.search(k)]
    if not weights:
        shown = ", ".join(f'"{k}": null' for k in unknown[:_SHOWN])
        return (f"they are not weights (the model recomputes them): leave them out with --key-map '{{{shown}}}'"
                + (f" (and the {len(unknown) - _SHOWN} others)" if len(unknown) > _SHOWN else ""))
    near, missing = nearest(weights, [q for q in kin if not q.identity] or [p], hf=not towards)
    closest = ("no other preset knows more of them" if near is p else f"--preset {near.name} knows them"
               if not missing else f"the nearest, --preset {near.name}, does not know {len(missing)} of them")
    return (f"{listed(weights)} {'is a weight' if len(weights) == 1 else 'are weights'} of a family or variant "
            f"that --preset {p.name} does not map yet ({closest}); --preset none writes the names as they are")

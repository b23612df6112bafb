"""What a conversion wrote, or would write: :class:`Report`, and the :class:`Changes` made on the way."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..core.manifest import Format
from ..io.progress import count, human_size

__all__ = ["SCHEMA_VERSION", "Changes", "Report"]

SCHEMA_VERSION = 1
"""Of :meth:`Report.to_json`; raised when a field changes meaning or goes away."""


@dataclass(frozen=True)
class Report:
    """What a conversion wrote, or with ``dry_run`` would write; ``str(report)`` lists it readably."""

    source: str
    source_format: Format
    destination: str
    destination_format: Format
    tensors: int
    objects: int
    bytes: int
    files: int
    seconds: float
    world_size: int | None = None
    notes: tuple[str, ...] = ()
    written: tuple[tuple[str, int], ...] = ()
    """(path relative to the destination, bytes) of each output file."""
    renamed: tuple[tuple[str, str], ...] = ()
    """(old key, new key) for each key a key mapping renamed."""
    dropped: tuple[tuple[str, str], ...] = ()
    """(key, why) for each model tensor left out: tied weights, a mapping's leavings."""
    cast: tuple[tuple[str, str], ...] = ()
    """(key, dtype written) for each tensor written in another dtype than it was read in."""
    permuted: tuple[str, ...] = ()
    """Keys whose rows a key mapping reordered (a preset's rotary q/k order)."""
    dry_run: bool = False
    """Nothing was written: the report says what would be."""
    workers: int = 1
    """The processes that wrote (``--workers``)."""
    workers_why: str = ""
    """Why that many: ``--workers N``, or what ``--workers auto`` chose it from."""
    peak_memory: int | None = None
    """Peak resident bytes of the process (the command line's, from its start); None where not measured."""
    peak_memory_workers: int | None = None
    """Peak resident bytes of the largest other writer process, where there were some."""
    kept: tuple[str, ...] = ()
    """Files and folders of the destination an overwrite replaced that the output keeps (a model folder's
    tokenizer, configs, card), relative to it; a folder ends in ``/``."""
    removed: tuple[str, ...] = ()
    """Files and folders of the destination an overwrite replaced that are gone: neither written nor kept."""

    def lines(self) -> list[str]:
        ws = f" for {count(self.world_size, 'rank')}" if self.world_size else ""
        what = (f"{count(self.tensors, 'tensor')}, {count(self.objects, 'other entry', 'other entries')}, "
                f"{human_size(self.bytes)} in {count(self.files, 'file')}")
        peak = f", peak memory {human_size(self.peak_memory)}" if self.peak_memory else ""
        if self.peak_memory_workers:
            peak += f" (each other writer at most {human_size(self.peak_memory_workers)})"
        out = [f"{self.source} ({self.source_format.value}) -> "
               f"{self.destination} ({self.destination_format.value}{ws})",
               f"  would write {what} (dry run: nothing written)" if self.dry_run
               else f"  {what}, {self.seconds:.2f} s{peak}"]
        shown = self.written if self.dry_run else self.written[:_FILES_SHOWN]
        if shown:
            width = max(len(name) for name, _ in shown)
            out.append("  files:" if self.dry_run else "  wrote:")
            out += [f"    {name:<{width}}  {human_size(n):>8}" for name, n in shown]
            if len(self.written) > len(shown):
                out.append(f"    ... and {count(len(self.written) - len(shown), 'more file')}")
        reordered = set(self.permuted)
        out += _listing("renamed", [(old, new, "q/k rows reordered (rotary)" if new in reordered else "")
                                    for old, new in self.renamed])
        out += _listing("left out", [(key, "", why) for key, why in self.dropped])
        by_dtype: dict[str, list[tuple[str, str, str]]] = {}
        for key, dtype in self.cast:
            by_dtype.setdefault(dtype, []).append((key, "", ""))
        for dtype, keys in by_dtype.items():
            out += [f"  written as {dtype}: all {len(keys)} tensors"] if len(keys) == self.tensors else \
                _listing(f"written as {dtype}", keys)
        for verb, done, names in (("remove", "removed", self.removed), ("keep", "kept", self.kept)):
            if names:
                out.append(f"  {f'would {verb}' if self.dry_run else done} of the destination replaced: "
                           + _names(names))
        if self.workers_why:
            out.append(f"  workers: {self.workers} ({self.workers_why})")
        out += [f"  note: {n}" for n in self.notes]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> dict[str, Any]:
        """The report as JSON data, :data:`SCHEMA_VERSION` 1: these fields exactly."""
        return {"schema_version": SCHEMA_VERSION, "source": self.source, "source_format": self.source_format.value,
                "destination": self.destination, "destination_format": self.destination_format.value,
                "world_size": self.world_size, "dry_run": self.dry_run, "tensors": self.tensors,
                "objects": self.objects, "bytes": self.bytes,
                "files": [{"path": name, "bytes": n} for name, n in self.written],
                "renamed": [{"key": old, "to": new, "rows_reordered": new in self.permuted}
                            for old, new in self.renamed],
                "left_out": [{"key": key, "why": why} for key, why in self.dropped],
                "cast": [{"key": key, "dtype": dtype} for key, dtype in self.cast], "notes": list(self.notes),
                "workers": self.workers, "workers_why": self.workers_why, "seconds": round(self.seconds, 3),
                "peak_memory_bytes": self.peak_memory, "peak_memory_workers_bytes": self.peak_memory_workers,
                "kept": list(self.kept), "removed": list(self.removed)}


_FILES_SHOWN = 12
_LAYER = re.compile(r"(?<=\.)\d+(?=\.)")


_NAMES_SHOWN = 20


def _names(names: tuple[str, ...]) -> str:
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    return ", ".join(names[:_NAMES_SHOWN]) + more


def _listing(title: str, rows: list[tuple[str, str, str]]) -> list[str]:
    """(key, new key or "", why) ``rows`` under ``title``: one line for all layers alike (``layers.N.``), with a
    count, new keys lined up."""
    if not rows:
        return []
    grouped: dict[tuple[str, str, str], int] = {}
    for key, new, why in rows:
        pattern = (_LAYER.sub("N", key), _LAYER.sub("N", new), why)
        grouped[pattern] = grouped.get(pattern, 0) + 1
    width = max(len(key) for key, _, _ in grouped)
    lines = [f"  {title} ({len(rows)} key{'s' * (len(rows) != 1)}):"]
    for (key, new, why), n in grouped.items():
        text = f"{key:<{width}} -> {new}" if new else key
        lines.append(f"    {text}" + (f" (x{n})" if n > 1 else "") + (f": {why}" if why else ""))
    return lines


@dataclass(frozen=True)
class Changes:
    """What happened to the model's keys and dtypes before writing, as :class:`Report` lists it."""

    renamed: tuple[tuple[str, str], ...] = ()
    dropped: tuple[tuple[str, str], ...] = ()
    cast: tuple[tuple[str, str], ...] = ()
    permuted: tuple[str, ...] = ()

"""What a DCP directory holds beside its chunked tensors, as :mod:`ckptkit.formats.dcp` reads and writes it:
the empty dicts torch records in ``planner_data``, and entries a planner stored whole (``torch.save`` bytes);
and rank files that end before the entries a part read left unread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..codecs.dcp_metadata import EMPTY_MARK
from ..core.manifest import ObjectEntry, TensorEntry, TensorRef, key_of
from ..core.tree import flatten, from_dcp_path
from ..errors import CheckpointError
from .base import is_empty_container, object_value

__all__ = ["UNREAD_DAMAGE", "empty_containers", "empty_dict", "open_whole_entries", "short_files"]

UNREAD_DAMAGE = "damaged, not read"
"""A :attr:`Manifest.details` fact: damage in entries a part read left unread (a rank file that ends before
entries ``.metadata`` places in it), for the report."""


def empty_dict(o: ObjectEntry) -> bool:
    """Whether ``o`` is an empty dict, which DCP records in ``planner_data`` rather than as an entry."""
    return is_empty_container(o) and isinstance(o.value, dict)


def empty_containers(paths: dict, entries: dict) -> list[ObjectEntry]:
    """The empty dicts ``planner_data`` records beside the entries (see :data:`EMPTY_MARK`). Any other
    path there that names no entry is ignored, as torch's loaders ignore it."""
    found = []
    for key, path in paths.items():
        if key in entries or not isinstance(path, tuple) or not path or type(path[-1]) is not EMPTY_MARK or path[-1]:
            continue
        where = from_dcp_path(path[:-1])
        if not all(type(k) in (str, int) for k in path[:-1]) or key_of(where) != key:
            raise ValueError(f"key {key!r:.60} records an empty dict at {list(path)!r:.80}, not at its path")
        found.append(ObjectEntry(key, where, {}))
    return found


def open_whole_entries(objects: list[ObjectEntry]) -> tuple[list[TensorEntry], list[ObjectEntry]]:
    """The tensors inside entries DCP stored whole, as entries of their own, and the other entries.

    A planner with ``flatten_state_dict=False`` stores ``{"model": model.state_dict(), ...}`` as one bytes entry
    per top-level key: ``model``'s tensors lie in its ``torch.save`` bytes, where torch's loader finds them.
    Opened, they stream like any other tensor and the model rule sees them. An entry that holds no tensor stays
    whole (its bytes are copied verbatim); one that cannot be decoded too, for the writer to name its fault."""
    tensors: list[TensorEntry] = []
    kept: list[ObjectEntry] = []
    for o in objects:
        try:
            leaves = list(flatten(object_value(o), lambda v: isinstance(v, TensorRef), o.path))
        except CheckpointError:
            leaves = []
        if not any(isinstance(leaf, TensorRef) for _, leaf in leaves):
            kept.append(o)
            continue
        tensors += [leaf.as_entry(p) for p, leaf in leaves if isinstance(leaf, TensorRef)]
        kept += [ObjectEntry(key_of(p), p, leaf) for p, leaf in leaves if not isinstance(leaf, TensorRef)]
    return tensors, kept


def short_files(root: Path, storage: dict[tuple[str, tuple | None], Any], read: set[str]) -> list[str]:
    """Rank files that end before entries ``.metadata`` places in them, among the entries a part read left
    unread (those it read were checked as they were read): one line each, naming the file and an entry."""
    ends: dict[str, tuple[int, str]] = {}  # file: its furthest end, and the key of the entry there
    for (key, _), info in storage.items():
        if key in read:
            continue
        try:
            end, name = int(info.offset) + int(info.length), str(info.relative_path)
        except (AttributeError, TypeError, ValueError):
            continue  # what a full read refuses; unread here
        if end > ends.get(name, (-1, ""))[0]:
            ends[name] = (end, key)
    found = []
    for name, (end, key) in sorted(ends.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            continue  # what a full read refuses
        try:
            size = (root / name).stat().st_size
        except OSError:
            found.append(f"{name}, where .metadata places {key!r} and more, is missing: torch's load of that state "
                         "would fail")
            continue
        if size < end:
            found.append(f"{name} ends at byte {size}, but .metadata places {key!r} up to byte {end} (truncated?): "
                         "torch's load of that state would fail")
    return found

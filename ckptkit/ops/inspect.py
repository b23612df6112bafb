"""What a checkpoint holds, as JSON data (``--json``) or as text: sizes, parameters, the dtype mix, and a table per
module (``--depth``) or per tensor, optionally narrowed by ``--filter``.

The JSON form (:data:`SCHEMA_VERSION`) holds numbers as numbers and every non-tensor value as JSON: plain data
as itself, anything else as a typed description (``{"type": "tensor", "dtype": ..., "shape": ...}``,
``{"type": "bytes", "length": ...}``, ``{"type": "object", "class": ..., "state": ...}``), never a Python repr.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..codecs.pickle_read import Call, Record, Ref
from ..core.dtypes import DType
from ..core.manifest import Manifest, ObjectEntry, TensorEntry, TensorRef
from ..errors import CheckpointError, UsageError
from ..formats import LocalOptions, locate, object_value
from ..io.progress import count, human_size
from ..io.storage import storage_at
from ..models.detect import Detected, detect_family
from .select import select_model

__all__ = ["SCHEMA_VERSION", "family_of", "human_count", "inspect", "is_buffer", "json_value", "render", "summary"]

SCHEMA_VERSION = 1
"""Of :func:`summary`; raised when a field changes meaning or goes away."""
_VALUE_WIDTH = 100


def inspect(path: Path | str, *, local: LocalOptions | None = None, storage_options: dict | None = None) -> Manifest:
    """The manifest of the checkpoint at ``path``: format, tensors with their chunks, other entries.

    ``local`` says how to read a LOCAL checkpoint (see :func:`ckptkit.convert`). A URL's checkpoint is read
    by its headers alone, with range requests; ``storage_options`` go to its filesystem. A run directory of
    :func:`ckptkit.save` gives the step its ``latest`` names (as :func:`ckptkit.convert` reads it), and the
    manifest's details say so.

    Args:
        path: The checkpoint: a file, a directory or a URL.
        local: How to read a LOCAL checkpoint.
        storage_options: Keyword arguments of the filesystem of a URL.

    Returns:
        The checkpoint's :class:`ckptkit.Manifest`: every tensor as byte spans in its files, and the other
        entries. No tensor byte has been read.

    Raises:
        FormatError: ``path`` is no checkpoint ckptkit knows, or a file is not what its format promises.
        IncompleteCheckpointError: A rank file, chunk or shard is missing, or chunks overlap.
        UnsafeCheckpointError: A pickle names a global outside the allow-list.
    """
    found = locate(storage_at(path, storage_options)[1], local)
    manifest = found.reader.read(found.path)
    if found.note is None:
        return manifest
    return dataclasses.replace(manifest, details=(("read", found.note.removeprefix("read ")), *manifest.details))


def human_count(n: int) -> str:
    """A parameter count as people say it: ``950``, ``124M``, ``1.2B``."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 99.95 else f"{value:.0f}{unit}"
    return str(n)


def json_value(value: Any) -> Any:
    """``value`` as JSON data: plain data as itself, anything else as a typed description."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"type": "float", "value": str(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"type": "bytes", "length": len(value)}
    if isinstance(value, complex):
        return {"type": "complex", "real": json_value(value.real), "imag": json_value(value.imag)}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"type": "set", "items": [json_value(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: json_value(v) for k, v in value.items()}
        return {"type": "dict", "items": [[json_value(k), json_value(v)] for k, v in value.items()]}
    if isinstance(value, TensorRef):
        return {"type": "tensor", "dtype": value.dtype.name, "shape": list(value.shape)}
    if isinstance(value, DType):
        return {"type": "dtype", "name": value.name}
    if isinstance(value, Ref):
        return {"type": "global", "name": f"{value.module}.{value.name}"}
    if isinstance(value, Call):
        return {"type": "call", "function": f"{value.func.module}.{value.func.name}", "args": json_value(value.args)}
    if isinstance(value, Record):
        name = value._pickle_name
        return {"type": "object", "class": f"{name.module}.{name.name}", "state": json_value(dict(vars(value)))}
    return {"type": type(value).__name__}


def _value(entry: ObjectEntry) -> Any:
    try:
        return json_value(object_value(entry))
    except CheckpointError as e:  # a Lightning meta.pt with classes off the allow-list: shown, not run
        return {"type": "unreadable", "error": str(e)}


_BUFFER_NAMES = re.compile(r"(^|\.)(running_mean|running_var|inv_freq|masked_bias)$")
"""Floating tensors that modules register as buffers under these names (BatchNorm's statistics, rotary
frequencies, GPT-2's masked_bias): state, not weights, whatever the model."""


def is_buffer(t: TensorEntry) -> bool:
    """Whether the state-dict tensor ``t`` is a module's buffer rather than a parameter, as far as a checkpoint
    tells: a parameter that trains holds floating values, so an integer or bool tensor is a buffer
    (``position_ids``, ``num_batches_tracked``, attention masks), and a few floating buffers are known by name.

    Args:
        t: a tensor of a checkpoint's manifest.

    Returns:
        True for a buffer. A floating buffer under another name counts as a parameter; quantized weights
        stored as integers (bitsandbytes' packed 4-bit) count as buffers.
    """
    return t.dtype.kind not in ("float", "complex") or bool(_BUFFER_NAMES.search(t.key))


def _parameters(m: Manifest, keep: set[str]) -> tuple[int, int] | None:
    """Elements of the model part's parameters and buffers (tensors in ``keep``), or None where the checkpoint has no
    model part."""
    try:
        chosen = select_model(m).saved_keys
    except UsageError:
        return None
    by_key = {t.key: t for t in m.tensors}
    model = [by_key[saved] for _, saved in chosen if saved in keep]
    buffers = sum(t.numel for t in model if is_buffer(t))
    return sum(t.numel for t in model) - buffers, buffers


def _modules(entries: list[TensorEntry | ObjectEntry], depth: int) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for e in entries:
        name = ".".join(e.key.split(".")[:depth])
        row = rows.setdefault(name, {"name": name, "tensors": 0, "parameters": 0, "buffers": 0, "bytes": 0,
                                     "objects": 0})
        if isinstance(e, TensorEntry):
            row["tensors"] += 1
            row["buffers" if is_buffer(e) else "parameters"] += e.numel
            row["bytes"] += e.nbytes
        else:
            row["objects"] += 1
    return list(rows.values())


def summary(m: Manifest, *, depth: int | None = None, filter: str | None = None,
            family: tuple[str | None, str] | None = None) -> dict[str, Any]:
    """The manifest as JSON data: ``filter`` (a regular expression searched in each key) narrows the tensors and
    entries, ``depth`` adds a table of modules (keys cut to their first ``depth`` segments), ``family`` (the
    preset ``--preset auto`` would use, and why: :func:`family_of`) is shown as given."""
    try:
        pattern = re.compile(filter) if filter is not None else None
    except re.error as e:
        raise UsageError(f"--filter {filter!r}: not a regular expression ({e})") from None
    if depth is not None and depth < 1:
        raise UsageError(f"--depth must be 1 or more, got {depth}")
    tensors = [t for t in m.tensors if pattern is None or pattern.search(t.key)]
    objects = [o for o in m.objects if pattern is None or pattern.search(o.key)]
    by_dtype: dict[str, dict[str, int]] = {}
    for t in tensors:
        row = by_dtype.setdefault(t.dtype.name, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += t.nbytes
    counts = _parameters(m, {t.key for t in tensors})
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "path": m.root,
        "format": m.format.value,
        "world_size": m.world_size,
        "filter": filter,
        "tensors": len(tensors),
        "tensors_in_checkpoint": len(m.tensors),
        "bytes": sum(t.nbytes for t in tensors),
        "elements": sum(t.numel for t in tensors),
        "parameters": None if counts is None else counts[0],
        "buffers": None if counts is None else counts[1],
        "dtypes": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1]["bytes"])),
        "details": dict(m.details),
        **({"family": {"preset": family[0], "why": family[1]}} if family is not None else {}),
        "entries": [{"key": t.key, "dtype": t.dtype.name, "shape": list(t.shape), "elements": t.numel,
                     "bytes": t.nbytes,
                     "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": Path(c.span.file).name}
                                for c in t.chunks], **({"file": t.sidecar} if t.sidecar else {})}
                    for t in tensors],
        "objects": [{"key": o.key, "value": _value(o), **({"file": o.sidecar} if o.sidecar else {})}
                    for o in objects],
    }
    if depth is not None:
        out["depth"] = depth
        out["modules"] = _modules([*tensors, *objects], depth)
    return out


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return ["  " + "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths,
                                                                                                     strict=True)))
            .rstrip() for r in (header, *rows)]


def _short(value: Any) -> str:
    import json

    text = json.dumps(value, separators=(", ", ": "))
    return text if len(text) <= _VALUE_WIDTH else text[:_VALUE_WIDTH - 3] + "..."


def render(s: dict[str, Any]) -> str:
    """:func:`summary` as text: a header, the dtype mix, the format's facts, then a table of modules, or of
    tensors followed by the other entries."""
    ws = f", world size {s['world_size']}" if s["world_size"] else ""
    filtered = (f" (--filter {s['filter']!r}: {s['tensors']} of {count(s['tensors_in_checkpoint'], 'tensor')})"
                if s["filter"] is not None else "")
    n = s["parameters"]
    params = "" if n is None else f"; model: {n:,} parameters" + (f" ({human_count(n)})" if n >= 1000 else "")
    if s["buffers"]:
        params += f" + {s['buffers']:,} in buffers"
    lines = [f"{s['path']}: {s['format']}{ws}{filtered}",
             f"{count(s['tensors'], 'tensor')}, {human_size(s['bytes'])}{params}; "
             f"{count(len(s['objects']), 'other entry', 'other entries')}"]
    if s["dtypes"]:
        total = s["bytes"] or 1
        lines.append("dtypes: " + ", ".join(f"{name} {100 * d['bytes'] / total:.3g}% ({count(d['tensors'], 'tensor')})"
                                           for name, d in s["dtypes"].items()))
    lines += [f"{k}: {v}" for k, v in s["details"].items()]
    if s.get("family"):
        family = s["family"]
        lines.append(f"family: {family['preset']} ({family['why']}); --preset auto uses it" if family["preset"]
                     else f"family: none recognised ({family['why']})")
    if "modules" in s:  # one row a module: its tensors and other entries counted, not listed
        modules = [(r["name"], f"{r['tensors']:,}", f"{r['parameters']:,}", f"{r['buffers']:,}",
                    human_size(r["bytes"]), f"{r['objects']:,}") for r in s["modules"]]
        return "\n".join(lines + _table(("module", "tensors", "parameters", "buffers", "bytes", "other entries"),
                                        modules, {1, 2, 3, 4, 5}))
    if s["entries"]:
        rows = [(e["key"], e["dtype"], str(e["shape"]).replace(" ", ""), human_size(e["bytes"]),
                 f"{len(e['chunks'])} chunk{'s' * (len(e['chunks']) != 1)}" + _in(e)) for e in s["entries"]]
        lines += _table(("tensor", "dtype", "shape", "bytes", "chunks"), rows, {3})
    lines += [f"  {o['key']} = {_short(o['value'])}" + _in(o) for o in s["objects"]]
    return "\n".join(lines)


def _in(entry: dict[str, Any]) -> str:
    """Where an entry lives when not in the checkpoint's own files (Lightning's meta.pt)."""
    return f"  ({entry['file']})" if "file" in entry else ""


def family_of(manifest: Manifest, path: Path | str) -> Detected:
    """What ``--preset auto`` would do with the checkpoint at ``path`` (for ``inspect``): its model part's keys
    and the ``config.json`` beside it. A family mismatch is reported, not raised."""
    from ..models.evidence import read_model_config

    local = Path(path)
    where = (local if local.is_dir() else local.parent) / "config.json"
    try:
        keys = [t.key for t in select_model(manifest).tensors]
        config = read_model_config(where) if where.is_file() else {}
    except CheckpointError as e:
        return Detected(None, str(e))
    model_type = config.get("model_type")
    try:
        return detect_family(keys, model_type if isinstance(model_type, str) else None, str(where))
    except UsageError as e:
        return Detected(None, f"family mismatch: {e}")

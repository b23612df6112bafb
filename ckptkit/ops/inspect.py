"""What a checkpoint holds, as a dict (``--json``) or as text."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ..core.manifest import Manifest, ObjectEntry
from ..errors import CheckpointError
from ..formats import LocalOptions, detect, object_value
from ..io.remote import as_path

__all__ = ["inspect", "render", "summary"]


def inspect(path: Path | str, *, local: LocalOptions | None = None, storage_options: dict | None = None) -> Manifest:
    """The manifest of the checkpoint at ``path``: format, tensors with their chunks, other entries.
    ``local`` says how to read a LOCAL checkpoint (see :func:`ckptkit.convert`). A URL's checkpoint is read
    by its headers alone, with range requests; ``storage_options`` go to its filesystem."""
    path = as_path(path, storage_options)
    return detect(path, local).read(path)


def summary(m: Manifest) -> dict[str, Any]:
    return {
        "path": m.root,
        "format": m.format.value,
        "world_size": m.world_size,
        "tensors": len(m.tensors),
        "bytes": m.nbytes,
        "dtypes": dict(Counter(t.dtype.name for t in m.tensors)),
        "details": dict(m.details),
        "entries": [{"key": t.key, "dtype": t.dtype.name, "shape": list(t.shape),
                     "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": Path(c.span.file).name}
                                for c in t.chunks], **({"file": t.sidecar} if t.sidecar else {})}
                    for t in m.tensors],
        "objects": [{"key": o.key, "value": _value(o), **({"file": o.sidecar} if o.sidecar else {})}
                    for o in m.objects],
    }


def _value(entry: ObjectEntry) -> str:
    try:
        return repr(object_value(entry))[:200]
    except CheckpointError as e:  # a Lightning meta.pt with classes off the allow-list: shown, not run
        return f"<not readable as data: {e}>"


def render(s: dict[str, Any]) -> str:
    ws = f", world size {s['world_size']}" if s["world_size"] else ""
    dts = ", ".join(f"{k} x{v}" for k, v in s["dtypes"].items())
    lines = [f"{s['path']}: {s['format']}{ws}",
             f"{s['tensors']} tensors, {s['bytes']:,} bytes ({dts or 'none'}); {len(s['objects'])} other entries"]
    lines += [f"{k}: {v}" for k, v in s["details"].items()]
    width = max((len(e["key"]) for e in s["entries"]), default=0)
    for e in s["entries"]:
        chunks = len(e["chunks"])
        lines.append(f"  {e['key']:<{width}}  {e['dtype']:<14} {str(e['shape']):<20} "
                     f"{chunks} chunk{'s' * (chunks != 1)}" + (f"  ({e['file']})" if "file" in e else ""))
    lines += [f"  {o['key']} = {o['value']}" + (f"  ({o['file']})" if "file" in o else "") for o in s["objects"]]
    return "\n".join(lines)

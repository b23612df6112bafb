"""Compare two checkpoints of any formats tensor by tensor, streaming, bit for bit."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.manifest import Format, Manifest, TensorEntry, map_tensor_refs
from ..core.plan import Region, row_blocks
from ..errors import UsageError
from ..formats import LocalOptions, detect, object_value
from ..io.execute import DEFAULT_MAX_MEMORY
from ..io.progress import progress_bar
from ..io.publish import resolve
from ..io.remote import as_path, is_url
from ..io.sources import Files, read_region
from . import checksums
from .select import select_model

__all__ = ["Difference", "VerifyReport", "first_difference", "verify"]


@dataclass(frozen=True)
class Difference:
    key: str
    what: str


@dataclass(frozen=True)
class VerifyReport:
    a: str
    b: str | None
    """None when ``a`` was checked against its own ``ckptkit.json`` (or only read through)."""
    format_a: Format
    format_b: Format | None
    tensors: int
    objects: int
    bytes: int
    differences: tuple[Difference, ...]
    checksums: bool = False
    """Whether ``a`` alone was checked against checksums (its ``ckptkit.json``) rather than just read."""

    @property
    def ok(self) -> bool:
        return not self.differences

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(format_a=self.format_a.value, format_b=self.format_b.value if self.format_b else None, ok=self.ok)
        return d


def first_difference(a: TensorEntry, b: TensorEntry, files: Files, budget: int) -> str | None:
    """None when ``a`` and ``b`` hold the same dtype, shape and bytes; else what differs first."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    for block_a in row_blocks(Region.whole(a), max(1, budget // 2)):
        block_b = Region(b, block_a.offsets, block_a.sizes)
        x, y = read_region(block_a, files), read_region(block_b, files)
        if x != y:
            at = _first_mismatch(memoryview(x), memoryview(y)) // a.dtype.itemsize
            row = block_a.offsets[0] if block_a.offsets else 0
            return f"bytes differ from element {at} of the row block starting at row {row}"
    return None


def _first_mismatch(x: memoryview, y: memoryview) -> int:
    lo, hi = 0, len(x)
    while hi - lo > 64:  # bisect with memcmp-speed slice compares, then scan the last few bytes
        mid = (lo + hi) // 2
        if x[lo:mid] != y[lo:mid]:
            hi = mid
        else:
            lo = mid
    return next(i for i in range(lo, hi) if x[i] != y[i])


def _plain(value: Any, files: Files) -> Any:
    """An object with its tensor leaves read into (dtype, shape, bytes), so == compares bits."""
    return map_tensor_refs(value, lambda ref: (ref.dtype.name, ref.shape,
                                               bytes(read_region(Region.whole(ref.as_entry(("t",))), files))))


def _entries(manifest: Manifest, model_only: bool) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    if model_only:
        return {t.key: t for t in select_model(manifest).tensors}, {}
    return {t.key: t for t in manifest.tensors}, {o.key: o for o in manifest.objects}


def verify(a: Path | str, b: Path | str | None = None, *, model_only: bool = False,
           max_memory: int = DEFAULT_MAX_MEMORY, progress: bool = False,
           local: LocalOptions | None = None, storage_options: dict | None = None) -> VerifyReport:
    """Compare every key, dtype, shape and byte of ``a`` and ``b``.

    ``model_only`` compares just the model part of each, named as ``export_hf`` names it, so that a training
    checkpoint can be checked against its Hugging Face export. ``local`` applies to a LOCAL side.

    Without ``b``, ``a`` is checked against its own ``ckptkit.json`` (the checksums ``ckptkit.save``
    recorded; a run directory means the step ``latest`` names); without one, every chunk and entry of ``a``
    is read through, which finds what is missing or unreadable. A damaged ``ckptkit.json`` raises.
    Either side may be a URL; ``storage_options`` go to its filesystem.
    """
    pa = as_path(a, storage_options)
    if b is None:
        if model_only:
            raise UsageError("--model-only compares two checkpoints; with one, all of it is checked")
        return _verify_alone(pa, max_memory, progress, local)
    pb = as_path(b, storage_options)
    ma, mb = detect(pa, local).read(pa), detect(pb, local).read(pb)
    ta, oa = _entries(ma, model_only)
    tb, ob = _entries(mb, model_only)
    diffs = [Difference(k, f"only in {a}") for k in {**ta, **oa} if k not in tb and k not in ob]
    diffs += [Difference(k, f"only in {b}") for k in {**tb, **ob} if k not in ta and k not in oa]
    common = [k for k in ta if k in tb]
    total = sum(ta[k].nbytes for k in common)
    with Files() as files, progress_bar(total, "verify", progress) as update:
        for k in common:
            what = first_difference(ta[k], tb[k], files, max_memory)
            if what:
                diffs.append(Difference(k, what))
            update(ta[k].nbytes)
        for k in (k for k in oa if k in ob):
            va, vb = _plain(object_value(oa[k]), files), _plain(object_value(ob[k]), files)
            if va != vb:
                diffs.append(Difference(k, f"value {va!r:.80} vs {vb!r:.80}"))
        for k in (k for k in ta if k in ob):
            diffs.append(Difference(k, f"a tensor in {a}, a non-tensor entry in {b}"))
        for k in (k for k in oa if k in tb):
            diffs.append(Difference(k, f"a non-tensor entry in {a}, a tensor in {b}"))
    return VerifyReport(str(a), str(b), ma.format, mb.format, len(common), len([k for k in oa if k in ob]), total,
                        tuple(diffs))


def _verify_alone(path: Path, max_memory: int, progress: bool, local: LocalOptions | None) -> VerifyReport:
    ckpt = path if is_url(path) else resolve(path)  # run directories (latest) are ckptkit.save's, local ones
    manifest = detect(ckpt, local).read(ckpt)
    record = checksums.read_record(ckpt)
    total = manifest.nbytes + sum(o.blob.length for o in manifest.objects if o.blob)
    with progress_bar(total, "verify", progress) as update:
        if record is not None:
            found = [Difference(m.key, m.what)
                     for m in checksums.check(record, manifest, ckpt, max_memory=max_memory, progress=update)]
        else:
            found = []
            with Files() as files:
                for t in manifest.tensors:
                    for block in row_blocks(Region.whole(t), max(1, max_memory)):
                        read_region(block, files)
                    update(t.nbytes)
                for o in manifest.objects:
                    _plain(object_value(o), files)  # decoded through the allow-list, tensors inside read
                    update(o.blob.length if o.blob else 0)
    return VerifyReport(str(ckpt), None, manifest.format, None, len(manifest.tensors), len(manifest.objects),
                        total, tuple(found), checksums=record is not None)

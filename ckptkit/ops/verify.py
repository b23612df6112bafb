"""Compare two checkpoints of any formats tensor by tensor, streaming: bit for bit, or by value within tolerances.

Bit for bit (the default), tensors compare as bytes in row blocks, with no torch. Where they differ, and always
under ``atol``/``rtol``, torch compares values in row blocks of at most ``max_memory`` bytes, both sides upcast
(float64, complex128) so that dtypes may differ. Each differing tensor is then described by numbers: the largest
absolute and relative differences, how many elements are off, and the first such element's index and values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.manifest import Format, Manifest, ObjectEntry, TensorEntry, map_tensor_refs
from ..core.plan import Region, row_blocks
from ..errors import UsageError
from ..formats import LocalOptions, Located, locate, object_value
from ..io.options import DEFAULT_MAX_MEMORY
from ..io.progress import count, human_size, progress_bar
from ..io.sources import Files, read_region
from ..io.storage import storage_at
from ..models.hfconfig import INPUT_EMBEDDINGS, tie_word_embeddings
from ..models.mapping import KeyMapping, Renames, parse_rename, rename_keys
from ..models.quantized import both_as_values
from . import checksums
from .select import model_keys, select_model

__all__ = ["SCHEMA_VERSION", "Difference", "VerifyReport", "compare_tensors", "first_difference", "verify"]

SCHEMA_VERSION = 1
"""Of :meth:`VerifyReport.to_json`; raised when a field changes meaning or goes away."""

Number = float | int | bool | complex


@dataclass(frozen=True)
class Difference:
    """One key that differs. For tensors of one shape, the numbers say by how much (None otherwise)."""

    key: str
    what: str
    """The difference in words."""
    max_abs_diff: float | None = None
    """Largest ``|a - b|``; inf where one side is NaN or infinite and the other is not."""
    max_rel_diff: float | None = None
    """Largest ``|a - b| / |b|`` (inf where ``b`` is 0 and ``a`` is not)."""
    mismatched: int | None = None
    """Elements off: outside ``atol + rtol * |b|``, or with other bits when comparing bit for bit."""
    total: int | None = None
    """Elements compared."""
    first_index: tuple[int, ...] | None = None
    """The first mismatched element's index, in row-major order."""
    value_a: Number | None = None
    value_b: Number | None = None
    """The values at ``first_index``."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "what": self.what, "max_abs_diff": _json_number(self.max_abs_diff),
                "max_rel_diff": _json_number(self.max_rel_diff), "mismatched": self.mismatched, "total": self.total,
                "first_index": list(self.first_index) if self.first_index is not None else None,
                "value_a": _json_number(self.value_a), "value_b": _json_number(self.value_b)}


def _json_number(x: Number | None) -> Any:
    """JSON has no NaN or infinities: those are the strings ``"nan"``, ``"inf"``, ``"-inf"``; complex numbers are
    ``[real, imaginary]``."""
    if isinstance(x, complex):
        return [_json_number(x.real), _json_number(x.imag)]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


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
    atol: float | None = None
    rtol: float | None = None
    """The tolerances of a numeric comparison; both None: bit for bit."""
    notes: tuple[str, ...] = field(default=())
    hint: str | None = None
    """What to try where nothing could be compared (no key on both sides), printed last."""

    @property
    def ok(self) -> bool:
        """Whether nothing differs."""
        return not self.differences

    @property
    def numeric(self) -> bool:
        """Whether values were compared within tolerances rather than bit for bit."""
        return self.atol is not None or self.rtol is not None

    def to_json(self) -> dict[str, Any]:
        """The report as JSON data, :data:`SCHEMA_VERSION` 1: these fields exactly."""
        return {"schema_version": SCHEMA_VERSION, "a": self.a, "b": self.b, "format_a": self.format_a.value,
                "format_b": self.format_b.value if self.format_b else None, "ok": self.ok, "checksums": self.checksums,
                "tensors": self.tensors, "objects": self.objects, "bytes": self.bytes, "atol": self.atol,
                "rtol": self.rtol, "notes": list(self.notes), "differences": [d.to_json() for d in self.differences],
                "hint": self.hint}

    def lines(self) -> list[str]:
        what = (f"{count(self.tensors, 'tensor')} ({human_size(self.bytes)}) and "
                f"{count(self.objects, 'other entry', 'other entries')}")
        if self.b is None:
            how = "checked against its ckptkit.json" if self.checksums else "read through (no ckptkit.json)"
            out = [f"{self.a} ({self.format_a.value}): {what} {how}", "ok" if self.ok else
                   f"{count(len(self.differences), 'difference')}:"]
            return out + [f"  {d.key}: {d.what}" for d in self.differences]
        how = f"within atol {self.atol or 0:g}, rtol {self.rtol or 0:g}" if self.numeric else "bit for bit"
        out = [f"{self.a} ({self.format_a.value}) vs {self.b} ({self.format_b.value if self.format_b else '?'}): "
               f"{what} compared {how}"]
        out += [f"  note: {n}" for n in self.notes]
        out.append("identical" if self.ok and not self.numeric else "equal" if self.ok else
                   f"{count(len(self.differences), 'difference')}:")
        out += [f"  {d.key}: {d.what}" for d in self.differences]
        if not self.numeric and any(d.what.startswith("dtype ") for d in self.differences):
            out.append("  (--atol/--rtol compare values across dtypes)")
        return out + ([f"hint: {self.hint}"] if self.hint else [])

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _block(region: Region, files: Files):
    """The region's elements as a torch tensor of its shape (a view of the bytes read)."""
    import torch

    data = read_region(region, files)
    dtype = _torch_dtype(region.entry.dtype.name)
    flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return flat.reshape(region.sizes)


def _wide(t):
    """Upcast for comparing: complex to complex128, everything else to float64."""
    import torch

    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def _bits(t):
    """Each element's bytes along a last dimension, for a bit-for-bit element compare."""
    import torch

    # torch views a 0-dim tensor as bytes only after it has a dimension to widen (AdamW's ``step``).
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(*t.shape, t.element_size())


def compare_tensors(a: TensorEntry, b: TensorEntry, files: Files, budget: int, *, atol: float | None = None,
                    rtol: float | None = None) -> Difference | None:
    """None when ``a`` equals ``b``: bit for bit when both tolerances are None, else by value within
    ``atol + rtol * |b|`` (NaN equals NaN) after upcasting both sides, whatever their dtypes. Else the difference,
    with numbers where the shapes agree. Bytes in memory stay within ``budget`` (row blocks)."""
    numeric = atol is not None or rtol is not None
    if a.shape != b.shape:
        return Difference(a.key, f"shape {list(a.shape)} vs {list(b.shape)}")
    if not numeric:
        if a.dtype != b.dtype:
            return Difference(a.key, f"dtype {a.dtype} vs {b.dtype}")
        if not _first_differing_block(a, b, files, budget):
            return None
    return _by_value(a, b, files, budget, atol or 0.0, rtol or 0.0, numeric)


def first_difference(a: TensorEntry, b: TensorEntry, files: Files, budget: int) -> str | None:
    """None when ``a`` and ``b`` hold the same dtype, shape and bytes; else what differs, in words."""
    found = compare_tensors(a, b, files, budget)
    return found.what if found else None


def _first_differing_block(a: TensorEntry, b: TensorEntry, files: Files, budget: int) -> bool:
    """Whether the bytes differ anywhere: compared as bytes, a row block at a time, without torch."""
    for block_a in row_blocks(Region.whole(a), max(1, budget // 2)):
        if read_region(block_a, files) != read_region(Region(b, block_a.offsets, block_a.sizes), files):
            return True
    return False


def _by_value(a: TensorEntry, b: TensorEntry, files: Files, budget: int, atol: float, rtol: float,
              numeric: bool) -> Difference | None:
    import torch

    # A block of n elements holds both sides' bytes, their upcast copies, the difference and a mask.
    per_element = a.dtype.itemsize + b.dtype.itemsize + 16 * 3 + 1
    block_bytes = max(1, budget * a.dtype.itemsize // per_element)
    mismatched, max_abs, max_rel = 0, 0.0, 0.0
    first: tuple[tuple[int, ...], Number, Number] | None = None
    for block_a in row_blocks(Region.whole(a), block_bytes):
        x, y = _block(block_a, files), _block(Region(b, block_a.offsets, block_a.sizes), files)
        wx, wy = _wide(x), _wide(y)
        both_nan = torch.isnan(wx) & torch.isnan(wy)
        same = (wx == wy) | both_nan
        gap = (wx - wy).abs().nan_to_num(nan=math.inf, posinf=math.inf)  # NaN against a number: infinitely off
        diff = torch.where(same, torch.zeros((), dtype=torch.float64), gap)
        rel = torch.where(diff == 0, diff, diff / wy.abs())
        if numeric:
            off = ~torch.isclose(wx, wy, rtol=rtol, atol=atol, equal_nan=True)
        else:  # bit for bit: -0.0 vs 0.0, or NaNs of other payloads, are off though their values compare equal
            off = (_bits(x) != _bits(y)).any(-1)
        count = int(off.sum())
        if diff.numel():
            max_abs, max_rel = max(max_abs, float(diff.max())), max(max_rel, float(rel.max()))
        if count and first is None:
            at = tuple(int(i) for i in torch.nonzero(off)[0]) if x.dim() else ()
            index = tuple(i + o for i, o in zip(at, block_a.offsets, strict=True))
            first = (index, x[at].item(), y[at].item())
        mismatched += count
    if not mismatched or first is None:
        return None
    index, va, vb = first
    how = f"outside atol {atol:g} + rtol {rtol:g}" if numeric else "differ bit for bit"
    dtypes = f" ({a.dtype} vs {b.dtype})" if a.dtype != b.dtype else ""
    what = (f"{mismatched} of {a.numel} elements {how}{dtypes}; max abs diff {max_abs:.6g}, max rel diff "
            f"{max_rel:.6g}; first at {list(index)}: {va!r} vs {vb!r}")
    return Difference(a.key, what, max_abs, max_rel, mismatched, a.numel, index, va, vb)


def _plain(value: Any, files: Files) -> Any:
    """An object with its tensor leaves read into (dtype, shape, bytes), so == compares bits."""
    return map_tensor_refs(value, lambda ref: (ref.dtype.name, ref.shape,
                                               bytes(read_region(Region.whole(ref.as_entry(("t",))), files))))


def _entries(manifest: Manifest, model_only: bool, strip_prefixes: tuple[str, ...],
             mapping: KeyMapping) -> tuple[dict[str, TensorEntry], dict[str, ObjectEntry], tuple[str, ...]]:
    """The tensors and objects to compare, by the names they are compared under, and notes on renames."""
    if model_only:
        sel = select_model(manifest, strip_prefixes=strip_prefixes)
        tensors: dict[str, TensorEntry] = {t.key: t for t in sel.tensors}
        objects: dict[str, ObjectEntry] = {}
    else:
        tensors, objects = {t.key: t for t in manifest.tensors}, {o.key: o for o in manifest.objects}
        prefixes = KeyMapping(renames=tuple((f"^{re.escape(p)}", "") for p in strip_prefixes))
        mapping = KeyMapping(renames=prefixes.renames + mapping.renames)
    if not mapping:
        return tensors, objects, ()
    names, notes = rename_keys([*tensors, *objects], mapping)
    return ({names[k] or k: t for k, t in tensors.items()}, {names[k] or k: o for k, o in objects.items()},
            tuple(f"{Path(manifest.root).name}: {n}" for n in notes))


def verify(a: Path | str, b: Path | str | None = None, *, model_only: bool = False, atol: float | None = None,
           rtol: float | None = None, strip_prefixes: Iterable[str] = (), renames: Renames = (),
           max_memory: int = DEFAULT_MAX_MEMORY, progress: bool = False,
           local: LocalOptions | None = None, storage_options: dict | None = None) -> VerifyReport:
    """Compare every key, shape and value of ``a`` and ``b``: bit for bit, or with ``atol``/``rtol`` by value
    (``|a - b| <= atol + rtol * |b|``, NaN equal to NaN) after upcasting, so that a bf16 export compares with its
    fp32 source.

    ``model_only`` compares just the model part of each, named as ``export_hf`` names it, so that a training
    checkpoint can be checked against its Hugging Face export. ``strip_prefixes`` and ``renames``
    (``'REGEX=REPLACEMENT'``, in order) rename both sides' keys first, so that ``model.w`` in a Lightning
    checkpoint compares with ``w``. ``local`` applies to a LOCAL side.

    Without ``b``, ``a`` is checked against its own ``ckptkit.json`` (the checksums ``ckptkit.save``
    recorded; a run directory means the step ``latest`` names); without one, every chunk and entry of ``a``
    is read through, which finds what is missing or unreadable. A damaged ``ckptkit.json`` raises.
    Either side may be a URL; ``storage_options`` go to its filesystem.

    Args:
        a: A checkpoint: a file, a directory or a URL.
        b: The checkpoint to compare ``a`` with; None checks ``a`` against its own ``ckptkit.json``.
        model_only: Compare only the model part of each, named as :func:`ckptkit.export_hf` names it.
        atol: Absolute tolerance of a comparison by value; None with ``rtol`` None: bit for bit.
        rtol: Relative tolerance of a comparison by value.
        strip_prefixes: Leading key prefixes stripped from both sides' keys.
        renames: ``'REGEX=REPLACEMENT'`` renames of both sides' keys, applied in order.
        max_memory: Bytes of tensor data held in memory at once.
        progress: Show a progress bar.
        local: How to read a LOCAL side.
        storage_options: Keyword arguments of the filesystem of a URL.

    Returns:
        The comparison: ``ok`` when nothing differs, else each difference with where and by how much.

    Raises:
        FormatError: A file is not what its format promises, or ``a``'s ``ckptkit.json`` is damaged.
        IncompleteCheckpointError: A rank file, chunk or shard is missing.
        UnsafeCheckpointError: A pickle names a global outside the allow-list.
        UsageError: Options of a comparison (``model_only``, ``atol``, ``rtol``, ``strip_prefixes``,
            ``renames``) are given without ``b``.
    """
    pa = storage_at(a, storage_options)[1]
    if b is None:
        _refuse_comparison_options(model_only=model_only, atol=atol, rtol=rtol, strip_prefixes=strip_prefixes,
                                   renames=renames)
        return _verify_alone(pa, max_memory, progress, local)
    mapping = KeyMapping(renames=tuple(parse_rename(r) if isinstance(r, str) else (r[0], r[1]) for r in renames))
    prefixes = tuple(strip_prefixes)
    fa, fb = locate(pa, local), locate(storage_at(b, storage_options)[1], local)
    model_only, auto = _model_only(model_only, fa, fb, str(a), str(b))
    ma, mb = (_read(f, model_only, prefixes) for f in (fa, fb))
    ta, oa, notes_a = _entries(ma, model_only, prefixes, mapping)
    tb, ob, notes_b = _entries(mb, model_only, prefixes, mapping)
    (ta, tb), as_values = both_as_values(ta, tb, (str(a), str(b)), atol is not None or rtol is not None)
    notes_a += as_values
    with Files() as files:
        notes_a += _written_once(ta, tb, str(a), fb.path, files, max_memory)
        notes_b += _written_once(tb, ta, str(b), fa.path, files, max_memory)
    common = [k for k in ta if k in tb]
    total = sum(ta[k].nbytes for k in common)
    diffs = _differences(str(a), str(b), (ta, oa), (tb, ob), max_memory, atol, rtol, progress)
    return VerifyReport(str(a), str(b), ma.format, mb.format, len(common), len([k for k in oa if k in ob]), total,
                        tuple(diffs), atol=atol, rtol=rtol,
                        notes=tuple(f.note for f in (fa, fb) if f.note) + auto + notes_a + notes_b,
                        hint=None if common or not (ta and tb) else _NO_KEY_IN_COMMON)


_NO_KEY_IN_COMMON = ("no tensor key is on both sides: --model-only compares a training checkpoint's model with an "
                     "export of it; --strip-prefix and --rename align other names")


def _model_only(asked: bool, fa: Located, fb: Located, a: str, b: str) -> tuple[bool, tuple[str, ...]]:
    """Whether the model parts alone are compared, and the note saying so where that was not asked: a Hugging
    Face folder holds a model and nothing else, so against any other checkpoint only its model compares."""
    if asked:
        return True, ()
    hf = [name for f, name in ((fa, a), (fb, b)) if f.reader.format is Format.HF]
    if len(hf) != 1:
        return False, ()
    other = b if hf[0] == a else a
    return True, (f"{hf[0]} is a Hugging Face model folder: the model part of {other} is compared with it (as "
                  "--model-only), its optimizer and other training state are not",)


def _read(found: Located, model_only: bool, prefixes: tuple[str, ...]) -> Manifest:
    """The manifest of the checkpoint ``found``: with ``model_only``, the model's chunks alone, as export_hf reads
    them."""
    wanted = model_keys(strip_prefixes=prefixes) if model_only else None
    return found.reader.read(found.path) if wanted is None else found.reader.read_part(found.path, wanted)


_HEAD = "lm_head.weight"


def _written_once(head_side: dict[str, TensorEntry], other: dict[str, TensorEntry], name: str, other_root: Path,
                  files: Files, max_memory: int) -> tuple[str, ...]:
    """Where ``lm_head.weight`` is on one side only and the other is an HF model whose config ties it (export-hf
    and ``save_pretrained`` write a tied head once): drop it from ``head_side`` when it equals that side's input
    embedding, which the other side holds, and say so; else leave it, to be reported as on one side only."""
    if _HEAD not in head_side or _HEAD in other:
        return ()
    config_file = (other_root if other_root.is_dir() else other_root.parent) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return ()
    tied, why = tie_word_embeddings(config) if isinstance(config, dict) else (None, "")
    embed = next((k for k in head_side if k.endswith(INPUT_EMBEDDINGS) and k in other), None)
    if not tied or embed is None:
        return ()
    diff = first_difference(head_side[_HEAD], head_side[embed], files, max_memory)
    if diff:
        return (f"{_HEAD} is only in {name}, where it differs from {embed} ({diff}): {config_file} ties the two "
                f"({why}), so that model would use {embed} as its head",)
    del head_side[_HEAD]
    return (f"{_HEAD} of {name} is not compared: it equals its {embed}, and {other_root} holds that once, as a tied "
            f"head is written ({config_file.name}: {why.removeprefix('config.json says ')})",)


def _refuse_comparison_options(*, model_only: bool, atol: float | None, rtol: float | None,
                               strip_prefixes: Iterable[str], renames: Renames) -> None:
    """Refuse the options of a comparison of two checkpoints, given with one, by their command-line names."""
    asked = [o for o, v in (("--model-only", model_only), ("--atol", atol is not None), ("--rtol", rtol is not None),
                            ("--strip-prefix", strip_prefixes), ("--rename", renames)) if v]
    if asked:
        raise UsageError(f"{', '.join(asked)} compare two checkpoints; with one, all of it is checked")


_Side = tuple[dict[str, TensorEntry], dict[str, ObjectEntry]]
"""A checkpoint's tensors and non-tensor entries, by key."""


def _differences(a: str, b: str, side_a: _Side, side_b: _Side, max_memory: int, atol: float | None,
                 rtol: float | None, progress: bool) -> list[Difference]:
    """Every difference between the entries of ``a`` and ``b``: keys on one side only, tensors (read in
    blocks of at most ``max_memory`` bytes), non-tensor values, and a key that is a tensor on one side only."""
    (ta, oa), (tb, ob) = side_a, side_b
    diffs = [Difference(k, f"only in {a}") for k in {**ta, **oa} if k not in tb and k not in ob]
    diffs += [Difference(k, f"only in {b}") for k in {**tb, **ob} if k not in ta and k not in oa]
    common = [k for k in ta if k in tb]
    with Files() as files, progress_bar(sum(ta[k].nbytes for k in common), "verify", progress) as update:
        for k in common:
            found = compare_tensors(ta[k], tb[k], files, max_memory, atol=atol, rtol=rtol)
            if found:
                diffs.append(dataclasses.replace(found, key=k))
            update(ta[k].nbytes)
        for k in (k for k in oa if k in ob):
            va, vb = _plain(object_value(oa[k]), files), _plain(object_value(ob[k]), files)
            if va != vb:
                diffs.append(Difference(k, f"value {va!r:.80} vs {vb!r:.80}"))
        for k in (k for k in ta if k in ob):
            diffs.append(Difference(k, f"a tensor in {a}, a non-tensor entry in {b}"))
        for k in (k for k in oa if k in tb):
            diffs.append(Difference(k, f"a non-tensor entry in {a}, a tensor in {b}"))
    return diffs


def _verify_alone(path: Path, max_memory: int, progress: bool, local: LocalOptions | None) -> VerifyReport:
    located = locate(path, local)
    ckpt = located.path
    manifest = located.reader.read(ckpt)
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
                        total, tuple(found), checksums=record is not None,
                        notes=(located.note,) if located.note else ())


"""The recorded checksums that a reading command (``convert``, ``reshard``, ``export-hf``) checks as it streams.

A ``ckptkit.save`` checkpoint carries ``ckptkit.json``, the CRC-32 of every box it wrote (:mod:`.checksums`).
:func:`recorded_checks` matches those boxes to the chunks the reader found, each a
:class:`~ckptkit.core.plan.Check` of the bytes it names; :func:`read_by` keeps those of the bytes an output
reads (an export reads the model alone, never the optimizer state's chunks), and the executor checks them in a
thread beside the writer (:mod:`ckptkit.io.checks`), publishing nothing if one fails.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

from ..codecs.sharded_tensor import ShardedTensorData, sharded_tensor_globals
from ..codecs.torchzip_read import read_archive
from ..core.manifest import Chunk, Manifest, Span, TensorEntry, TensorRef, key_of
from ..core.plan import Check, Region
from ..core.tree import flatten
from ..errors import ChecksumError
from ..formats.dcp import UNREAD_DAMAGE
from ..io.storage import storage_at
from .checksums import Record, read_record

__all__ = ["read_by", "recorded_checks", "unread_damage"]

_OPT_OUT = "--no-verify-checksums (verify_checksums=False) reads it as it is"


def recorded_checks(manifest: Manifest, root: Path | str) -> tuple[Check, ...]:
    """The checks that the ``ckptkit.json`` in the checkpoint directory ``root`` records for ``manifest``'s
    bytes (none without one): each chunk's box, each serialized entry, or for a LOCAL checkpoint each rank
    file's tensors. Tensors the reader left unread (no chunks) and keys the record does not name get none.

    Raises:
        ChecksumError: the record contradicts the checkpoint (another format, a key of another dtype or shape,
            a box the checkpoint does not hold): the checkpoint changed after it was saved.
        FormatError: ``ckptkit.json`` is not what ckptkit writes.
    """
    path = storage_at(root)[1]
    if not path.is_dir():
        return ()
    record = read_record(path)
    if record is None:
        return ()
    if record.format != manifest.format.value:
        raise ChecksumError(f"{record.path}: says format {record.format}, the checkpoint is "
                            f"{manifest.format.value}: it changed after it was saved; {_OPT_OUT}")
    if record.files:
        return _rank_file_checks(record, path)
    checks: list[Check] = []
    tensors = {t.key: t for t in manifest.tensors if t.chunks}
    for key, (dtype, shape, boxes) in record.tensors.items():
        t = tensors.get(key)
        if t is None:
            continue  # not read (an export's optimizer state), or not in the checkpoint (verify says which)
        if (t.dtype, t.shape) != (dtype, shape):
            raise ChecksumError(f"{record.path}: records {key!r} as {dtype} {list(shape)}, the checkpoint holds "
                                f"{t.dtype} {list(t.shape)}: it changed after it was saved; {_OPT_OUT}")
        chunks = {(c.offsets, c.sizes): c for c in t.chunks}
        for offsets, sizes, crc in boxes:
            chunk = chunks.get((offsets, sizes))
            if chunk is None:
                raise ChecksumError(f"{record.path}: records {key!r} chunk at {list(offsets)} size {list(sizes)}, "
                                    f"which the checkpoint does not hold: it changed after it was saved; {_OPT_OUT}")
            checks.append(_chunk_check(t, chunk, crc))
    blobs = {o.key: o.blob for o in manifest.objects if o.blob is not None}
    for key, crc in record.objects.items():
        span = blobs.get(key)
        if span is not None:
            checks.append(Check(f"{span.file}: {key!r}, the serialized entry at bytes {span.offset}-"
                                f"{span.offset + span.length}", key, crc, (span,)))
    return tuple(checks)


def _chunk_check(t: TensorEntry, chunk: Chunk, crc: int) -> Check:
    span = chunk.span
    box = "" if chunk.sizes == t.shape else f" chunk at {list(chunk.offsets)}"
    what = f"{span.file}: {t.key!r}{box}, bytes {span.offset}-{span.offset + span.length}"
    if chunk.strides is None:  # row-major from the span's start: its bytes are the box's
        return Check(what, t.key, crc, (Span(span.file, span.offset, math.prod(chunk.sizes) * t.dtype.itemsize),))
    return Check(what, t.key, crc, regions=(Region(TensorEntry(t.key, t.path, t.dtype, t.shape, (chunk,)),
                                                   chunk.offsets, chunk.sizes),))


def _rank_file_checks(record: Record, root: Path) -> tuple[Check, ...]:
    """LOCAL: each rank file's tensors as the file holds them (a ShardedTensor's local shards in a row)."""
    checks = []
    for name, crcs in record.files.items():
        file = root / name
        if file.is_symlink() or not file.is_file():
            raise ChecksumError(f"{record.path}: records {name}, which is not a rank file of the checkpoint: it "
                                f"changed after it was saved; {_OPT_OUT}")
        tree = read_archive(str(file.absolute()), extra_globals=sharded_tensor_globals(str(file)))
        for path, leaf in flatten(tree, lambda v: isinstance(v, (TensorRef, ShardedTensorData))):
            key = key_of(path)
            refs = [leaf] if isinstance(leaf, TensorRef) else \
                [t for _, t in leaf.local] if isinstance(leaf, ShardedTensorData) else []
            if key in crcs and refs:
                where = ", ".join(f"{r.span.offset}-{r.span.offset + r.span.length}" for r in refs)
                checks.append(Check(f"{file}: {key!r}, bytes {where}", key, crcs[key],
                                    regions=tuple(Region.whole(ref.as_entry(path)) for ref in refs)))
    return tuple(checks)


def read_by(checks: tuple[Check, ...], manifest: Manifest) -> tuple[Check, ...]:
    """Those of ``checks`` whose bytes overlap what writing ``manifest`` reads: its tensors' chunks (those of
    computed tensors' inputs too) and its serialized entries."""
    if not checks:
        return ()
    read: dict[str, list[tuple[int, int]]] = {}

    def add(span: Span) -> None:
        read.setdefault(span.file, []).append((span.offset, span.offset + span.length))

    todo = list(manifest.tensors)
    while todo:
        t = todo.pop()
        for c in t.chunks:
            add(c.span)
        if t.derived is not None:
            todo += t.derived.inputs
    for o in manifest.objects:
        if o.blob is not None:
            add(o.blob)
    merged = {file: _merged(ranges) for file, ranges in read.items()}

    def overlaps(span: Span) -> bool:
        starts, ends = merged.get(span.file, ((), ()))
        i = bisect.bisect_right(starts, span.offset + max(span.length, 1) - 1) - 1
        return i >= 0 and ends[i] > span.offset

    return tuple(c for c in checks if any(overlaps(s) for s in _spans(c)))


def _spans(check: Check) -> list[Span]:
    return [*check.spans, *(c.span for r in check.regions for c in r.entry.chunks)]


def _merged(ranges: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``ranges`` as sorted, disjoint ``(starts, ends)``."""
    starts: list[int] = []
    ends: list[int] = []
    for a, b in sorted(ranges):
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return starts, ends


def unread_damage(manifest: Manifest) -> tuple[str, ...]:
    """Notes on damage the reader found in what it did not read (a part read: an export's optimizer state)."""
    return tuple(f"not read, and damaged: {what}" for fact, what in manifest.details if fact == UNREAD_DAMAGE)

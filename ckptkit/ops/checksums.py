"""Checksums of what ``ckptkit.save`` writes, recorded in ``ckptkit.json`` and checked on load and by ``verify``.

Each rank computes them from the bytes it writes, as it writes them (:class:`Recorder`): nobody re-reads the
checkpoint after a save. A checksum is the CRC-32 of a tensor box's row-major bytes, so it does not depend on
how a format lays the bytes out:

- ``tensors``: per tensor key, its dtype, shape and the boxes that tile it (DCP's chunks, or the whole tensor
  for ``full`` and ``hf``), each with its CRC-32;
- ``objects``: per non-tensor DCP entry, the CRC-32 of its serialized bytes;
- ``files``: for ``local``, per rank file, the CRC-32 of every tensor it holds (a ShardedTensor's local shards
  in a row), keyed as ckptkit reads the file.

``ckptkit.json`` itself is untrusted input: :func:`read_record` checks its size, types and names, and
:func:`check` checks that every key it names exists in the checkpoint, and every tensor has its checksums.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..codecs.sharded_tensor import ShardedTensorData, sharded_tensor_globals
from ..codecs.torchzip_read import read_archive
from ..core import dtypes
from ..core.manifest import Chunk, Format, Manifest, Span, TensorEntry, TensorRef, key_of
from ..core.plan import Region, plan_strided, row_blocks
from ..core.tree import flatten
from ..errors import CheckpointError, ChecksumError, FormatError
from ..formats import object_value
from ..io.compute import tensor_bytes
from ..io.sources import Files, read_region
from ..io.storage import storage_at
from ._checksum_record import VERSION, Box, Record, parse_record

__all__ = ["MANIFEST", "Mismatch", "Record", "Recorder", "check", "checksum_writer", "read_record", "tensor_crc",
           "verify_on_every_rank", "write_record"]

MANIFEST = "ckptkit.json"
_MAX_BYTES = 256 << 20


# --------------------------------------------------------------------------------------------------------
# Recording, on each rank while it writes (torch is imported only here)


def tensor_crc(t: Any, crc: int = 0) -> int:
    """CRC-32 of a torch tensor's row-major bytes (moved to CPU if it is not there)."""
    data = t.detach().to("cpu").contiguous()
    return zlib.crc32(tensor_bytes(data), crc) if data.numel() else crc


@dataclass
class Recorder:
    """The checksums one rank computes for what it writes; rank 0 merges every rank's into ``ckptkit.json``."""

    tensors: dict[str, tuple[str, tuple[int, ...], list[Box]]] = field(default_factory=dict)
    objects: dict[str, int] = field(default_factory=dict)
    files: dict[str, dict[str, int]] = field(default_factory=dict)

    def tensor(self, key: str, t: Any, shape: tuple[int, ...] | None = None,
               offsets: tuple[int, ...] | None = None) -> None:
        """Record torch tensor ``t``, the box at ``offsets`` of a tensor of global ``shape`` (default: all of it)."""
        sizes = tuple(t.shape)
        dtype = str(t.dtype).removeprefix("torch.")
        boxes = self.tensors.setdefault(key, (dtype, tuple(shape or sizes), []))[2]
        boxes.append((tuple(offsets or (0,) * len(sizes)), sizes, tensor_crc(t)))

    def leaves(self, file: str, state: Any) -> None:
        """Record every tensor of ``state`` as ``file`` holds it (LOCAL: ShardedTensors by their local shards)."""
        import torch

        crcs = self.files.setdefault(file, {})
        for path, leaf in flatten(state, lambda v: isinstance(v, torch.Tensor)):
            if not isinstance(leaf, torch.Tensor):
                continue
            if type(leaf).__name__ == "ShardedTensor":
                crc = 0
                for shard in leaf.local_shards():  # type: ignore[attr-defined]  # a ShardedTensor
                    crc = tensor_crc(shard.tensor, crc)
                crcs[key_of(path)] = crc
            else:
                crcs[key_of(path)] = tensor_crc(leaf)

    def merge(self, other: Recorder) -> None:
        for key, (dtype, shape, boxes) in other.tensors.items():
            mine = self.tensors.setdefault(key, (dtype, shape, []))[2]
            mine.extend(b for b in boxes if b not in mine)  # a replica written by two ranks counts once
        self.objects.update(other.objects)
        for file, crcs in other.files.items():
            self.files.setdefault(file, {}).update(crcs)

    def keep_only(self, keys: set[str]) -> None:
        """Drop tensors the checkpoint does not hold after all (a tied weight the HF writer leaves out)."""
        self.tensors = {k: v for k, v in self.tensors.items() if k in keys}


_WRITERS: dict[str, type] = {}


def checksum_writer(path: Path, recorder: Recorder) -> Any:
    """torch's DCP ``FileSystemWriter`` for ``path`` that records, on the rank that writes each item, the
    CRC-32 of the tensor chunk or serialized object it writes.

    The checksums are computed in a thread of their own while torch writes the same items: ``zlib.crc32`` and
    the file writes both release the GIL on large buffers, so on a machine with a core to spare a save takes
    about as long as torch's own ``dcp.save``, rather than that plus a pass over every byte first."""
    if "dcp" not in _WRITERS:
        from torch.distributed.checkpoint import FileSystemWriter

        class ChecksumWriter(FileSystemWriter):
            recorder: Recorder

            def write_data(self, plan, planner):
                with ThreadPoolExecutor(1, thread_name_prefix="ckptkit-crc") as pool:
                    recording = _Recording(planner, self.recorder, pool)
                    try:
                        written = super().write_data(plan, cast(Any, recording))  # stands in for the planner
                    finally:
                        failed = [f.exception() for f in recording.pending]  # every sum done before leaving
                for problem in failed:
                    if problem is not None:
                        raise problem
                return written

        _WRITERS["dcp"] = ChecksumWriter
    writer = _WRITERS["dcp"](str(path))
    writer.recorder = recorder
    return writer


class _Recording:
    """DCP's save planner, as torch's writer asks it for each item's data just before writing that item: each
    item's checksum is handed to ``pool`` then, so it is computed while torch writes the same bytes (still in
    the CPU's caches), item by item."""

    def __init__(self, planner: Any, recorder: Recorder, pool: ThreadPoolExecutor) -> None:
        self._planner, self._recorder, self._pool = planner, recorder, pool
        self.pending: list[Any] = []

    def resolve_data(self, item: Any) -> Any:
        data = self._planner.resolve_data(item)
        self.pending.append(self._pool.submit(_record_item, self._recorder, item, data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


def _record_item(recorder: Recorder, item: Any, data: Any) -> None:
    """Record the CRC-32 of DCP's write ``item``, whose resolved data is ``data``, in ``recorder``."""
    from torch.distributed.checkpoint.planner import WriteItemType

    if item.type == WriteItemType.BYTE_IO:
        recorder.objects[item.index.fqn] = zlib.crc32(data.getbuffer())
    else:
        chunk = item.tensor_data.chunk
        recorder.tensor(item.index.fqn, data, tuple(item.tensor_data.size), tuple(chunk.offsets))


def write_record(directory: Path, recorder: Recorder, *, form: str, world_size: int, step: int | None,
                 save: int) -> None:
    def hex_(crc: int) -> str:
        return f"{crc:08x}"

    doc = {
        "format": form, "version": VERSION, "world_size": world_size, "step": step, "save": save,
        "checksum": "crc32",
        "tensors": {k: {"dtype": dtype, "shape": list(shape),
                        "chunks": [{"offsets": list(o), "sizes": list(s), "crc32": hex_(c)} for o, s, c in boxes]}
                    for k, (dtype, shape, boxes) in recorder.tensors.items()},
        "objects": {k: hex_(c) for k, c in recorder.objects.items()},
        "files": {f: {k: hex_(c) for k, c in crcs.items()} for f, crcs in recorder.files.items()},
    }
    (directory / MANIFEST).write_text(json.dumps(doc, separators=(",", ":")) + "\n")


# --------------------------------------------------------------------------------------------------------
# Reading ckptkit.json, as untrusted input


def read_record(directory: Path | str) -> Record | None:
    """``directory/ckptkit.json`` checked for structure; None when there is none. Garbage is an error."""
    path = storage_at(directory)[1] / MANIFEST
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
            raise ValueError(f"expected a JSON file under {_MAX_BYTES >> 20} MiB")
        return parse_record(path, json.loads(path.read_bytes()))
    except (ValueError, RecursionError, OSError) as e:
        raise FormatError(f"{path}: not a valid ckptkit.json ({e}); it is checked as untrusted input, and a "
                          "damaged one is an error rather than ignored") from None


# --------------------------------------------------------------------------------------------------------
# Checking a checkpoint against its record


@dataclass(frozen=True)
class Mismatch:
    key: str
    what: str


def _box_crc(entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...], files: Files,
             budget: int) -> int:
    crc = 0
    for block in row_blocks(Region(entry, offsets, sizes), budget):
        crc = zlib.crc32(read_region(block, files), crc)
    return crc


def _span_crc(span: Span, files: Files, key: str, budget: int) -> int:
    crc, pos, end = 0, span.offset, span.offset + span.length
    while pos < end:
        data = files.read(span.file, pos, min(budget, end - pos), key=key)
        crc, pos = zlib.crc32(data, crc), pos + len(data)
    return crc


def _tiles(key: str, dtype: dtypes.DType, shape: tuple[int, ...], boxes: tuple[Box, ...]) -> str | None:
    """None when ``boxes`` tile a tensor of ``shape`` exactly; else what is wrong (by the manifest's own rule)."""
    chunks = tuple(Chunk(o, s, Span("ckptkit.json", 0, 1 << 62)) for o, s, _ in boxes)
    try:
        TensorEntry(key, (key,), dtype, shape, chunks).validate()
    except CheckpointError as e:
        return str(e).replace("in ckptkit.json ", "")
    return None


@dataclass
class _Job:
    """One thing to check: a box of a tensor, an object blob, or a LOCAL rank file."""

    key: str
    weight: int
    run: Callable[[Files, int], Mismatch | None]


def _jobs(record: Record, manifest: Manifest, root: Path, problems: list[Mismatch]) -> list[_Job]:
    """What there is to check, after checking that the record and the manifest name the same things."""
    jobs: list[_Job] = []
    if record.format != manifest.format.value:
        problems.append(Mismatch(MANIFEST, f"says format {record.format}, the checkpoint is {manifest.format.value}"))
        return jobs
    if manifest.world_size is not None and record.world_size != manifest.world_size:
        problems.append(Mismatch(MANIFEST, f"says world size {record.world_size}, the checkpoint has "
                                           f"{manifest.world_size} ranks' files"))
    if record.step is not None and "step" in manifest:
        entry = manifest["step"]
        saved = object_value(entry) if not isinstance(entry, TensorEntry) else None
        if saved != record.step:
            problems.append(Mismatch("step", f"is {saved!r:.40} in the checkpoint, {record.step} in {MANIFEST}"))
    if record.files:
        return jobs + _file_jobs(record, manifest, root, problems)
    tensors = {t.key: t for t in manifest.tensors}
    for key in tensors.keys() - record.tensors.keys():
        problems.append(Mismatch(key, f"has no checksum in {MANIFEST} (added after the save?)"))
    for key, (dtype, shape, boxes) in record.tensors.items():
        t = tensors.get(key)
        if t is None:
            problems.append(Mismatch(key, f"is in {MANIFEST} but not in the checkpoint"))
            continue
        if (t.dtype, t.shape) != (dtype, shape):
            problems.append(Mismatch(key, f"is {t.dtype} {list(t.shape)} in the checkpoint, {dtype} {list(shape)} "
                                          f"in {MANIFEST}"))
            continue
        wrong = _tiles(key, dtype, shape, boxes)
        if wrong:
            problems.append(Mismatch(key, f"{MANIFEST}'s chunks do not tile it: {wrong}"))
            continue
        for offsets, sizes, crc in boxes:
            jobs.append(_Job(key, t.dtype.itemsize * math.prod(sizes), _box_job(t, offsets, sizes, crc)))
    blobs = {o.key: o for o in manifest.objects if o.blob is not None}
    if record.objects or record.format == Format.SHARDED.value:
        for key in blobs.keys() - record.objects.keys():
            problems.append(Mismatch(key, f"has no checksum in {MANIFEST} (added after the save?)"))
    for key, crc in record.objects.items():
        o = blobs.get(key)
        if o is None or o.blob is None:
            problems.append(Mismatch(key, f"is in {MANIFEST} but not a serialized entry of the checkpoint"))
            continue
        jobs.append(_Job(key, o.blob.length, _blob_job(key, o.blob, crc)))
    return jobs


def _mismatch(key: str, file: str, where: str, want: int, got: int) -> Mismatch:
    return Mismatch(key, f"{where} in {file} fails its CRC-32 check ({MANIFEST} says {want:08x}, the bytes give "
                         f"{got:08x}): the checkpoint changed after it was saved")


def _box_job(t: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...], want: int):
    def run(files: Files, budget: int) -> Mismatch | None:
        got = _box_crc(t, offsets, sizes, files, budget)
        if got == want:
            return None
        where = "the tensor" if sizes == t.shape else f"chunk at {list(offsets)} size {list(sizes)}"
        names = sorted({s.src.file for s in plan_strided(Region(t, offsets, sizes))})
        return _mismatch(t.key, ", ".join(names), where, want, got)
    return run


def _blob_job(key: str, span: Span, want: int):
    def run(files: Files, budget: int) -> Mismatch | None:
        got = _span_crc(span, files, key, budget)
        return None if got == want else _mismatch(key, span.file, "the serialized entry", want, got)
    return run


def _file_jobs(record: Record, manifest: Manifest, root: Path, problems: list[Mismatch]) -> list[_Job]:
    """LOCAL: every rank file's tensors, keyed as the file holds them."""
    template = getattr(manifest, "rank_files", None)
    names = {template.replace("{rank}", str(r)) for r in range(manifest.world_size or 0)} if template else set()
    for name in names - record.files.keys():
        problems.append(Mismatch(name, f"has no checksums in {MANIFEST} (added after the save?)"))
    jobs = []
    for name, crcs in record.files.items():
        file = root / name
        if name not in names or file.is_symlink() or not file.is_file():
            problems.append(Mismatch(name, f"is in {MANIFEST} but is not a rank file of the checkpoint"))
            continue
        jobs.append(_Job(name, file.stat().st_size, _rank_file_job(file, crcs)))
    return jobs


def _rank_file_job(file: Path, want: dict[str, int]):
    def run(files: Files, budget: int) -> Mismatch | None:
        tree = read_archive(str(file.absolute()), extra_globals=sharded_tensor_globals(str(file)))
        got: dict[str, int] = {}
        for path, leaf in flatten(tree, lambda v: isinstance(v, (TensorRef, ShardedTensorData))):
            refs = [leaf] if isinstance(leaf, TensorRef) else \
                [t for _, t in leaf.local] if isinstance(leaf, ShardedTensorData) else []
            if not refs:
                continue
            crc = 0
            for ref in refs:
                for block in row_blocks(Region.whole(ref.as_entry(path)), budget):
                    crc = zlib.crc32(read_region(block, files), crc)
            got[key_of(path)] = crc
        for key in got.keys() - want.keys():
            return Mismatch(key, f"in {file} has no checksum in {MANIFEST} (added after the save?)")
        for key, crc in want.items():
            if key not in got:
                return Mismatch(key, f"is in {MANIFEST} but not in {file}")
            if got[key] != crc:
                return _mismatch(key, str(file), "the tensor", crc, got[key])
        return None
    return run


def check(record: Record, manifest: Manifest, root: Path | str, *, max_memory: int = 1 << 30, share: int = 0,
          of: int = 1, progress: Callable[[int], None] = lambda n: None) -> list[Mismatch]:
    """Everything in which the checkpoint at ``root`` (read as ``manifest``) differs from ``record``.

    The byte checks are split round-robin: this caller does share ``share`` of ``of`` (a rank of a world); the
    cheap name checks are done by every caller.
    """
    problems: list[Mismatch] = []
    jobs = _jobs(record, manifest, storage_at(root)[1], problems)
    budget = max(1 << 16, min(max_memory, 64 << 20))
    with Files() as files:
        for job in jobs[share::of]:
            found = job.run(files, budget)
            if found:
                problems.append(found)
            progress(job.weight)
    return problems


def verify_on_every_rank(root: Path, manifest: Manifest, group: Any = None) -> None:
    """On every rank of the default process group (or alone): check the checkpoint at ``root`` against its
    ``ckptkit.json``, each rank a share of the bytes, and raise :class:`ChecksumError` on every rank if any
    rank found a mismatch. A checkpoint without ``ckptkit.json`` has nothing to check."""
    record = read_record(root)
    if record is None:
        return
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    found = [f"{m.key}: {m.what}" for m in check(record, manifest, root, share=rank, of=world)]
    if distributed:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, found, group=group)
        found = list(dict.fromkeys(f for rank_found in every for f in rank_found))
    if found:
        raise ChecksumError(f"{root}: {len(found)} checks against {MANIFEST} failed: {'; '.join(found[:5])}"
                            f"{' ...' if len(found) > 5 else ''} (pass verify_checksums=False to load anyway)")

"""SHARDED: ``torch.distributed.checkpoint`` directories (``.metadata`` + ``__R_I.distcp``), read and written
without a process group and without importing torch.

``.metadata`` is a pickle of DCP's metadata dataclasses; it is read through an allow-list that maps those
classes to plain records, so a hostile file cannot run code (torch's own ``dcp_to_torch_save`` unpickles it
unrestricted). Each chunk's bytes are a ``torch.save`` archive inside a ``.distcp`` file. Writing lays the
state out as N ranks of FSDP2 would have saved it: rank r's file holds the ``Shard(0)`` row block r of every
tensor (``torch.chunk`` sizes, so the last ranks may hold fewer rows or none).

Lightning's sharded checkpoints add ``meta.pt`` (``torch.save`` of every entry that is neither a module nor an
optimizer: step, epoch, loops, schedulers); Lightning recognises the directory by it. Its entries are read
as a FULL file's are, marked ``sidecar="meta.pt"``, and written back there. A ``meta.pt`` that ckptkit wrote
beside a DCP holding the same groups (:attr:`DcpOptions.meta_groups`) mirrors them; those copies are skipped on
reading. One whose pickle is off the allow-list is carried as it is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..codecs.dcp_metadata import ChunkRecord, MetadataPickle, ObjectRecord, TensorRecord
from ..codecs.pickle_read import (
    MEMORY_FORMATS,
    Call,
    EnumStandIn,
    Record,
    SafeUnpickler,
    allow_plain_records,
    allow_records,
    keep_call,
    safe_getattr,
    strided_layout,
)
from ..codecs.torchzip_read import ARCHIVE_MAGIC, ArchiveCache, archive_edges
from ..codecs.torchzip_write import archive_parts
from ..core import dtypes
from ..core.boxes import shard0_boxes
from ..core.dtypes import DType
from ..core.gc_pause import gc_paused
from ..core.manifest import Chunk, Format, Manifest, ObjectEntry, Span, TensorEntry, TensorRef, bytes_entry
from ..core.plan import Bytes, FilePlan, Part, Region, WritePlan
from ..core.tree import dcp_path, from_dcp_path
from ..errors import CheckpointError, FormatError, IncompleteCheckpointError
from ..io.sources import Files
from . import _accelerate as accelerate
from ._dcp_entries import empty_containers, empty_dict, open_whole_entries
from ._lightning import META, meta_parts, read_meta
from .base import FormatIO, FormatOptions, Target, cast_for, is_empty_container, object_value, regions_in
from .megatron import torch_dist as megatron

__all__ = ["DcpIO", "DcpOptions", "check_blobs"]

METADATA = ".metadata"
_DCP_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_RANK_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")
_INDEX = object()  # what DcpIO._interpret reads before the first key: the storage index


METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **allow_plain_records(_DCP_META, "Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                          "ChunkStorageMetadata", "MetadataIndex", "StorageMeta"),
    **allow_records(_DCP_META, "TensorProperties"),  # the one with a __setstate__ of its own
    **allow_plain_records(_FS, "_StorageInfo"),
    (_DCP_META, "_MEM_FORMAT_ENCODING"): EnumStandIn(MEMORY_FORMATS, keep_call(_DCP_META, "_MEM_FORMAT_ENCODING")),
    ("builtins", "getattr"): safe_getattr(),
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): strided_layout,
    ("pathlib", "PosixPath"): lambda *parts: "/".join(parts),
    ("pathlib", "WindowsPath"): lambda *parts: "\\".join(parts),
    ("collections", "OrderedDict"): dict,
    **{("torch", d.name): d for d in dtypes.DTYPES},
    **megatron.PLAN_GLOBALS,
}


def _count(v: Any, key: str, what: str) -> int:
    """``v``, a non-negative integer, the ``what`` of ``key`` (named only in the error, built only then: a
    .metadata has millions of them)."""
    if (type(v) is not int or v < 0) and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
        raise ValueError(f"{key!r} {what} is {v!r:.60}, not a non-negative integer")
    return v


def _counts(v: Any, key: str, what: str) -> tuple[int, ...]:
    if type(v) is tuple and len(v) <= 64:  # the common case, without a generator: a .metadata has millions
        for n in v:
            if type(n) is not int or n < 0:
                break
        else:
            return v
    if not isinstance(v, (tuple, list)) or len(v) > 64:
        raise ValueError(f"{key!r} {what} is {v!r:.60}, not a list of sizes")
    return tuple(_count(n, key, what) for n in v)


def check_blobs(manifest: Manifest) -> None:
    """Decode every serialized non-tensor entry through the allow-list, before a DCP writer copies them
    verbatim: a damaged one must stop the copy, not reach an output torch cannot load. An opaque ``meta.pt``
    was checked as far as it can be without running its classes when it was read
    (:func:`ckptkit.formats._lightning.read_meta`)."""
    for o in manifest.objects:
        if o.blob is not None and o.sidecar != META:
            object_value(o)


def _tensor_dtype(props: Record, meta_path: Path, key: str) -> DType:
    """The dtype of DCP's ``TensorProperties``, which torch unpickles as ``(dtype, layout, requires_grad,
    memory format, pin_memory)`` (older files: a dict), refusing anything else."""
    if hasattr(props, "state"):
        state = props.state
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[3], Call)):
            raise FormatError(f"{meta_path}: {key!r}: tensor properties {state!r:.80} are not (dtype, layout, "
                              "requires_grad, memory format, pin_memory), as torch reads them")
        dtype = state[0]
    else:
        dtype = getattr(props, "dtype", None)
    if not isinstance(dtype, DType):
        raise FormatError(f"{meta_path}: {key!r}: tensor properties carry no known dtype ({dtype!r:.60})")
    return dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class DcpOptions(FormatOptions):
    world_size: int = 1
    """Ranks the output is laid out for: rank r's file holds row block r of every tensor."""
    meta_groups: tuple[str, ...] | None = None
    """Top-level groups also written into ``meta.pt`` (:attr:`Target.state_groups`)."""
    megatron: bool = False
    """Write megatron-core's ``common.pt`` and ``metadata.json`` too (:mod:`.megatron.torch_dist`), so that its
    ``dist_checkpointing.load`` takes the output."""
    parts: tuple[tuple[str, str], ...] | None = None
    """(top-level group, directory): each group as a DCP checkpoint of its own in that directory, as
    accelerate's ``save_state`` lays them out (:mod:`._accelerate`)."""


def _nothing(manifest: Manifest) -> Collection[str]:
    return ()


class DcpIO(FormatIO):
    format = Format.SHARDED
    names = ("sharded", "megatron")  # megatron: megatron-core's files beside the DCP ones
    ranked = True
    keeps_state_apart = True
    casts = True

    @classmethod
    def detect(cls, path: Path) -> bool:
        # megatron-core's metadata.json too: a checkpoint of another of its backends is refused by name.
        return path.is_dir() and ((path / METADATA).is_file() or (path / megatron.CONFIG).is_file()
                                  or accelerate.is_save_state(path))

    def read(self, path: Path) -> Manifest:
        return self._read_dir(path, None)

    def read_part(self, path: Path, wanted: Callable[[Manifest], Collection[str]]) -> Manifest:
        # The chunks' archives are most of a read; an export wants the model's alone (an AdamW checkpoint's
        # optimizer state is two thirds of its chunks). .metadata says every key, dtype and shape first.
        return self._read_dir(path, wanted)

    def _read_dir(self, path: Path, wanted: Callable[[Manifest], Collection[str]] | None) -> Manifest:
        # A large checkpoint's description is millions of small objects that form no cycles: the collector
        # would walk them again and again as they are made (a third of the time of reading 50,000 chunks).
        with Files() as files, gc_paused():
            if accelerate.is_save_state(path):  # for a part, the model's directory is read; the other's not
                return accelerate.merged(path, [self._read((path / d).absolute(), files,
                                                           wanted if wanted is None or g == "model" else _nothing)
                                                for g, d in accelerate.PARTS])
            return self._read(path.absolute(), files, wanted)

    def _read(self, root: Path, files: Files, wanted: Callable[[Manifest], Collection[str]] | None) -> Manifest:
        meta_path = root / METADATA
        backend = megatron.read_config(root)
        if not meta_path.is_file():
            raise IncompleteCheckpointError(f"{root}: {megatron.CONFIG} names a torch_dist checkpoint, but "
                                            f"{METADATA} is missing")
        md = SafeUnpickler(meta_path.read_bytes(), METADATA_GLOBALS, where=str(meta_path)).load_checked()
        if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "state_dict_metadata", None), dict):
            raise FormatError(f"{meta_path}: not DCP metadata (found {type(md).__name__})")
        at: list[Any] = [_INDEX]  # the key being read, for the error below
        try:
            manifest = self._interpret(root, md, files, at, wanted, whole=backend is not None)
        except CheckpointError:
            raise
        except (AttributeError, TypeError, KeyError, ValueError, IndexError, OverflowError) as e:
            # The records are untrusted data: one missing a field, or holding a string where DCP has a size.
            where = "the storage index" if at[0] is _INDEX else repr(at[0])
            raise FormatError(f"{meta_path}: malformed DCP metadata at {where} ({type(e).__name__}: {e})") from None
        if backend is None:
            return manifest
        tensors, objects, mark, note = megatron.read_common(root, manifest.objects)
        kept = tuple(o for o in manifest.objects if mark != megatron.COMMON_STATE or o.key != megatron.COMMON_STATE_KEY)
        return dataclasses.replace(manifest, tensors=manifest.tensors + tuple(tensors), objects=kept + tuple(objects),
                                   details=(*manifest.details, (megatron.CONFIG, backend), (mark, note)))

    def _interpret(self, root: Path, md: Any, files: Files, at: list[str],
                   wanted: Callable[[Manifest], Collection[str]] | None, whole: bool) -> Manifest:
        locate = _Locator(root, md)
        paths = getattr(md, "planner_data", None) or {}
        files.expect(_chunk_edges(root, md, locate.storage))
        headers, objects = _headers(md, paths, locate, at)
        objects += empty_containers(paths, md.state_dict_metadata)
        # megatron-core's bytes entries are its ShardedObjects (rng_state, _extra_state), which its loader asks
        # for by their own keys: they stay whole, their bytes copied as they are.
        opened, objects = ([], objects) if whole else open_whole_entries(objects)
        chosen = None
        if wanted is not None and not (root / META).is_file():  # (meta.pt's entries join later: read them all)
            chosen = set(wanted(Manifest(Format.SHARDED, str(root), (*(bare for bare, _ in headers), *opened),
                                         tuple(objects))))
        archives, tensors = ArchiveCache(), list[TensorEntry]()
        for bare, sm in headers:
            at[0] = bare.key
            if chosen is not None and bare.key not in chosen:
                tensors.append(bare)  # not read: planning it fails
                continue
            entry = TensorEntry(bare.key, bare.path, bare.dtype, bare.shape, _chunks(bare, sm, locate, files, archives))
            entry.validate()
            tensors.append(entry)
        tensors += opened
        # A rank that holds no chunk writes an empty file that .metadata never names: count the files too.
        on_disk = {p.name for p in root.iterdir() if _RANK_FILE.search(p.name)}
        ranks = [int(m.group(1)) for f in locate.rank_files | on_disk if (m := _RANK_FILE.search(f))]
        world = max(ranks) + 1 if ranks else None
        split = {len(t.chunks) for t in tensors if t.numel and t.chunks}
        details: list[tuple[str, Any]] = [("files", len(locate.rank_files)),
                                          ("chunks per tensor", _chunk_counts(sorted(split)))]
        if (root / META).is_file():
            groups = {str(t.path[0]) for t in tensors} | {str(o.path[0]) for o in objects}
            meta_tensors, meta_objects, note = read_meta(root / META, groups)
            tensors += meta_tensors
            objects += meta_objects
            details.append((META, note))
        return Manifest(Format.SHARDED, str(root), tuple(tensors), tuple(objects), world, tuple(details))

    def options(self, target: Target, manifest: Manifest) -> DcpOptions:
        return DcpOptions(cast=target.cast, world_size=target.world_size, meta_groups=target.state_groups,
                          megatron=target.to == "megatron" or megatron.is_megatron(manifest),
                          parts=accelerate.parts_of(manifest))

    def not_held(self, manifest: Manifest) -> tuple[str, ...]:
        empty = [o.key for o in manifest.objects
                 if is_empty_container(o) and isinstance(o.value, dict) and not o.sidecar]
        if not empty:
            return ()
        return (f"empty dicts recorded in .metadata's planner data, which ckptkit reads back and torch's loaders "
                f"pass over (torch's DCP stores none): {', '.join(empty[:5])}",)

    def plan(self, manifest: Manifest, options: DcpOptions) -> WritePlan:
        with gc_paused():  # millions of parts and records, none in a cycle: see ckptkit.core.gc_pause
            if options.parts:
                return self._plan_parts(manifest, options, options.parts)
            return self._plan(manifest, options)

    def _plan_parts(self, manifest: Manifest, options: DcpOptions, parts: tuple[tuple[str, str], ...]) -> WritePlan:
        """Each group of ``parts`` a DCP checkpoint in its directory; the last one's ``.metadata`` commits."""
        files: list[FilePlan] = []
        for group, directory in parts:
            part = dataclasses.replace(manifest, tensors=tuple(t for t in manifest.tensors if str(t.path[0]) == group),
                                       objects=tuple(o for o in manifest.objects if str(o.path[0]) == group))
            plan = self._plan(part, dataclasses.replace(options, parts=None))
            files += [FilePlan(f"{directory}/{f.relpath}", f.parts) for f in plan.files]
        return WritePlan(tuple(files), commit=f"{parts[-1][1]}/{METADATA}")

    def _plan(self, manifest: Manifest, options: DcpOptions) -> WritePlan:
        n = options.world_size
        parts: list[list[Part]] = [[] for _ in range(n)]
        sizes = [0] * n

        def put(rank: int, blob: tuple[Part, ...]) -> tuple[str, int, int]:
            start = sizes[rank]
            parts[rank] += blob
            sizes[rank] += sum([p.nbytes for p in blob])
            return f"__{rank}_0.distcp", start, sizes[rank] - start

        tensors = []
        names = [f"__{r}_0.distcp" for r in range(n)]
        for t in manifest.tensors:
            if t.sidecar:
                continue
            cast = cast_for(t.dtype, options.cast)
            chunks = []
            for rank, (offsets, box) in shard0_boxes(t.shape, n):  # a million times in a large reshard: inlined
                head, region, tail = blob = archive_parts(Region(t, offsets, box, cast))
                start = sizes[rank]
                parts[rank] += blob
                sizes[rank] = start + head.nbytes + region.nbytes + tail.nbytes
                chunks.append(ChunkRecord(offsets, box, names[rank], start, sizes[rank] - start))
            tensors.append(TensorRecord(t.key, cast or t.dtype, t.shape, chunks))
        # torch's DCP never writes an empty dict (its traversal finds no leaf in one; an empty list is a leaf),
        # and its loader trips over one as an entry (it falls back to a pre-2.4 key scheme): they are recorded
        # in planner_data alone, where torch does not look.
        objects = [o for o in manifest.objects if not empty_dict(o) and o.sidecar is None]
        empty = {o.key: (*dcp_path(o.path), {}) for o in manifest.objects if empty_dict(o) and o.sidecar is None}
        blobs = [ObjectRecord(o.key, *put(0, (Region.whole(bytes_entry(o.blob, o.key)),) if o.blob
                                          else archive_parts(regions_in(o.value, options.cast))))
                 for o in objects]
        entries: list[TensorEntry | ObjectEntry] = [*(t for t in manifest.tensors if not t.sidecar), *objects]
        paths = {**{e.key: dcp_path(e.path) for e in entries}, **empty}
        if options.megatron and megatron.in_dcp(manifest):  # megatron-core 0.19's common state, an object of rank 0
            common = megatron.common_parts(manifest, options.cast)
            blobs.append(ObjectRecord(megatron.COMMON_STATE_KEY, *put(0, common)))
            paths[megatron.COMMON_STATE_KEY] = (megatron.COMMON_STATE_KEY,)
        metadata = MetadataPickle().dumps(tensors, blobs, paths)
        files = [FilePlan(f"__{r}_0.distcp", tuple(parts[r])) for r in range(n)]
        files.append(FilePlan(METADATA, (Bytes(metadata),)))
        if any(e.sidecar == META for e in manifest.entries) or options.meta_groups is not None:
            files.append(FilePlan(META, meta_parts(manifest, options.meta_groups, options.cast)))
        if options.megatron:
            if not megatron.in_dcp(manifest):
                files.append(FilePlan(megatron.COMMON, megatron.common_parts(manifest, options.cast)))
            files.append(FilePlan(megatron.CONFIG, (Bytes(megatron.config_bytes(manifest)),)))
        return WritePlan(tuple(files), commit=METADATA)


def _chunk_counts(counts: list[int]) -> str:
    """How many chunks (saved shards) the tensors are in, in words: ``1 each``, ``1 or 4, by tensor``."""
    if not counts:
        return "none (no tensor holds elements)"
    if len(counts) == 1:
        return f"{counts[0]} each"
    return f"{', '.join(map(str, counts[:-1]))} or {counts[-1]}, by tensor"


class _Locator:
    """``(file, offset, length)`` of a key's entry at an offset, by the storage index of ``md``;
    :attr:`rank_files`: the files named so far, each checked once."""

    def __init__(self, root: Path, md: Any) -> None:
        self.root, self.located, self.rank_files = root, dict[str, str](), set[str]()
        self.storage: dict[tuple[str, tuple | None], Any] = {}
        for idx, info in (getattr(md, "storage_data", None) or {}).items():
            offset = getattr(idx, "offset", None)
            self.storage[(idx.fqn, offset if offset is None or type(offset) is tuple else tuple(offset))] = info

    def __call__(self, key: str, offset: tuple | None) -> tuple[str, int, int]:
        meta_path, root = self.root / METADATA, self.root
        info = self.storage.get((key, offset))
        if info is None:
            raise IncompleteCheckpointError(f"{meta_path}: no storage entry for {key!r} at offset {offset}")
        if type(info).__name__ != "_StorageInfo":  # torch's reader needs its fields, defaults included
            raise FormatError(f"{meta_path}: the storage entry of {key!r} at offset {offset} is a "
                              f"{type(info).__name__}, not a _StorageInfo")
        if getattr(info, "transform_descriptors", None):
            raise FormatError(f"{meta_path}: {key!r} is stored with transforms {list(info.transform_descriptors)}; "
                              "ckptkit reads untransformed (uncompressed) DCP entries only")
        relative = info.relative_path
        file = self.located.get(relative)
        if file is None:
            if Path(relative).is_absolute() or ".." in Path(relative).parts:
                raise FormatError(f"{meta_path}: {key!r} points outside the checkpoint ({relative!r})")
            if not (root / relative).is_file():
                raise IncompleteCheckpointError(f"{root}: {relative} (holding {key!r}) is missing")
            file = self.located[relative] = str(root / relative)
            self.rank_files.add(relative)
        return file, _count(info.offset, key, "offset"), _count(info.length, key, "length")


def _headers(md: Any, paths: dict, locate: _Locator,
             at: list[str]) -> tuple[list[tuple[TensorEntry, Any]], list[ObjectEntry]]:
    """Each tensor's ``.metadata``, checked, as an entry without chunks beside its record; and the bytes
    entries. ``at[0]`` is the key being read."""
    meta_path = locate.root / METADATA
    headers: list[tuple[TensorEntry, Any]] = []
    objects: list[ObjectEntry] = []
    for key, sm in md.state_dict_metadata.items():
        at[0] = key
        path_ = from_dcp_path(tuple(paths.get(key, (key,))))
        if not isinstance(key, str) or not path_ or not all(
                isinstance(k, (str, int)) and not isinstance(k, bool) for k in path_):
            raise ValueError(f"key {key!r:.60} with path {path_!r:.80} is not a state-dict key and path")
        if ".".join(map(str, path_)) != key:  # DCP's own loader finds an entry by its path joined so
            raise FormatError(f"{meta_path}: {key!r} is stored under the path {list(path_)}, which names "
                              f"{'.'.join(map(str, path_))!r}; torch's loader would not find it")
        kind = type(sm).__name__
        if kind == "BytesStorageMetadata":
            objects.append(ObjectEntry(key, path_, blob=Span(*locate(key, None))))
            continue
        if kind != "TensorStorageMetadata":
            raise FormatError(f"{meta_path}: {key!r} has unknown storage metadata {kind}")
        headers.append((TensorEntry(key, path_, _tensor_dtype(sm.properties, meta_path, key),
                                    _counts(sm.size, key, "size"), ()), sm))
    return headers, objects


def _chunks(bare: TensorEntry, sm: Any, locate: _Locator, files: Files, archives: ArchiveCache) -> tuple[Chunk, ...]:
    """The chunks ``.metadata`` record ``sm`` lists for tensor ``bare``, each holding the dtype and shape said."""
    key, dtype = bare.key, bare.dtype
    chunks = []
    for c in sm.chunks:
        offsets, sizes = _counts(c.offsets, key, "chunk offsets"), _counts(c.sizes, key, "chunk sizes")
        file, start, length = locate(key, offsets)
        pread = files.pread(file, start + length, start=start, key=key)
        framing = archives.find(pread, start, length)
        if framing is not None and framing.shape == sizes and framing.dtype is dtype:
            # An archive framed as one already checked (nearly every chunk): its span, without a TensorRef.
            span = Span(file, start + framing.offset, framing.nbytes)
            chunks.append(Chunk(offsets, sizes, span, framing.strides))
            continue
        ref = framing.ref(file, start) if framing is not None else None
        if ref is None:
            if pread(4, start) != ARCHIVE_MAGIC:
                raise FormatError(
                    f"{file}: {key!r} chunk at {list(offsets)} is not a torch.save record; DCP saved "
                    "with serialization_format=SAFETENSORS or a custom storage writer is not supported")
            ref = archives.read(file, start, length, pread=pread,
                                where=f"{file}: {key!r} chunk {list(offsets)}")
        if not isinstance(ref, TensorRef) or ref.shape != sizes or ref.dtype != dtype:
            found = f"{ref.dtype} {list(ref.shape)}" if isinstance(ref, TensorRef) else type(ref).__name__
            raise FormatError(f"{file}: {key!r} chunk at {list(offsets)} holds {found}, "
                              f".metadata says {dtype} {list(sizes)}")
        chunks.append(Chunk(offsets, sizes, ref.span, ref.strides))
    return tuple(chunks)


def _chunk_edges(root: Path, md: Any, storage: dict) -> Iterator[tuple[str, int, int]]:
    """Where the chunk archives' headers are, in the order :meth:`DcpIO._interpret` reads them, for a remote
    checkpoint's read-ahead. Metadata too damaged to say ends the list; the reading loop names the fault."""
    try:
        for key, sm in md.state_dict_metadata.items():
            for c in getattr(sm, "chunks", None) or ():
                info = storage.get((key, tuple(c.offsets)))
                if info is not None:
                    for start, end in archive_edges(int(info.offset), int(info.length)):
                        yield str(root / info.relative_path), start, end
    except Exception:
        return

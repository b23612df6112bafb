"""Any format to any format, and offline re-sharding: read a manifest, plan the target, stream it."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

from ..core.manifest import Format, FormName, Manifest, ObjectEntry, TensorEntry
from ..core.plan import FilePlan, WritePlan
from ..errors import UsageError
from ..formats import LocalOptions, Target, io_for, is_empty_container, locate
from ..formats._megatron import COMMON, extra_states
from ..formats.dcp import check_blobs
from ..io.execute import all_ranks, execute_distributed
from ..io.options import DEFAULT_MAX_MEMORY, WriteOptions
from ..io.parallel import execute_parallel, writers
from ..io.progress import count, human_size, progress_bar
from ..io.storage import storage_at
from .detect import check_family, detect_family
from .hfconfig import check_single_file, find_config
from .mapping import KeyMapping, KeyMapSource, MappedKeys, Renames, key_mapping, map_keys
from .presets import MEGATRON, preset
from .select import meta_groups, select_model

__all__ = ["Changes", "Report", "convert", "map_model", "parse_size", "reshard", "sources_of", "write"]



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

    def lines(self) -> list[str]:
        ws = f" for {count(self.world_size, 'rank')}" if self.world_size else ""
        what = (f"{count(self.tensors, 'tensor')}, {count(self.objects, 'other entry', 'other entries')}, "
                f"{human_size(self.bytes)} in {count(self.files, 'file')}")
        out = [f"{self.source} ({self.source_format.value}) -> "
               f"{self.destination} ({self.destination_format.value}{ws})",
               f"  would write {what} (dry run: nothing written)" if self.dry_run
               else f"  {what}, {self.seconds:.2f} s"]
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
        if self.workers_why:
            out.append(f"  workers: {self.workers} ({self.workers_why})")
        out += [f"  note: {n}" for n in self.notes]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


_FILES_SHOWN = 12
_LAYER = re.compile(r"(?<=\.)\d+(?=\.)")


def _a(name: str) -> str:
    """A format's name after its article: "an hf", "a full"."""
    return f"{'an' if name == 'hf' or name[0] in 'aeiou' else 'a'} {name}"


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


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?B|B)?\s*", re.IGNORECASE)


@overload
def parse_size(value: int | str, option: str = ...) -> int: ...
@overload
def parse_size(value: None, option: str = ...) -> None: ...


def parse_size(value: int | str | None, option: str = "--max-shard-size") -> int | None:
    """``"5GB"`` (decimal, as huggingface_hub's ``max_shard_size`` counts), ``"1GiB"`` (binary) or a byte count.

    huggingface_hub parses its sizes with a private helper, so the same decimal units are parsed here."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.fullmatch(value)
    if m is None:
        raise UsageError(f"{option}: expected a size like 5GB, 512MiB or 1000000, got {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def sources_of(manifest: Manifest, src: Path | str | None = None) -> tuple[Path, ...]:
    """What an output must stay clear of: the input the user named and every file a conversion reads."""
    files = {c.span.file for t in manifest.tensors for c in t.chunks}
    files |= {o.blob.file for o in manifest.objects if o.blob is not None}
    named = str(src) if src is not None else manifest.root
    return tuple(storage_at(p)[1] for p in sorted({named, manifest.root, *files}))


def write(manifest: Manifest, fmt: Format, dst: Path | str, target: Target, *, overwrite: bool,
          max_memory: int, fsync: bool, progress: bool, extra_files: tuple[FilePlan, ...] = (),
          notes: tuple[str, ...] = (), distributed: bool = False, src: Path | str | None = None,
          dry_run: bool = False, changes: Changes = Changes(), workers: int | str = 1) -> Report:
    """Write ``manifest`` as ``fmt`` to ``dst``. ``src`` is the input as the user named it: ``dst`` may not be,
    hold or lie inside it (nor any file read from it). With ``dry_run``, only plan it (and check the
    destination) and report what would be written. ``changes`` are the renames, drops and casts made on the
    way, for the report. ``workers`` processes of this machine, or with ``distributed`` every rank of the
    default process group, write the output files (:mod:`ckptkit.io.parallel`)."""
    start = time.perf_counter()
    if distributed and workers not in (1, "1", "auto"):
        raise UsageError(f"--workers {workers} splits the files over processes of one machine; under torchrun the "
                         "ranks split them: start more ranks (--nproc-per-node) instead")
    notes += _left_out(manifest, fmt)
    sources = sources_of(manifest, src)
    storage, out = storage_at(dst)
    storage.check(out, overwrite=overwrite, sources=sources, dry_run=dry_run)
    # Decoded now, whatever the target: a DCP writer copies them verbatim, and a damaged one means a checkpoint
    # torch cannot load, which no output may hide.
    check_blobs(manifest)
    io = io_for(fmt)
    plan = io.plan(manifest, io.options(target, manifest))
    plan = WritePlan(plan.files + extra_files, single_file=plan.single_file, commit=plan.commit)
    n, why = (1, "") if distributed else writers(workers, plan, storage, sources)
    options = WriteOptions(overwrite=overwrite, max_memory=max_memory, fsync=fsync, workers=n)
    if distributed and not dry_run:
        execute_distributed(plan, out, storage, options, sources)
    elif not dry_run:  # a dry run is planned and its destination checked: nothing to write
        with progress_bar(plan.total_bytes, f"{fmt.value}", progress) as update:
            execute_parallel(plan, out, storage, options, update, sources)
    ws = target.world_size if fmt in (Format.SHARDED, Format.LOCAL) else None
    # A single-file output is DST itself, whatever name the plan gave its one file.
    written = tuple((out.name if plan.single_file else f.relpath, f.nbytes) for f in plan.files)
    return Report(manifest.root, manifest.format, str(dst), fmt, len(manifest.tensors), len(manifest.objects),
                  plan.total_bytes, len(plan.files), time.perf_counter() - start, ws, notes, written,
                  changes.renamed, changes.dropped, changes.cast, changes.permuted, dry_run, n, why)


def _left_out(manifest: Manifest, fmt: Format) -> tuple[str, ...]:
    """Notes on entries the target format cannot hold, so that nothing goes missing unreported."""
    notes = tuple(f"not read from the source: {what}" for fact, what in manifest.details if fact == "left out")
    return notes + _not_held(manifest, fmt)


def _not_held(manifest: Manifest, fmt: Format) -> tuple[str, ...]:
    if fmt is Format.HF and manifest.objects:
        return (f"{len(manifest.objects)} non-tensor entries not written (safetensors holds tensors only): "
                + ", ".join(o.key for o in manifest.objects[:5]) + (" ..." if len(manifest.objects) > 5 else ""),)
    empty = [o.key for o in manifest.objects if is_empty_container(o) and isinstance(o.value, dict) and not o.sidecar]
    if fmt is Format.SHARDED and empty:
        return (f"empty dicts recorded in .metadata's planner data, which ckptkit reads back and torch's loaders "
                f"pass over (torch's DCP stores none): {', '.join(empty[:5])}",)
    return ()


def map_model(tensors: tuple[TensorEntry, ...], mapping: KeyMapping, src: Path | str,
              hf_assets: Path | str | None, to_hf: bool | None) -> MappedKeys:
    """The model's tensors under ``mapping``; a preset gets its head counts from the model's config
    (:func:`ckptkit.ops.hfconfig.find_config`: ``hf_assets``, the source's own ``config.json``, Meta's
    ``params.json`` beside it)."""
    shape = None
    notes: tuple[str, ...] = ()
    if mapping.preset is not None:
        remote = any(not isinstance(p, (str, os.PathLike, type(None))) for p in (src, hf_assets))  # read by name
        config = (find_config(Path(src), hf_assets) if not remote and (mapping.preset == "auto" or hf_assets)
                  else None)
        model_type = config.data.get("model_type") if config is not None and config.is_hf else None
        where = str(config.path) if config is not None else "config.json"
        keys = [t.key for t in tensors]
        if mapping.preset == "auto":
            found = detect_family(keys, model_type if isinstance(model_type, str) else None, where)
            mapping = dataclasses.replace(mapping, preset=found.preset)
            notes = (f"--preset auto: {found.preset} ({found.why})",) if found.preset else ()
        if mapping.preset is not None:
            chosen = preset(mapping.preset)
            check_single_file(chosen, Path(src))
            check_family(chosen, keys, model_type if isinstance(model_type, str) else None, where)
            if config is None and chosen.needs_shape:
                config = find_config(Path(src), hf_assets)
            shape = config.shape() if config is not None else None
    mapped = map_keys(tensors, mapping, shape=shape, to_hf=to_hf)
    return dataclasses.replace(mapped, notes=notes + mapped.notes)


MEGATRON_STEP_0 = tuple(ObjectEntry(k, (k,), v, sidecar=COMMON) for k, v in (("checkpoint_version", 3.0),
                                                                              ("iteration", 0)))
"""``common.pt`` of a model written for megatron-core: the state Megatron-LM's loader reads beside the model
(its checkpoint format version, and the step, 0), and no run arguments or optimizer."""


def megatron_preset(src: Path, hf_assets: Path | str | None, preset: str | None) -> str:
    """The preset ``convert --to megatron`` maps with: ``preset`` (a ``megatron-*`` one), else the one for the
    model's ``model_type`` (:data:`ckptkit.ops.presets.MEGATRON`).

    Raises:
        UsageError: another family's preset, or no preset and a config that names no family with a table.
    """
    if preset not in (None, "auto"):
        if preset not in MEGATRON.values():
            raise UsageError(f"--to megatron maps HF names to megatron-core's with a Megatron preset "
                             f"({', '.join(MEGATRON.values())}), not --preset {preset}")
        return preset
    config = find_config(Path(src), hf_assets)
    model_type = config.data.get("model_type") if config is not None else None
    if not isinstance(model_type, str) or model_type not in MEGATRON:
        where = str(config.path) if config is not None else f"{src}: no config.json, and"
        raise UsageError(f"{where} model_type {model_type!r:.40} has no Megatron table; pass --preset "
                         f"({', '.join(MEGATRON.values())})")
    return MEGATRON[model_type]


@all_ranks
def convert(src: Path | str, dst: Path | str, *, to: Format | FormName | Literal["megatron"],
            world_size: int | None = None, max_shard_size: int | str | None = None, overwrite: bool = False,
            max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False, progress: bool = False,
            local: LocalOptions | None = None, preset: str | None = None,
            renames: Renames = (), key_map: KeyMapSource = None,
            strict_map: bool = False, hf_assets: Path | str | None = None, dry_run: bool = False,
            storage_options: dict | None = None, workers: int | str = 1, distributed: bool = False) -> Report:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``, streaming tensor by tensor.

    FULL output is one ``torch.save`` file when ``dst`` ends in .pt/.pth/.bin/.ckpt and no shard size is
    given, else a directory (``pytorch_model.bin`` or HF-style ``pytorch_model-*.bin`` shards). HF output
    holds the model part only, found and named as :func:`ckptkit.export_hf` does (use that for casts,
    config and tokenizer files). ``world_size`` lays SHARDED and LOCAL output out for that many ranks (default:
    the source's world size, 1 for a single-file source); other targets have no ranks and refuse more than 1. SHARDED
    output from another form carries Lightning's ``meta.pt`` (the groups
    that are neither the model nor optimizer state, also kept in the DCP), so Lightning loads it too.

    A key mapping (:mod:`ckptkit.ops.mapping`) renames the model's weights: ``key_map`` (a dict, or a JSON
    file of old key to new key or null), then ``renames`` (``'REGEX=REPLACEMENT'``, in order), then a
    ``preset`` (a name in :data:`ckptkit.ops.presets.PRESETS`, or ``"auto"``: the family's, detected from
    config.json's ``model_type`` and the keys; the default for ``to="hf"``), which maps from whichever side
    the keys are named in to the other (towards HF names for ``to="hf"``) and takes head and expert counts
    from ``hf_assets``' config.json (default: the source's own). ``strict_map`` refuses keys nothing mapped. With a
    mapping, the output holds the model part only: optimizer state names parameters its own way.

    ``local`` (:class:`LocalOptions`) applies to a LOCAL source or output: ``rank_files`` names the rank
    files (``"shard_{rank}.pt"``); ``model`` (``"package.module:factory"``), ``auto_wrap``,
    ``use_orig_params`` and ``param_dtype`` (``MixedPrecision(param_dtype=...)``) say how FSDP wraps the
    model, from which the flat-parameter layout is derived where no ``flat_layout.json`` has it.

    ``to="megatron"`` writes a megatron-core ``torch_dist`` checkpoint of an HF model (the model only, at step
    0): the DCP files under megatron-core's GPT names (the ``preset``, else the one for config.json's
    ``model_type``: ``megatron-llama``, ``megatron-qwen3``, ``megatron-qwen3-moe``), with ``common.pt`` and
    ``metadata.json``, which megatron-core's ``dist_checkpointing.load`` takes at any tensor-parallel size.

    ``dry_run`` plans and reports the output without writing anything.

    ``src`` may be a run directory of :func:`ckptkit.save`: the step its ``latest`` names is read, after the
    recovery :func:`ckptkit.load` makes, and the report says which. ``src`` and ``dst`` may be URLs (``s3://``,
    ``gs://``, ``az://``; ``hf://`` to read); ``storage_options`` go to their filesystem (``{"endpoint_url":
    ..., "profile": ...}`` for s3fs).

    ``workers`` processes write the output files, each its share (one machine; ``"auto"``: as many as pay for
    this plan on this machine's cores, see :func:`ckptkit.io.parallel.writers`); or, with ``distributed``,
    every rank of the default process group calls this alike (torchrun, a save hook) and each writes its
    share, rank 0 publishing. Either way the output is the one a single process writes, byte for byte.

    Args:
        src: The checkpoint to read: a file, a directory or a URL.
        dst: Where to write; must not exist unless ``overwrite``.
        to: The output form: ``full``, ``sharded``, ``hf`` or ``local``.
        world_size: Ranks of a ``sharded`` or ``local`` output.
        max_shard_size: Largest output file of a FULL or HF output (``"5GB"``, ``"1GiB"`` or bytes); None: one
            file.
        overwrite: Replace an existing ``dst``, atomically on a local filesystem.
        max_memory: Bytes of tensor data held in memory at once (dtype casts).
        fsync: Make the output durable across power loss before it is published.
        progress: Show a progress bar.
        local: How to read or write a LOCAL checkpoint.
        preset: A named key mapping (``torchtitan-llama``, ``meta-llama``, ``qwen2``, ``mistral``).
        renames: ``'REGEX=REPLACEMENT'`` renames, applied in order.
        key_map: Old key to new key (None leaves the key out), as a dict or a JSON file.
        strict_map: Refuse keys that neither ``key_map`` nor ``renames`` maps.
        hf_assets: An HF model directory whose ``config.json`` gives a preset its head counts.
        dry_run: Plan and report, write nothing.
        storage_options: Keyword arguments of the filesystem of a URL.
        workers: Processes of this machine that write the output files, or ``"auto"``.
        distributed: Every rank of the default process group calls this, and each writes its share.

    Returns:
        What was written (or, with ``dry_run``, would be): files and sizes, keys renamed and left out, notes.

    Raises:
        FormatError: A file of ``src`` is not what its format promises, or ``src`` is no checkpoint ckptkit
            knows.
        IncompleteCheckpointError: A rank file, chunk or shard of ``src`` is missing, or chunks overlap.
        UnsafeCheckpointError: A pickle in ``src`` names a global outside the allow-list.
        UsageError: The request is inconsistent: ``dst`` exists without ``overwrite``, lies inside ``src``,
            or an option value is unknown.
    """
    megatron = to == "megatron"
    fmt = Format.SHARDED if megatron else io_for(to).format
    local = local or LocalOptions()
    if preset is None and fmt is Format.HF:
        preset = "auto"
    src, dst = storage_at(src, storage_options)[1], storage_at(dst, storage_options)[1]
    if megatron:
        preset = megatron_preset(src, hf_assets, preset)
    mapping = key_mapping(preset=preset, renames=renames, key_map=key_map, strict=strict_map)
    found = locate(src, local)
    manifest = found.reader.read(found.path)
    world_size, notes = _world_size(world_size, manifest, fmt)
    notes = _read_from(found.note) + notes
    changes = Changes()
    if fmt is Format.HF or mapping:
        # A model file holds the model: the same part, under the same names, as export-hf writes. The entries it
        # leaves out are decoded all the same (write() decodes only those it writes): convert reads everything,
        # and refuses a checkpoint torch cannot load.
        check_blobs(manifest)
        sel = select_model(manifest)
        tensors, notes = sel.tensors, notes + sel.notes
        if mapping:
            mapped = map_model(tensors, mapping, found.path, hf_assets,
                               to_hf=True if fmt is Format.HF else False if megatron else None)
            tensors, notes = mapped.tensors, notes + mapped.notes
            changes = Changes(mapped.renamed, mapped.dropped, permuted=mapped.permuted)
            if fmt is not Format.HF:
                notes += ("a key mapping renames the model's weights: the output holds the model part only",)
        objects = (*extra_states(tensors), *MEGATRON_STEP_0) if megatron else ()
        manifest = Manifest(manifest.format, manifest.root, tensors, objects)
    target = Target(world_size=world_size, max_shard_size=parse_size(max_shard_size), destination=str(dst),
                    local=local, meta_groups=meta_groups(manifest) if fmt is Format.SHARDED else None,
                    megatron=megatron)
    return write(manifest, fmt, dst, target, overwrite=overwrite, max_memory=max_memory, fsync=fsync,
                 progress=progress, notes=notes, src=src, dry_run=dry_run, changes=changes, workers=workers,
                 distributed=distributed)


def _read_from(note: str | None) -> tuple[str, ...]:
    return (note,) if note else ()


def _world_size(asked: int | None, manifest: Manifest, fmt: Format) -> tuple[int, tuple[str, ...]]:
    """The ranks to lay the output out for, and a note when they are the source's by default."""
    if fmt not in (Format.SHARDED, Format.LOCAL):
        if asked not in (None, 1):
            raise UsageError(f"--world-size {asked}: {_a(fmt.value)} checkpoint is not laid out for ranks; "
                             "the world size applies to --to sharded and --to local only")
        return 1, ()
    if asked is not None:
        return asked, ()
    ws = manifest.world_size or 1
    return ws, (f"world size {ws}, the source's (--world-size N lays it out for N ranks)",)


@all_ranks
def reshard(src: Path | str, dst: Path | str, *, world_size: int, overwrite: bool = False,
            max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False, progress: bool = False,
            local: LocalOptions | None = None, dry_run: bool = False, storage_options: dict | None = None,
            workers: int | str = 1, distributed: bool = False) -> Report:
    """Re-lay-out a sharded checkpoint for ``world_size`` ranks, in its own format; no GPU or process group.

    ``local`` is as for :func:`convert`; the output keeps the source's rank file names and layout, and a
    DCP source's Lightning ``meta.pt``. Another framework's sharded layout that ckptkit reads but does not
    write (verl, DeepSpeed) becomes SHARDED (DCP). ``dry_run`` plans and reports without writing. URLs and
    ``storage_options`` are as for :func:`convert`. ``workers`` and ``distributed`` split the writing over
    processes, as for :func:`convert`.

    Args:
        src: The sharded checkpoint to read (DCP, LOCAL, verl or DeepSpeed): a directory or a URL.
        dst: Where to write; must not exist unless ``overwrite``.
        world_size: Ranks of the output.
        overwrite: Replace an existing ``dst``, atomically on a local filesystem.
        max_memory: Bytes of tensor data held in memory at once.
        fsync: Make the output durable across power loss before it is published.
        progress: Show a progress bar.
        local: How to read or write a LOCAL checkpoint.
        dry_run: Plan and report, write nothing.
        storage_options: Keyword arguments of the filesystem of a URL.
        workers: Processes of this machine that write the output files.
        distributed: Every rank of the default process group calls this, and each writes its share.

    Returns:
        What was written (or, with ``dry_run``, would be): files and sizes, notes.

    Raises:
        FormatError: A file of ``src`` is not what its format promises, or ``src`` is no checkpoint ckptkit
            knows.
        IncompleteCheckpointError: A rank file, chunk or shard of ``src`` is missing, or chunks overlap.
        UnsafeCheckpointError: A pickle in ``src`` names a global outside the allow-list.
        UsageError: The request is inconsistent: ``dst`` exists without ``overwrite``, lies inside ``src``,
            or ``src`` is not a sharded checkpoint (use :func:`convert`).
    """
    src, dst = storage_at(src, storage_options)[1], storage_at(dst, storage_options)[1]
    found = locate(src, local)
    reader = found.reader
    fmt = reader.format
    notes = _read_from(found.note)
    if not reader.writable:
        fmt, notes = Format.SHARDED, notes + (f"{reader.format.value} is read, not written: resharded as SHARDED "
                                              "(DCP)",)
    if fmt not in (Format.SHARDED, Format.LOCAL):
        raise UsageError(f"{src}: is {_a(reader.format.value)} checkpoint, not a sharded one; "
                         f"use 'ckptkit convert {src} DST --to sharded --world-size {world_size}'")
    manifest = reader.read(found.path)
    groups = meta_groups(manifest) if fmt is Format.SHARDED else None
    return write(manifest, fmt, dst, Target(world_size=world_size, meta_groups=groups), overwrite=overwrite,
                 max_memory=max_memory, fsync=fsync, progress=progress, notes=notes, src=src, dry_run=dry_run,
                 workers=workers, distributed=distributed)

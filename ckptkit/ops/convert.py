"""Any format to any format, and offline re-sharding: read a manifest, plan the target, stream it.

:func:`convert`, :func:`reshard` and :func:`ckptkit.export_hf` take how the output is written as one
:class:`~ckptkit.io.options.WriteOptions` (``options``), or its fields as keywords (:class:`WriteKeywords`),
turned into one by the same helper. ``workers`` processes of this machine (``"auto"``: as many as pay for the
plan, :func:`ckptkit.io.parallel.writers`), or with ``distributed`` every rank of the default process group
calling alike (torchrun, a save hook), each write their share and one publishes; the output is the one a
single process writes, byte for byte. URLs (``s3://``, ``gs://``, ``az://``; ``hf://`` to read) are opened
with ``storage_options`` (``{"endpoint_url": ..., "profile": ...}`` for s3fs).
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal, overload

from ..core.dtypes import DType, parse_cast
from ..core.manifest import Format, FormName, Manifest
from ..core.plan import Check, FilePlan, WritePlan
from ..core.reshape import computed_in
from ..errors import UsageError
from ..formats import FormatIO, FormatOptions, LocalOptions, Target, locate, writer_for
from ..formats.base import cast_for
from ..formats.dcp import check_blobs
from ..formats.replace import Replacement, check_replaceable, replacement
from ..io.execute import all_ranks, execute_distributed
from ..io.options import WriteOptions
from ..io.parallel import execute_parallel, writers
from ..io.progress import progress_bar
from ..io.storage import Storage, storage_at
from ..models.mapping import KeyMapping
from ..models.quantized import Dequantized, dequantize
from ._model import model_part
from ._options import (
    ConvertKeywords,
    ConvertOptions,
    WriteKeywords,
    check_keywords,
    mapping_of,
    options_of,
    storage_of,
    write_options,
)
from ._read_checks import read_by, recorded_checks
from .report import Changes, Report
from .select import meta_groups

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Changes", "ConvertKeywords", "ConvertOptions", "Report", "WriteKeywords", "convert", "parse_size",
           "reshard", "sources_of", "write"]

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


_UNCHANGED = Changes()


def sources_of(manifest: Manifest, src: Path | str | None = None) -> tuple[Path, ...]:
    """What an output must stay clear of: the input the user named and every file a conversion reads."""
    files = {c.span.file for t in manifest.tensors for c in t.chunks}
    files |= {o.blob.file for o in manifest.objects if o.blob is not None}
    named = str(src) if src is not None else manifest.root
    return tuple(storage_at(p)[1] for p in sorted({named, manifest.root, *files}))


def write(manifest: Manifest, io: FormatIO, dst: Path | str, target: Target | FormatOptions, options: WriteOptions,
          *, src: Path | str | None = None, extra_files: tuple[FilePlan, ...] = (), notes: tuple[str, ...] = (),
          changes: Changes = _UNCHANGED, checks: tuple[Check, ...] = ()) -> Report:
    """Write ``manifest`` in ``io``'s format to ``dst``, and report what was written.

    Args:
        manifest: What to write.
        io: The format's writer.
        dst: Where to write; it may not be, hold or lie inside ``src``, nor any file read from it.
        target: The output asked for, which ``io`` turns into its options; or those options themselves.
        options: How the bytes get to ``dst``; with ``dry_run``, only plan and check the destination.
        src: The input as the user named it.
        extra_files: Files written beside the format's own (an HF model's config and tokenizer).
        notes: For the report, before the notes on entries the format cannot hold.
        changes: The renames, drops and casts made on the way, for the report.
        checks: The source's recorded checksums (:func:`ckptkit.ops._read_checks.recorded_checks`): those of the
            bytes written are checked as they stream, and the output is published only if they hold.

    Returns:
        What was written, or with ``dry_run`` would be.

    Raises:
        UsageError: ``dst`` exists without ``overwrite``, or with it holds what is not a checkpoint (the rule of
            :func:`ckptkit.formats.replace.check_replaceable`), or lies inside ``src``; or ``workers`` asks for
            processes under ``distributed``.
    """
    start = time.perf_counter()
    if options.distributed and options.workers not in (1, "1", "auto"):
        raise UsageError(f"--workers {options.workers} splits the files over processes of one machine; under "
                         "torchrun the ranks split them: start more ranks (--nproc-per-node) instead")
    notes += _left_out(manifest, io)
    sources = sources_of(manifest, src)
    storage, out = storage_at(dst)
    storage.check(out, overwrite=options.overwrite, sources=sources, dry_run=options.dry_run)
    # Decoded now, whatever the target: a DCP writer copies them verbatim, and a damaged one means a checkpoint
    # torch cannot load, which no output may hide.
    check_blobs(manifest)
    layout = io.options(target, manifest) if isinstance(target, Target) else target
    plan = io.plan(computed_in_written_dtypes(manifest, layout), layout)
    plan = WritePlan(plan.files + extra_files, single_file=plan.single_file, commit=plan.commit,
                     checks=read_by(checks, manifest))
    replaced = Replacement()
    if options.overwrite:
        check_replaceable(out, single_file=plan.single_file)
        replaced = replacement(out, plan)
        plan = dataclasses.replace(plan, kept=replaced.kept)
    n, why = _execute(plan, storage, out, sources, options, io.format.value)
    ws = target.world_size if isinstance(target, Target) and io.ranked else None
    # A single-file output is DST itself, whatever name the plan gave its one file.
    written = tuple((out.name if plan.single_file else f.relpath, f.nbytes) for f in plan.files)
    return Report(manifest.root, manifest.format, str(dst), io.format, len(manifest.tensors), len(manifest.objects),
                  plan.total_bytes, len(plan.files), time.perf_counter() - start, ws, notes, written,
                  changes.renamed, changes.dropped, changes.cast, changes.permuted, options.dry_run, n, why,
                  kept=replaced.kept, removed=replaced.removed)


def computed_in_written_dtypes(manifest: Manifest, layout: FormatOptions) -> Manifest:
    """``manifest`` with each computed tensor that ``layout`` casts computed straight into its written dtype
    where that gives the same bits (:func:`ckptkit.core.reshape.computed_in`: an FP8 dequantization into bf16
    writes no float32 copy first)."""
    tensors = tuple(computed_in(t, layout.cast_of(t)) for t in manifest.tensors)
    if all(a is b for a, b in zip(tensors, manifest.tensors, strict=True)):
        return manifest
    return dataclasses.replace(manifest, tensors=tensors)


def _execute(plan: WritePlan, storage: Storage, out: Path, sources: tuple[Path, ...], options: WriteOptions,
             label: str) -> tuple[int, str]:
    """Write ``plan`` to ``out`` on ``storage`` by this machine's ``workers``, or this rank's share under
    ``distributed``; nothing on a dry run. Returns how many processes write, and why that many."""
    n, why = (1, "") if options.distributed else writers(options.workers, plan, storage, sources)
    if options.distributed and not options.dry_run:
        execute_distributed(plan, out, storage, options, sources)
    elif not options.dry_run:  # a dry run is planned and its destination checked: nothing to write
        with progress_bar(plan.total_bytes, label, options.progress) as update:
            execute_parallel(plan, out, storage, dataclasses.replace(options, workers=n), update, sources)
    return n, why


def _left_out(manifest: Manifest, io: FormatIO) -> tuple[str, ...]:
    """Notes on entries the target format cannot hold, so that nothing goes missing unreported."""
    notes = tuple(f"not read from the source: {what}" for fact, what in manifest.details if fact == "left out")
    return notes + io.not_held(manifest)


def _a(name: str) -> str:
    """A format's name after its article: "an hf", "a full"."""
    return f"{'an' if name == 'hf' or name[0] in 'aeiou' else 'a'} {name}"


@all_ranks
def convert(src: Path | str, dst: Path | str, *, to: Format | FormName | Literal["megatron", "deepspeed-universal"],
            mapping: KeyMapping | None = None, output: ConvertOptions | None = None, local: LocalOptions | None = None,
            options: WriteOptions | None = None, **keywords: Unpack[ConvertKeywords]) -> Report:
    """Convert the checkpoint at ``src`` into the form ``to`` at ``dst``, streaming tensor by tensor.

    FULL output is one ``torch.save`` file when ``dst`` ends in .pt/.pth/.bin/.ckpt and no shard size is given,
    else a directory (``pytorch_model.bin``, or HF-style ``pytorch_model-*.bin`` shards). HF output holds the
    model part, found and named as :func:`ckptkit.export_hf` does (use that for casts, config and tokenizer).
    SHARDED output from another form carries Lightning's ``meta.pt``, so Lightning loads it too. ``megatron``
    writes an HF model for megatron-core (the model at step 0 under its GPT names, with ``common.pt`` and
    ``metadata.json``), which its ``dist_checkpointing.load`` takes at any tensor-parallel size. A key mapping
    (:class:`ckptkit.KeyMapping`: ``key_map``, then ``renames``, then ``preset``) renames the model's weights;
    the optimizer state follows them, each moment mapped as its weight is, and the rest of the training state is
    carried as saved (:mod:`ckptkit.ops._optimizer`). ``src`` may be a run directory of :func:`ckptkit.save` (its
    ``latest`` step is read); ``src`` and ``dst`` may be URLs.

    Each group of options is one object, or its fields as keywords, which win: ``preset="auto", world_size=2`` is
    ``mapping=key_mapping(preset="auto"), output=ConvertOptions(world_size=2)``.

    Args:
        src: The checkpoint to read: a file, a directory, a run directory or a URL (``s3://``, ``hf://``, ...).
        dst: Where to write; must not exist unless ``overwrite``.
        to: The output form: ``full``, ``sharded``, ``local``, ``hf``, ``megatron`` or ``deepspeed-universal``
            (DeepSpeed's universal checkpoint: the model and its Adam state, for DeepSpeed's ``load_universal``).
        mapping: How the model's keys are renamed (:class:`ckptkit.KeyMapping`): a ``preset`` maps towards HF
            names for ``hf`` (default there: ``"auto"``, the family's, by ``model_type`` and the keys), a
            ``megatron-*`` one for ``megatron`` (default: the one for ``model_type``); ``hf_assets`` gives it the
            model's counts; ``megatron_args`` are the run's (for ``megatron``: the run the output is for).
        output: What the output is (:class:`ckptkit.ConvertOptions`): its ranks, its largest file, its ``dtype``
            (quantized weights then written as values, their scales left out: :mod:`ckptkit.models.quantized`).
        local: How to read or write a LOCAL checkpoint: rank file names, and how FSDP wraps the model.
        options: How the output is written (:class:`ckptkit.WriteOptions`): overwrite, dry run, processes.
        **keywords: Fields of ``mapping`` (``preset``, ``renames``, ``key_map``, ``strict_map``, ``hf_assets``,
            ``megatron_args``, as :func:`ckptkit.key_mapping` reads them), of ``output`` (``world_size``,
            ``max_shard_size``, ``dtype``) and of ``options`` (``overwrite=True``, ``workers=4``).

    Returns:
        What was written (or, with ``dry_run``, would be): files and sizes, keys renamed and left out, notes.

    Raises:
        FormatError: A file of ``src`` is not what its format promises, or no checkpoint ckptkit knows.
        IncompleteCheckpointError: A rank file, chunk or shard of ``src`` is missing, or chunks overlap.
        UnsafeCheckpointError: A pickle in ``src`` names a global outside the allow-list.
        UsageError: ``dst`` exists without ``overwrite``, lies inside ``src``, or an option is unknown.
    """
    check_keywords("convert", keywords, ConvertKeywords)
    options = write_options(options, keywords)
    output = options_of(ConvertOptions, output, keywords)
    mapping = mapping_of(mapping, keywords)
    io = writer_for(to, local)
    mapping = dataclasses.replace(mapping, preset="auto") if mapping.preset is None and io.hf_model else mapping
    cast = _cast(output.dtype, io)
    src, dst = storage_at(src, storage_of(options))[1], storage_at(dst, storage_of(options))[1]
    found = locate(src, local)
    manifest = found.reader.read(found.path)
    checks = recorded_checks(manifest, found.path) if options.verify_checksums else ()
    world_size, notes = _world_size(output.world_size, manifest, io)
    manifest, values = _values(manifest, cast, output.dtype)
    manifest, changes, model_notes = model_part(manifest, io, to, mapping, found.path)
    target = Target(to=to, destination=str(dst), world_size=world_size,
                    max_shard_size=parse_size(output.max_shard_size),
                    state_groups=meta_groups(manifest) if io.keeps_state_apart else None, cast=cast)
    casts = tuple((t.key, c.name) for t in manifest.tensors if (c := cast_for(t.dtype, cast)) is not None)
    changes = dataclasses.replace(changes, dropped=values.dropped + changes.dropped, cast=casts)
    return write(manifest, io, dst, target, options, src=src,
                 notes=_read_from(found.note) + notes + values.notes() + model_notes, changes=changes, checks=checks)


def _cast(dtype: str, io: FormatIO) -> DType | None:
    """The cast ``--dtype`` asks of ``io``'s output."""
    cast = parse_cast(dtype)
    if cast is not None and not io.casts:
        raise UsageError(f"--dtype {dtype}: {_a(io.format.value)} checkpoint is written in its source's dtypes "
                         "(--to full, sharded, megatron or hf cast)")
    return cast


def _values(manifest: Manifest, cast: DType | None, dtype: str) -> tuple[Manifest, Dequantized]:
    """``manifest`` with its quantized weights as values where ``cast`` writes values
    (:mod:`ckptkit.models.quantized`)."""
    if cast is None:
        return manifest, Dequantized(manifest.tensors)
    found = dequantize(manifest.tensors, f"--dtype {dtype}")
    return dataclasses.replace(manifest, tensors=found.tensors), found


def _read_from(note: str | None) -> tuple[str, ...]:
    return (note,) if note else ()


def _world_size(asked: int | None, manifest: Manifest, io: FormatIO) -> tuple[int, tuple[str, ...]]:
    """The ranks to lay the output out for, and a note when they are the source's by default."""
    if not io.ranked:
        if asked not in (None, 1):
            raise UsageError(f"--world-size {asked}: {_a(io.format.value)} checkpoint is not laid out for ranks; "
                             "the world size applies to --to sharded and --to local only")
        return 1, ()
    if asked is not None:
        return asked, ()
    ws = manifest.world_size or 1
    return ws, (f"world size {ws}, the source's (--world-size N lays it out for N ranks)",)


@all_ranks
def reshard(src: Path | str, dst: Path | str, *, world_size: int, local: LocalOptions | None = None,
            options: WriteOptions | None = None, **write_keywords: Unpack[WriteKeywords]) -> Report:
    """Re-lay-out a sharded checkpoint for ``world_size`` ranks, in its own format; no GPU or process group.

    The output keeps the source's rank file names and layout (LOCAL), and a DCP source's Lightning ``meta.pt``.
    Another framework's sharded layout that ckptkit reads but does not write (verl, DeepSpeed) becomes SHARDED
    (DCP). ``src``, ``dst``, ``local`` and the options are as for :func:`convert`.

    Args:
        src: The sharded checkpoint to read (DCP, LOCAL, verl or DeepSpeed): a directory or a URL.
        dst: Where to write; must not exist unless ``overwrite``.
        world_size: Ranks of the output.
        local: How to read a LOCAL checkpoint.
        options: How the output is written (:class:`ckptkit.WriteOptions`).
        **write_keywords: Fields of ``options`` as keywords; they win.

    Returns:
        What was written (or, with ``dry_run``, would be): files and sizes, notes.

    Raises:
        CheckpointError: As :func:`convert` raises them.
        UsageError: ``src`` is not a sharded checkpoint (use :func:`convert`).
    """
    check_keywords("reshard", write_keywords, WriteKeywords)
    options = write_options(options, write_keywords)
    src, dst = storage_at(src, storage_of(options))[1], storage_at(dst, storage_of(options))[1]
    found = locate(src, local)
    reader = found.reader
    io, notes = writer_for(reader.format if reader.writable else Format.SHARDED), _read_from(found.note)
    if not reader.writable:
        notes += (f"{reader.format.value} is read, not written: resharded as SHARDED (DCP)",)
    if not io.ranked:
        raise UsageError(f"{src}: is {_a(reader.format.value)} checkpoint, not a sharded one; "
                         f"use 'ckptkit convert {src} DST --to sharded --world-size {world_size}'")
    manifest = reader.read(found.path)
    checks = recorded_checks(manifest, found.path) if options.verify_checksums else ()
    target = Target(to=io.format.value, destination=str(dst), world_size=world_size,
                    state_groups=meta_groups(manifest) if io.keeps_state_apart else None)
    return write(manifest, io, dst, target, options, src=src, notes=notes, checks=checks)

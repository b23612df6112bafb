"""Any format to any format, and offline re-sharding: read a manifest, plan the target, stream it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from ..core.manifest import Format, Manifest
from ..core.plan import FilePlan, WritePlan
from ..errors import UsageError
from ..formats import LocalOptions, Target, detect, io_for, is_empty_container
from ..formats.dcp import check_blobs
from ..io.execute import DEFAULT_MAX_MEMORY, execute, execute_distributed
from ..io.progress import progress_bar
from ..io.publish import check_destination
from ..io.remote import as_path
from .select import meta_groups, select_model

__all__ = ["Report", "convert", "parse_size", "reshard", "sources_of", "write"]



@dataclass(frozen=True)
class Report:
    """What a conversion wrote."""

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

    def lines(self) -> list[str]:
        ws = f" for {self.world_size} ranks" if self.world_size else ""
        return [f"{self.source} ({self.source_format.value}) -> "
                f"{self.destination} ({self.destination_format.value}{ws})",
                f"  {self.tensors} tensors, {self.objects} other entries, {self.bytes / 1e6:.1f} MB "
                f"in {self.files} files, {self.seconds:.2f} s",
                *(f"  note: {n}" for n in self.notes)]


_BINARY = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


@overload
def parse_size(value: int | str, option: str = ...) -> int: ...
@overload
def parse_size(value: None, option: str = ...) -> None: ...


def parse_size(value: int | str | None, option: str = "--max-shard-size") -> int | None:
    """``"5GB"`` (decimal, by huggingface_hub's own parser, as HF uses) or ``"1GiB"`` (binary) to bytes."""
    if value is None or isinstance(value, int):
        return value
    text = value.strip().upper()
    unit = next((u for u in _BINARY if text.endswith(u)), None)
    try:
        if unit:
            return int(float(text[: -len(unit)]) * _BINARY[unit])
        if text.isdigit():
            return int(text)
        from huggingface_hub.serialization._base import parse_size_to_int

        return parse_size_to_int(text)
    except ValueError as e:
        raise UsageError(f"{option}: expected a size like 5GB, 512MiB or 1000000, got {value!r}") from e


def sources_of(manifest: Manifest, src: Path | str | None = None) -> tuple[Path, ...]:
    """What an output must stay clear of: the input the user named and every file a conversion reads."""
    files = {c.span.file for t in manifest.tensors for c in t.chunks}
    files |= {o.blob.file for o in manifest.objects if o.blob is not None}
    return tuple(as_path(p) for p in sorted({str(src) if src is not None else manifest.root, manifest.root, *files}))


def write(manifest: Manifest, fmt: Format, dst: Path | str, target: Target, *, overwrite: bool,
          max_memory: int, fsync: bool, progress: bool, extra_files: tuple[FilePlan, ...] = (),
          notes: tuple[str, ...] = (), distributed: bool = False, src: Path | str | None = None) -> Report:
    """Write ``manifest`` as ``fmt`` to ``dst``. ``src`` is the input as the user named it: ``dst`` may not be,
    hold or lie inside it (nor any file read from it)."""
    start = time.perf_counter()
    notes += _left_out(manifest, fmt)
    sources = sources_of(manifest, src)
    check_destination(as_path(dst), overwrite=overwrite, sources=sources)
    # Decoded now, whatever the target: a DCP writer copies them verbatim, and a damaged one means a checkpoint
    # torch cannot load, which no output may hide.
    check_blobs(manifest)
    io = io_for(fmt)
    plan = io.plan(manifest, io.options(target, manifest))
    plan = WritePlan(plan.files + extra_files, single_file=plan.single_file, commit=plan.commit)
    if distributed:
        execute_distributed(plan, as_path(dst), overwrite=overwrite, sources=sources, max_memory=max_memory,
                            fsync=fsync)
    else:
        with progress_bar(plan.total_bytes, f"{fmt.value}", progress) as update:
            execute(plan, as_path(dst), overwrite=overwrite, sources=sources, max_memory=max_memory, fsync=fsync,
                    progress=update)
    ws = target.world_size if fmt in (Format.SHARDED, Format.LOCAL) else None
    return Report(manifest.root, manifest.format, str(dst), fmt, len(manifest.tensors), len(manifest.objects),
                  plan.total_bytes, len(plan.files), time.perf_counter() - start, ws, notes)


def _left_out(manifest: Manifest, fmt: Format) -> tuple[str, ...]:
    """Notes on entries the target format cannot hold, so that nothing goes missing unreported."""
    notes = tuple(f"not read from the source: {what}" for fact, what in manifest.details if fact == "left out")
    return notes + _not_held(manifest, fmt)


def _not_held(manifest: Manifest, fmt: Format) -> tuple[str, ...]:
    if fmt is Format.HF and manifest.objects:
        return (f"{len(manifest.objects)} non-tensor entries not written (safetensors holds tensors only): "
                + ", ".join(o.key for o in manifest.objects[:5]) + (" ..." if len(manifest.objects) > 5 else ""),)
    empty = [o.key for o in manifest.objects if is_empty_container(o) and not o.sidecar]
    if fmt is Format.SHARDED and empty:
        return (f"empty containers not written (torch's DCP does not store them): {', '.join(empty[:5])}",)
    return ()


def convert(src: Path | str, dst: Path | str, *, to: Format | str, world_size: int = 1,
            max_shard_size: int | str | None = None, overwrite: bool = False,
            max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False, progress: bool = False,
            local: LocalOptions | None = None, storage_options: dict | None = None) -> Report:
    """Convert the checkpoint at ``src`` into format ``to`` at ``dst``, streaming tensor by tensor.

    FULL output is one ``torch.save`` file when ``dst`` ends in .pt/.pth/.bin/.ckpt and no shard size is
    given, else a directory (``pytorch_model.bin`` or HF-style ``pytorch_model-*.bin`` shards). HF output
    holds the model part only, found and named as :func:`ckptkit.export_hf` does (use that for casts,
    config and tokenizer files). SHARDED output from another form carries Lightning's ``meta.pt`` (the groups
    that are neither the model nor optimizer state, also kept in the DCP), so Lightning loads it too.

    ``local`` (:class:`LocalOptions`) applies to a LOCAL source or output: ``rank_files`` names the rank
    files (``"shard_{rank}.pt"``); ``model`` (``"package.module:factory"``), ``auto_wrap``,
    ``use_orig_params`` and ``param_dtype`` (``MixedPrecision(param_dtype=...)``) say how FSDP wraps the
    model, from which the flat-parameter layout is derived where no ``flat_layout.json`` has it.

    ``src`` and ``dst`` may be URLs (``s3://``, ``gs://``, ``az://``; ``hf://`` to read); ``storage_options``
    go to their filesystem (``{"endpoint_url": ..., "profile": ...}`` for s3fs).
    """
    fmt = io_for(to).format
    local = local or LocalOptions()
    src, dst = as_path(src, storage_options), as_path(dst, storage_options)
    manifest = detect(src, local).read(src)
    notes: tuple[str, ...] = ()
    if fmt is Format.HF:
        # A model file holds the model: the same part, under the same names, as export-hf writes.
        sel = select_model(manifest)
        manifest, notes = Manifest(manifest.format, manifest.root, sel.tensors), sel.notes
    target = Target(world_size=world_size, max_shard_size=parse_size(max_shard_size), destination=str(dst),
                    local=local, meta_groups=meta_groups(manifest) if fmt is Format.SHARDED else None)
    return write(manifest, fmt, dst, target, overwrite=overwrite, max_memory=max_memory, fsync=fsync,
                 progress=progress, notes=notes, src=src)


def reshard(src: Path | str, dst: Path | str, *, world_size: int, overwrite: bool = False,
            max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False, progress: bool = False,
            local: LocalOptions | None = None, storage_options: dict | None = None) -> Report:
    """Re-lay-out a sharded checkpoint for ``world_size`` ranks, in its own format; no GPU or process group.

    ``local`` is as for :func:`convert`; the output keeps the source's rank file names and layout, and a
    DCP source's Lightning ``meta.pt``. Another framework's sharded layout that ckptkit reads but does not
    write (verl, DeepSpeed) becomes SHARDED (DCP). URLs and ``storage_options`` are as for :func:`convert`.
    """
    src, dst = as_path(src, storage_options), as_path(dst, storage_options)
    reader = detect(src, local)
    fmt = reader.format
    notes: tuple[str, ...] = ()
    if not reader.writable:
        fmt, notes = Format.SHARDED, (f"{reader.format.value} is read, not written: resharded as SHARDED (DCP)",)
    if fmt not in (Format.SHARDED, Format.LOCAL):
        raise UsageError(f"{src}: is a {reader.format.value} checkpoint, not a sharded one; "
                         f"use 'ckptkit convert {src} DST --to sharded --world-size {world_size}'")
    manifest = reader.read(src)
    groups = meta_groups(manifest) if fmt is Format.SHARDED else None
    return write(manifest, fmt, dst, Target(world_size=world_size, meta_groups=groups), overwrite=overwrite,
                 max_memory=max_memory, fsync=fsync, progress=progress, notes=notes, src=src)

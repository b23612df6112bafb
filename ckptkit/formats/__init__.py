"""The checkpoint formats, each a reader and a writer behind :class:`FormatIO`.

Offers :func:`detect` and :func:`locate` (the reader of a path), :func:`io_for` (a format's reader and
writer), :func:`writer_for` (the writer a ``convert --to`` name asks for), :data:`WRITABLE` and :data:`TO`
(what is written, and by which names), :class:`Target` and :class:`LocalOptions` (what an output is asked
to be), and the entry helpers :func:`object_value`, :func:`scalar_value` and :func:`is_empty_container`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.manifest import Format, Manifest
from ..errors import CheckpointError, FormatError, UsageError
from ..io.storage import storage_at
from .base import FormatIO, FormatOptions, LocalOptions, Target, is_empty_container, object_value, scalar_value
from .megatron import WEIGHTS, nemo2_weights
from .run_directory import LATEST, is_run_directory, latest_step

__all__ = ["TO", "WRITABLE", "FormatIO", "FormatOptions", "LocalOptions", "Located", "Target", "detect", "io_for",
           "is_empty_container", "locate", "object_value", "read", "scalar_value", "writer_for"]

# Order matters: a DCP directory may also carry safetensors or .bin side files; its .metadata decides. torch's
# unconsolidated HF storage writer shards are safetensors files told apart by their headers, before HF. Other
# frameworks' layouts (verl, DeepSpeed, Megatron-LM's legacy one) are told by their file names, before FULL
# (their files are torch.save archives too) and LOCAL, which comes last: telling its rank files apart from other
# numbered files means opening them. Each is imported when first needed: a command loads the formats it meets
# (start-up time is part of every conversion's time). So each row repeats the names its class answers to
# (FormatIO.names; a test holds them equal), for the command line's --to to list without importing every format.
_ALL: tuple[tuple[Format, str, str, tuple[str, ...]], ...] = (
    (Format.SHARDED, "dcp", "DcpIO", ("sharded", "megatron")), (Format.HF_SHARDS, "hf_shards", "HfShardsIO", ()),
    (Format.HF, "hf", "HfIO", ("hf",)), (Format.VERL, "verl", "VerlIO", ()),
    (Format.DEEPSPEED_UNIVERSAL, "deepspeed.universal", "DeepSpeedUniversalIO", ("deepspeed-universal",)),
    (Format.DEEPSPEED, "deepspeed.zero", "DeepSpeedIO", ()),
    (Format.MEGATRON_LEGACY, "megatron.legacy", "MegatronLegacyIO", ()), (Format.FULL, "full", "FullIO", ("full",)),
    (Format.LOCAL, "local", "LocalIO", ("local",)))

WRITABLE: tuple[Format, ...] = tuple(fmt for fmt, _, _, names in _ALL if names)
"""The formats ckptkit writes (``convert --to``); the others it reads only."""

_BY_FORM = sorted((row for row in _ALL if row[3]), key=lambda row: list(Format).index(row[0]))
TO: tuple[str, ...] = (*(names[0] for *_, names in _BY_FORM), *(n for *_, names in _BY_FORM for n in names[1:]))
"""The names ``convert --to`` takes: each written format's own, in :class:`Format` order, then the others."""


def _load(module: str, name: str) -> Any:
    return getattr(importlib.import_module(f".{module}", __name__), name)


def io_for(fmt: Format | str) -> FormatIO:
    """The reader and writer of ``fmt``, one of :data:`WRITABLE` for writing."""
    try:
        fmt = Format(fmt)
    except ValueError:
        choices = ", ".join(f.value for f in sorted(WRITABLE, key=list(Format).index))
        raise UsageError(f"unknown format {fmt!r}; expected one of {choices}") from None
    for known, module, name, _ in _ALL:
        if known == fmt:
            return _load(module, name)()
    raise CheckpointError(f"no reader/writer for format {fmt.value!r}")


def writer_for(to: Format | str, local: LocalOptions | None = None) -> FormatIO:
    """The writer of the format that answers to the name ``to`` (:data:`TO`); ``local`` says how a LOCAL one
    lays its rank files out.

    Raises:
        UsageError: ``to`` names no format, or one ckptkit reads but does not write (when it plans).
    """
    for fmt, module, name, names in _ALL:
        if to in names:
            return _made(fmt, _load(module, name), local)
    return io_for(to)


def _made(fmt: Format, cls: Any, local: LocalOptions | None) -> FormatIO:
    return cls(local) if fmt is Format.LOCAL else cls()


@dataclass(frozen=True, slots=True)
class Located:
    """A checkpoint found at a path the user gave (:func:`locate`)."""

    path: Path
    """The checkpoint itself: the path given, the step of a run directory, or a NeMo 2 checkpoint's ``weights/``."""
    reader: FormatIO
    note: str | None = None
    """Which step of a run directory (or which part of a NeMo 2 checkpoint) was read, for the report; None for a
    checkpoint given as itself."""


def locate(path: Path | str, local: LocalOptions | None = None) -> Located:
    """The checkpoint at ``path`` (a local path or a URL) and its reader. A NeMo 2 checkpoint's top directory gives
    its ``weights/`` (:mod:`ckptkit.formats.megatron.nemo`). A run directory ``ckptkit.save`` wrote
    (``latest``, ``step-NNNNNNNN/``) gives the step ``ckptkit.load`` would read: the one ``latest`` names, once
    what killed saves left there is recovered (:func:`ckptkit.formats.run_directory.latest_step`).

    Args:
        path: a checkpoint or a run directory.
        local: applies if the checkpoint is a LOCAL one.

    Returns:
        The checkpoint's path, its reader, and a note naming the step read from a run directory.

    Raises:
        FormatError: ``path`` is no checkpoint ckptkit knows, nor a run directory.
        IncompleteCheckpointError: a run directory's ``latest`` names a step that is missing or incomplete.
    """
    path = storage_at(path)[1]
    weights = nemo2_weights(path)
    if weights is not None and _reader(path, local) is None:
        return Located(weights, detect(weights, local), f"read {WEIGHTS}/ of the NeMo 2 checkpoint {path}")
    if is_run_directory(path) and _reader(path, local) is None:  # (a checkpoint of another kind may hold latest)
        step = latest_step(path)
        how = f"the step {LATEST} names" if (path / LATEST).exists() else "the most recent complete save"
        return Located(step, detect(step, local), f"read {step.name} of the run directory {path}, {how}")
    return Located(path, detect(path, local))


def _reader(path: Path, local: LocalOptions | None) -> FormatIO | None:
    if not path.exists():
        return None
    for fmt, module, name, _ in _ALL:
        cls = _load(module, name)
        if cls.detect(path):
            return _made(fmt, cls, local)
    if local is not None and local.rank_files is not None and path.is_dir():
        # The pattern names the rank files; reading says what is wrong with them.
        return _load("local", "LocalIO")(local)
    return None


def detect(path: Path | str, local: LocalOptions | None = None) -> FormatIO:
    """The reader for ``path`` (a local path or a URL); ``local`` applies if it is a LOCAL checkpoint."""
    path = storage_at(path)[1]
    if not path.exists():
        raise FormatError(f"{path}: no such file or directory")
    if path.is_file() and _load("local", "is_rank_file")(path):
        raise UsageError(f"{path} is one rank's file of an FSDP1 LOCAL_STATE_DICT checkpoint; pass its directory "
                         f"{path.parent} (with --rank-files if other files there are numbered too)")
    reader = _reader(path, local)
    if reader is not None:
        return reader
    listing = ", ".join(sorted(p.name for p in path.iterdir())[:8]) if path.is_dir() else "a file of unknown type"
    raise FormatError(
        f"{path}: not a checkpoint ckptkit knows (found: {listing or 'an empty directory'}); expected a DCP "
        "directory with .metadata, a torch.save file or pytorch_model.bin[.index.json], "
        "model.safetensors[.index.json], FSDP1 LOCAL_STATE_DICT rank files (rank0.pt, ...), or a run directory "
        "of ckptkit.save (latest, step-NNNNNNNN)")


def read(path: Path | str) -> Manifest:
    return detect(path).read(storage_at(path)[1])

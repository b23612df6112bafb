"""Which existing destination a write may replace, and what of it the output keeps: the one rule of the
commands' ``--overwrite`` and of ``ckptkit.save`` without a step.

A write replaces DST only when what DST holds is a checkpoint again: one ckptkit reads (any format, a step a
save completed), an empty directory, or a file where the output is one file (a file the user named, replaced
by a file). Never the working directory or a directory above it,
nor (the storages' own check) the input or a directory above it: ``--overwrite`` of a folder of the user's
files, or of ``.``, is refused in one line that says what DST holds.

A model folder (an HF directory: safetensors or ``pytorch_model*.bin`` weights, beside the config, tokenizer,
generation config and model card a user keeps there) is the one DST whose other files are not the checkpoint's:
:func:`replacement` says what the output takes over. Its files of the names ckptkit writes are replaced; the
weights it holds under transformers' names that the output does not write again (the shards of an older export,
``pytorch_model.bin`` beside a new ``model.safetensors``) and ckptkit's own checksums are removed, so that no
reader finds old weights beside new ones; every other file is kept as it was and carried into the output
(``config.json`` too, where the output writes none). A single-file output cannot keep them, so it is refused.
Any other DST is replaced whole, and what goes is listed as removed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.manifest import Format
from ..core.plan import WritePlan
from ..errors import UsageError
from ..io.storage import storage_at
from ..io.storage.local.staging import COMPLETE

__all__ = ["Replacement", "check_replaceable", "replacement"]

_SHOWN = 6
_MODEL_FOLDERS = (Format.HF, Format.FULL, Format.HF_SHARDS)
"""The formats of a DST directory that is a model folder: weights beside files that are the user's."""
_STALE = re.compile(r"(?:(?:model|pytorch_model|tf_model|flax_model)(?:-\d+-of-\d+)?\.(?:safetensors|bin|h5|msgpack)"
                    r"(?:\.index\.json)?|ckptkit\.json)")
"""A model folder's files that the output takes over even where it does not write them again: weights under
the names transformers loads, their index, and ckptkit's checksums of the weights."""


def check_replaceable(dst: Path | str, *, single_file: bool = False,
                      writer: str = "--overwrite (overwrite=True)") -> None:
    """Refuse to replace ``dst`` unless it is a checkpoint, an empty directory, or a file where the output is
    one file; nothing to do where it does not exist (or is not a local path: an object store holds no one's
    working directory).

    Args:
        dst: The destination a write is about to replace.
        single_file: The output is one file (a torch.save file), not a directory.
        writer: Who replaces, for the message.

    Raises:
        UsageError: ``dst`` is the working directory or above it, or holds anything else; the message says what.
    """
    storage, path = storage_at(dst)
    if storage.scheme != "file" or not os.path.lexists(path):
        return
    real, here = Path(path).resolve(), Path.cwd().resolve()
    if real == here or real in here.parents:
        where = "the working directory" if real == here else f"a directory above the working directory {here}"
        raise UsageError(f"{path} is {where}; {writer} never replaces it: name a new directory for the output")
    held = _held(real, single_file)
    if held is not None:
        raise UsageError(f"{path} holds {held}, not a checkpoint ckptkit reads; {writer} replaces only a "
                         "checkpoint, an empty directory, or a file by a file: remove it yourself or name another "
                         "DST")


def _held(path: Path, single_file: bool) -> str | None:
    """What ``path`` holds in a few words, or None when a write may replace it."""
    from . import _reader

    if path.is_file():
        if single_file or _reader(path, None) is not None:
            return None
        return f"a file of {path.stat().st_size:,} bytes"
    if not path.is_dir():
        return "something that is neither a file nor a directory"
    names = sorted(p.name + "/" * p.is_dir() for p in path.iterdir())
    if not names or COMPLETE in names or _reader(path, None) is not None:
        return None
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{', '.join(names[:_SHOWN])}{more}"


@dataclass(frozen=True)
class Replacement:
    """What an overwrite does to the files the existing destination holds (paths relative to it, ``/``)."""

    kept: tuple[str, ...] = ()
    """Files and folders carried into the output as they are (a model folder's tokenizer, configs, card)."""
    removed: tuple[str, ...] = ()
    """Files and folders that go: neither written again nor kept."""
    model_folder: bool = False
    """DST is a model folder, whose files other than the weights are kept."""


def replacement(dst: Any, plan: WritePlan) -> Replacement:
    """What writing ``plan`` over the existing ``dst`` keeps and removes (the module's rule); nothing where
    ``dst`` does not exist or is a file.

    Args:
        dst: The destination, a path of its storage (local or a URL's).
        plan: The output's files.

    Returns:
        The files of ``dst`` kept and removed.

    Raises:
        UsageError: A single-file output over a model folder that holds files besides its weights.
    """
    from . import _reader

    if not dst.exists() or not dst.is_dir() or dst.is_symlink():
        return Replacement()
    reader = _reader(dst, None)
    model = (reader is not None and reader.format in _MODEL_FOLDERS and not (dst / COMPLETE).exists())
    written = {fp.relpath for fp in plan.files} if not plan.single_file else set()
    kept: list[str] = []
    removed: list[str] = []
    _sort(dst, "", written, model, kept, removed)
    if model and plan.single_file and kept:
        more = f" and {len(kept) - _SHOWN} more" if len(kept) > _SHOWN else ""
        raise UsageError(f"{dst} is a model folder holding {', '.join(kept[:_SHOWN])}{more} beside its weights; "
                         "--overwrite (overwrite=True) by a single file would delete them: name another DST")
    return Replacement(tuple(kept), tuple(removed), model)


def _sort(folder: Any, prefix: str, written: set[str], model: bool, kept: list[str], removed: list[str]) -> None:
    """File each entry of ``folder`` (``prefix`` its path in DST) under kept or removed; a folder the output
    writes into is gone through, one it does not is kept or removed whole."""
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        rel, is_dir = prefix + entry.name, entry.is_dir() and not entry.is_symlink()
        under = any(w.startswith(rel + "/") for w in written)
        if under and is_dir:
            _sort(entry, rel + "/", written, model, kept, removed)
        elif rel in written:
            continue  # replaced by the output's own file of that name
        elif model and not under and not (not prefix and _STALE.fullmatch(entry.name)):
            kept.append(rel + "/" * is_dir)
        else:
            removed.append(rel + "/" * is_dir)

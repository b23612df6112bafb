"""Which existing destination a write may replace: the one rule of the commands' ``--overwrite`` and of
``ckptkit.save`` without a step.

A write replaces DST only when what DST holds is a checkpoint again: one ckptkit reads (any format, a step a
save completed), an empty directory, or a file where the output is one file (a file the user named, replaced
by a file). Never the working directory or a directory above it,
nor (the storages' own check) the input or a directory above it: ``--overwrite`` of a folder of the user's
files, or of ``.``, is refused in one line that says what DST holds.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError
from ..io.storage import storage_at
from ..io.storage.local.staging import COMPLETE

__all__ = ["check_replaceable"]

_SHOWN = 6


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

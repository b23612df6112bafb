"""Run directories as readers find them: the layout ``ckptkit.save(..., step=N)`` writes, and which step to read.

A run directory holds step directories ``step-NNNNNNNN``, each complete once it holds the completion marker
:data:`COMPLETE` (which names its save number), and ``latest``, a small file naming the newest step. Readers
(:func:`ckptkit.formats.locate`, ``ckptkit.load``) trust none of it: ``latest`` must name a complete step
directory inside the run directory, and with no ``latest`` the most recently saved complete step is read.
Writing the layout (step names, markers, ``latest``, rotation) is :mod:`ckptkit.training.rotation`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError, IncompleteCheckpointError
from ..io.storage import storage_for
from ..io.storage.local.staging import COMPLETE, recover

__all__ = ["COMPLETE", "LATEST", "StepDir", "complete_steps", "is_run_directory", "latest_step", "recover_run",
           "resolve"]

LATEST = "latest"
_STEP = re.compile(r"step-(\d+)")  # a step directory; the number is the training step
_SMALL_FILE = 4096  # latest and the completion marker are a line each; anything longer is not ours


@dataclass(frozen=True)
class StepDir:
    step: int
    path: Path
    save: int | None
    """The save number from the completion marker; None for a step saved before ckptkit recorded it."""

    @property
    def order(self) -> tuple[int, int]:
        return (-1 if self.save is None else self.save, self.step)

    @property
    def nbytes(self) -> int:
        total = 0
        for directory, _, files in os.walk(self.path):  # os.walk does not follow links into other trees
            total += sum(os.lstat(os.path.join(directory, f)).st_size for f in files)
        return total


def _read_small(path: Path) -> str | None:
    """A regular file's text, or None for a link, a directory, or anything longer than a line."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _SMALL_FILE:
            return None
        return path.read_text(errors="replace")
    except OSError:
        return None


def _save_number(marker: Path) -> int | None:
    text = _read_small(marker)
    try:
        save = json.loads(text)["save"] if text else None
    except (ValueError, TypeError, KeyError, RecursionError):
        return None  # "complete\n" from before save numbers, or a marker that is not ours
    return save if isinstance(save, int) and not isinstance(save, bool) and save >= 0 else None


def _is_complete(path: Path) -> bool:
    return _read_small(path / COMPLETE) is not None


def complete_steps(root: Path | str) -> list[StepDir]:
    """Complete step directories directly under ``root``, oldest save first. Partial ones (no marker) and
    symbolic links are ignored: a step directory is a real directory inside the run directory."""
    root = Path(root)
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for e in entries:
        m = _STEP.fullmatch(e.name)
        if m and e.is_dir(follow_symlinks=False) and _is_complete(Path(e.path)):
            found.append(StepDir(int(m.group(1)), Path(e.path), _save_number(Path(e.path) / COMPLETE)))
    return sorted(found, key=lambda s: s.order)


def resolve(path: Path | str) -> Path:
    """A checkpoint directory from ``path``: the step ``latest`` names when ``path`` is a run directory, the
    most recently saved complete step when it has no ``latest``, else ``path`` itself.

    ``latest`` is checked as untrusted: it must be a file naming a step directory inside ``path``, not a
    symbolic link, and that step must be complete.
    """
    path = Path(path)
    pointer = path / LATEST
    if not os.path.lexists(pointer):
        steps = complete_steps(path)
        return steps[-1].path if steps else path
    text = _read_small(pointer)
    if text is None:
        raise FormatError(f"{pointer}: expected a small file naming a step directory (ckptkit writes "
                          "'step-NNNNNNNN'), found a link, a directory or a large file")
    name = text.strip()
    if not _STEP.fullmatch(name):
        raise FormatError(f"{pointer}: names {name[:80]!r}; expected a step directory of {path} "
                          "('step-NNNNNNNN'), not a path")
    target = path / name
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{pointer} names {name}, which does not exist") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise FormatError(f"{pointer} names {name}, which is not a directory of {path} (a symbolic link?); "
                          "ckptkit follows latest only to a step directory inside the run directory")
    if not _is_complete(target):
        raise IncompleteCheckpointError(f"{pointer} names {name}, which is not a complete checkpoint")
    return target


def recover_run(path: Path | str) -> None:
    """Recover what saves killed midway left in the run directory ``path`` and beside it
    (:func:`ckptkit.io.storage.local.staging.recover`), as far as the filesystem lets: a read-only checkpoint
    has nothing to recover, or nothing we may touch."""
    path = Path(path)
    for directory in (path.parent, path):
        with contextlib.suppress(OSError):
            recover(directory)


def is_run_directory(path: Path | str) -> bool:
    """Whether ``path`` is a run directory ``ckptkit.save`` writes: a local directory holding ``latest`` or a
    step directory (``step-NNNNNNNN``)."""
    if storage_for(path).scheme != "file":
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return LATEST in names or any(_STEP.fullmatch(n) for n in names)


def latest_step(path: Path | str) -> Path:
    """The step of the run directory ``path`` that ``ckptkit.load`` reads: the one ``latest`` names, else the most
    recently saved complete one, once what killed saves left is recovered (:func:`recover_run`, :func:`resolve`).

    Raises:
        IncompleteCheckpointError: ``latest`` names a missing or incomplete step, or no step is complete.
        FormatError: ``latest`` is a link, or names something other than a step directory of ``path``.
    """
    path = Path(path)
    recover_run(path)
    step = resolve(path)
    if step == path:
        found = ", ".join(sorted(n for n in os.listdir(path) if _STEP.fullmatch(n))[:4])
        raise IncompleteCheckpointError(f"{path}: a run directory without a complete step (found: {found}; a "
                                        f"complete one holds {COMPLETE}); was every save killed before it finished?")
    return step

"""Run directories (``ckptkit.save(..., step=N)``): step directories, ``latest``, rotation.

Each step directory is published as any local output is (:mod:`ckptkit.io.storage.local.staging`: staged beside
it, its completion marker written, moved into place in one step). After the commit come ``latest`` (a file
naming the newest step directory, written atomically) and rotation (:func:`rotate`), which keeps the most recent
*saves*, counted by the save number in each step's completion marker, and never the step just published.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError, IncompleteCheckpointError, UsageError
from .storage import storage_for
from .storage.local.staging import COMPLETE, _exists, _fsync_dir, _owned_name, _remove, _write_file, recover

__all__ = ["COMPLETE", "LATEST", "StepDir", "complete_steps", "is_run_directory", "latest_step", "marker_text",
           "next_save", "point_latest", "recover_run", "resolve", "rotate", "step_dir"]

LATEST = "latest"
_STEP = re.compile(r"step-(\d+)")
_SMALL_FILE = 4096  # latest and the completion marker are a line each; anything longer is not ours


# --------------------------------------------------------------------------------------------------------
# Run directories: step directories, latest, rotation


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


def step_dir(root: Path | str, step: int) -> Path:
    if step < 0:
        raise UsageError(f"step must be >= 0, got {step}")
    return Path(root) / f"step-{step:08d}"


def marker_text(*, save: int, step: int | None) -> str:
    """The completion marker of a save: which save it was, so that rotation can tell the most recent ones."""
    return json.dumps({"save": save, "step": step}) + "\n"


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


def next_save(root: Path | str) -> int:
    """The save number for a new save under ``root``: one more than any complete step's."""
    return 1 + max((s.save for s in complete_steps(root) if s.save is not None), default=0)


def point_latest(root: Path, step: Path) -> None:
    """Make ``root/latest`` name ``step`` (a directory in ``root``), atomically."""
    tmp = root / _owned_name(LATEST, "partial")
    _write_file(tmp, step.name + "\n", fsync=True)
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def resolve(path: Path | str) -> Path:
    """A checkpoint directory from ``path``: the step ``latest`` names when ``path`` is a run directory, the
    most recently saved complete step when it has no ``latest``, else ``path`` itself.

    ``latest`` is checked as untrusted: it must be a file naming a step directory inside ``path``, not a
    symbolic link, and that step must be complete.
    """
    path = Path(path)
    pointer = path / LATEST
    if not _exists(pointer):
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
    """Recover what saves killed midway left in the run directory ``path`` and beside it (:func:`recover`), as
    far as the filesystem lets: a read-only checkpoint has nothing to recover, or nothing we may touch."""
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


def rotate(root: Path | str, *, keep: Path, keep_last: int | None = None,
           max_total_bytes: int | None = None) -> list[Path]:
    """Remove complete steps of the least recent saves beyond ``keep_last`` or ``max_total_bytes``; never
    ``keep`` (the step just published). Never follows a link. Returns the removed paths."""
    if keep_last is not None and keep_last < 1:
        raise UsageError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    steps = complete_steps(root)
    sizes = {s.path: s.nbytes for s in steps} if max_total_bytes is not None else {}
    count, total = len(steps), sum(sizes.values())
    removed = []
    for victim in [s for s in steps if s.path != Path(keep)]:
        over_count = keep_last is not None and count > keep_last
        over_size = max_total_bytes is not None and total > max_total_bytes
        if not (over_count or over_size):
            break
        # Out of sight first, in one rename: a kill mid-delete leaves a leftover that recover() removes,
        # never a half-deleted step that still looks complete.
        trash = root / _owned_name(victim.path.name, "partial")
        os.rename(victim.path, trash)
        _remove(trash)
        removed.append(victim.path)
        count, total = count - 1, total - sizes.get(victim.path, 0)
    return removed

"""Run directories as ``ckptkit.save(..., step=N)`` writes them: step directories, ``latest``, rotation.

A save with a step is published into ``step-NNNNNNNN`` (:func:`step_dir`) with a completion marker naming its
save number (:func:`marker_text`, :func:`next_save`). After the commit come ``latest`` (a file naming the
newest step directory, written atomically: :func:`point_latest`) and rotation (:func:`rotate`), which keeps
the most recent *saves*, counted by the save number in each step's completion marker, and never the step just
published. How readers find the step to read is :mod:`ckptkit.formats.run_directory`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import UsageError
from ..formats.run_directory import LATEST, complete_steps
from ..io.storage.local.staging import fsync_dir, owned_name, remove_path, write_file

__all__ = ["marker_text", "next_save", "point_latest", "rotate", "step_dir"]


def step_dir(root: Path | str, step: int) -> Path:
    if step < 0:
        raise UsageError(f"step must be >= 0, got {step}")
    return Path(root) / f"step-{step:08d}"


def marker_text(*, save: int, step: int | None) -> str:
    """The completion marker of a save: which save it was, so that rotation can tell the most recent ones."""
    return json.dumps({"save": save, "step": step}) + "\n"


def next_save(root: Path | str) -> int:
    """The save number for a new save under ``root``: one more than any complete step's."""
    return 1 + max((s.save for s in complete_steps(root) if s.save is not None), default=0)


def point_latest(root: Path, step: Path) -> None:
    """Make ``root/latest`` name ``step`` (a directory in ``root``), atomically."""
    tmp = root / owned_name(LATEST, "partial")
    write_file(tmp, step.name + "\n", fsync=True)
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def rotate(root: Path | str, *, keep: Path, keep_last: int | None = None, max_total_bytes: int | None = None,
           remove: Callable[[Path], None] = remove_path) -> list[Path]:
    """Remove complete steps of the least recent saves beyond ``keep_last`` or ``max_total_bytes``; never
    ``keep`` (the step just published). Never follows a link. Returns the removed paths.

    Each is first renamed out of sight (a hidden name of this process's, which ``recover`` removes once the
    process is gone); ``remove`` then deletes it under that name, here or later (a save's background thread)."""
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
        trash = root / owned_name(victim.path.name, "partial")
        os.rename(victim.path, trash)
        remove(trash)
        removed.append(victim.path)
        count, total = count - 1, total - sizes.get(victim.path, 0)
    return removed

"""Publishing outputs: staging beside the destination and the atomic move into place; and, for save hooks,
step directories, the completion marker, the ``latest`` pointer and rotation.

A conversion writes into ``.DST.ckptkit-partial-PID`` beside DST and renames it into place at the end, so
DST is complete or absent.

A root holds ``step-00000100/``, ``step-00000200/``, ...; a step directory counts only once it carries
``.ckptkit-complete`` (written last, after every rank's files), and ``latest`` names the newest complete one.
A save publishes its staging directory with one rename, moves ``latest`` with another, and only then
rotates: older complete steps are removed to honour ``keep_last`` / ``max_total_bytes``, never the newest,
so a crash at any point leaves the previous ``latest`` intact and loadable.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import IncompleteCheckpointError, UsageError

__all__ = ["COMPLETE", "LATEST", "StepDir", "check_destination", "complete_steps", "publish", "replace_with",
           "resolve", "rotate", "staged_output", "step_dir"]

COMPLETE = ".ckptkit-complete"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True, order=True)
class StepDir:
    step: int
    path: Path

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())


def step_dir(root: Path, step: int) -> Path:
    if step < 0:
        raise UsageError(f"step must be >= 0, got {step}")
    return Path(root) / f"step-{step:08d}"


def complete_steps(root: Path) -> list[StepDir]:
    """Complete step directories under ``root``, oldest first; partial ones (no marker) are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [StepDir(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(s for s in found if (s.path / COMPLETE).is_file())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(stage: Path, final: Path, *, marker: str = "") -> Path:
    """Mark ``stage`` complete, rename it to ``final`` and point ``latest`` of its root at it."""
    _write_atomic(stage / COMPLETE, marker or "complete\n")
    if final.exists():
        shutil.rmtree(final)
    os.rename(stage, final)
    _write_atomic(final.parent / LATEST, final.name + "\n")
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def resolve(path: Path) -> Path:
    """A checkpoint directory from ``path``: itself, or the step ``latest`` names when ``path`` is a root."""
    path = Path(path)
    pointer = path / LATEST
    if pointer.is_file():
        target = path / pointer.read_text().strip()
        if not (target / COMPLETE).is_file():
            raise IncompleteCheckpointError(f"{pointer} names {target.name}, which is not a complete checkpoint")
        return target
    steps = complete_steps(path)
    if steps:
        return steps[-1].path
    return path


def rotate(root: Path, *, keep_last: int | None = None, max_total_bytes: int | None = None) -> list[Path]:
    """Remove the oldest complete steps beyond ``keep_last`` or ``max_total_bytes``; never the newest one."""
    if keep_last is not None and keep_last < 1:
        raise UsageError(f"keep_last must be >= 1, got {keep_last}")
    steps = complete_steps(root)
    removed: list[Path] = []
    sizes = {s.path: s.nbytes for s in steps} if max_total_bytes is not None else {}
    while len(steps) > 1:
        over_count = keep_last is not None and len(steps) > keep_last
        over_size = max_total_bytes is not None and sum(sizes[s.path] for s in steps) > max_total_bytes
        if not (over_count or over_size):
            break
        oldest = steps.pop(0)
        # Drop the marker first: a crash mid-delete then leaves a partial directory, never a "complete" one.
        (oldest.path / COMPLETE).unlink()
        shutil.rmtree(oldest.path)
        removed.append(oldest.path)
    return removed


def check_destination(dst: Path, *, overwrite: bool, sources: tuple[Path, ...] = ()) -> Path:
    """Refuse a destination that exists (unless ``overwrite``) or that overlaps an input."""
    dst = Path(dst).absolute()
    d = dst.resolve()
    for src in sources:
        src = Path(src).resolve()
        if d == src or src in d.parents or d in src.parents:
            raise UsageError(f"destination {dst} overlaps the input {src}; ckptkit never writes into its input")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    return dst


def replace_with(dst: Path, new: Path) -> None:
    """Put ``new`` (a finished staging directory or file) at ``dst``, replacing what was there."""
    old = dst.parent / f".{dst.name}.ckptkit-old-{os.getpid()}"
    had_old = dst.exists() or dst.is_symlink()
    if had_old:
        os.rename(dst, old)
    os.rename(new, dst)
    if had_old:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    _fsync_dir(dst.parent)


@contextlib.contextmanager
def staged_output(dst: Path, *, single_file: str | None = None) -> Iterator[Path]:
    """Yield a fresh staging directory beside ``dst``; on success it (or its one file ``single_file``)
    replaces ``dst``, on any failure it vanishes and ``dst`` is left as it was."""
    dst = Path(dst).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    stage = dst.parent / f".{dst.name}.ckptkit-partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        yield stage
        replace_with(dst, stage / single_file if single_file else stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

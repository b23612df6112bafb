"""Local paths (and ``file://`` URLs): the :class:`LocalStorage` backend.

:mod:`.staging` stages beside DST and moves the result into place with ``renameat2`` (its ``flock`` fallback
where a filesystem refuses it), and recovers what dead runs left; :mod:`.writer` streams a plan's byte ranges
into the staged files with ``copy_file_range`` and ``preadv``. Several processes may write byte ranges of one
staged file (``shared_writes``), and sources give descriptors (``descriptors``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ....core.plan import WritePlan
from ....core.split import Slice
from ....errors import FormatError, UsageError
from ...moves import Moves
from ..base import Source, Staged, Storage
from .staging import Staging, check_destination, recover, stage

__all__ = ["LOCAL", "LocalStorage"]


class _LocalSource(Source):
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def fileno(self) -> int:
        return self.fd


class _LocalStaged(Staged):
    """A staging directory beside ``dst`` (:class:`~.staging.Staging`), every file of the plan made at its size
    so that any process fills byte ranges of it in any order."""

    def __init__(self, staging: Staging, plan: WritePlan | None, *, single_file: bool, overwrite: bool = False,
                 fsync: bool = False) -> None:
        self.staging, self.plan, self.single_file = staging, plan, single_file
        self.overwrite, self.fsync = overwrite, fsync
        self.dst, self.token = staging.dst, str(staging.path)

    def name(self, relpath: str) -> Path:
        """The file ``relpath`` as the user will see it: in DST, not in the staging directory."""
        return self.dst if self.single_file else self.dst / relpath

    def write(self, pieces: Iterable[Slice | Moves], *, max_memory: int, fsync: bool = False,
              progress: Callable[[int], None] = lambda n: None, streamed: bool = False) -> None:
        from . import writer  # reads through ckptkit.io.sources, which finds this storage

        where = self.staging.path
        writer.write_descriptors(pieces, lambda relpath: os.open(where / relpath, os.O_WRONLY),
                                 max_memory=max_memory, fsync=fsync, progress=progress, name_of=self.name,
                                 streamed=streamed)

    def commit(self) -> Path:
        """Publish once every file of the plan is there with its planned size: a process that wrote somewhere
        else (a rank whose filesystem is not shared with rank 0's) leaves a hole, never a short output."""
        if self.plan is None:
            raise UsageError(f"{self.dst}: only the process that staged the output commits it")
        for fp in self.plan.files:
            path = self.staging.path / fp.relpath
            size = path.stat().st_size if path.is_file() else None
            if size != fp.nbytes:
                self.staging.abort()
                raise FormatError(f"{self.dst / fp.relpath}: expected {fp.nbytes} bytes from the process that "
                                  f"wrote it, found {'no file' if size is None else f'{size} bytes'}; is DST on a "
                                  "filesystem every process shares?")
        return self.staging.commit(replace=self.overwrite, file=self.plan.files[0].relpath if self.single_file
                                   else None, fsync=self.fsync, keep=self.plan.kept)

    def abort(self) -> None:
        self.staging.abort()


class LocalStorage(Storage):
    """Local filesystems, shared ones (NFS, Lustre) included."""

    scheme = "file"
    shared_writes = True
    descriptors = True

    def path(self, path: Any) -> Path:
        text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
        if isinstance(text, str) and text.lower().startswith("file://"):
            return Path(text[len("file://"):])
        return path if isinstance(path, Path) else Path(path)

    def source(self, path: str) -> Source:
        return _LocalSource(path)

    def check(self, dst: Any, *, overwrite: bool, sources: tuple[Any, ...] = (), dry_run: bool = False) -> Path:
        return check_destination(dst, overwrite=overwrite, sources=sources)

    def stage(self, dst: Any, plan: WritePlan, *, overwrite: bool, fsync: bool = False) -> Staged:
        staged = _LocalStaged(stage(dst, replace=overwrite), plan, single_file=plan.single_file,
                              overwrite=overwrite, fsync=fsync)
        from .writer import allocate

        with staged:
            allocate(plan.files, staged.staging.path, {fp.relpath: staged.name(fp.relpath)
                                                              for fp in plan.files})
        return staged

    def join(self, dst: Any, token: str, *, single_file: bool, who: str) -> Staged:
        path = Path(token)
        if not path.is_dir():
            raise UsageError(f"{path}, rank 0's staging directory beside DST, is not visible from {who}: DST must "
                             "be on a filesystem every rank shares")
        return _LocalStaged(Staging(Path(dst).absolute(), path, owner=False), None, single_file=single_file)

    def recover(self, directory: Any) -> list[str]:
        return recover(directory)


LOCAL = LocalStorage()
"""The local storage (it holds no state)."""

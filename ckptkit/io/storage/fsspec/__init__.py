"""Object stores through fsspec (``s3://``, ``gs://``, ``az://``, ``hf://``...): the :class:`FsspecStorage` backend.

:mod:`.paths` has :class:`~.paths.RemotePath` (what readers use instead of :class:`pathlib.Path`), the
filesystems kept per protocol with their credentials, and the one-line URL errors; :mod:`.reads` the ranged,
concurrent reads (:class:`~.reads.RemoteFiles`); :mod:`.staging` an output written in place with its commit file
last, its marker, and the recovery of dead runs (S3 multipart uploads included); :mod:`.upload` the streams that
produce a plan's files front to back. One process writes an output (no ``shared_writes``); sources are streamed
by ranged reads (no ``descriptors``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ....core.plan import WritePlan
from ....core.split import Slice
from ....errors import FormatError, UsageError
from ...moves import Moves
from ..base import Source, Staged, Storage
from .paths import RemotePath, check_protocol, keep_filesystems, known_filesystems, remote_path
from .staging import ObjectStaging, check_object_destination, recover_objects, stage_object

__all__ = ["FsspecStorage", "RemotePath"]


class _ObjectStaged(Staged):
    def __init__(self, staging: ObjectStaging, plan: WritePlan, commit: str) -> None:
        self.staging, self.plan, self.commit_file = staging, plan, commit
        self.dst, self.token = staging.dst, str(staging.marker)

    def write(self, pieces: Iterable[Slice | Moves], *, max_memory: int, fsync: bool = False,
              progress: Callable[[int], None] = lambda n: None, streamed: bool = False) -> None:
        from ..local.writer import cast_bytes
        from .upload import upload

        wanted = set()
        for piece in pieces:
            if not isinstance(piece, Slice) or piece.start != 0:
                raise FormatError(f"{self.dst}: an object is uploaded whole, by one process; got a byte range of "
                                  f"{piece.relpath}")
            wanted.add(piece.relpath)
        upload([fp for fp in self.plan.files if fp.relpath in wanted], self.staging, commit=self.commit_file,
               max_memory=max_memory, cast_bytes=cast_bytes, progress=progress)

    def commit(self) -> RemotePath:
        return self.staging.commit()

    def abort(self) -> None:
        self.staging.abort()


class FsspecStorage(Storage):
    """The object stores of fsspec's filesystems. Its state, the filesystems kept per protocol with the run's
    storage options, travels with it to a worker process (pickled)."""

    scheme = "fsspec"
    shared_writes = False
    descriptors = False

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options = storage_options

    @classmethod
    def of(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> FsspecStorage:
        """The storage of ``url``, whose protocol is checked here (its filesystem is made by :meth:`path`).

        Raises:
            UsageError: an unknown protocol, or a protocol whose package is missing.
        """
        check_protocol(url)
        return cls(storage_options)

    def __getstate__(self) -> dict[str, Any]:
        return {"filesystems": known_filesystems()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        keep_filesystems(state["filesystems"])  # a URL source is read with the run's --storage-options
        self.storage_options = None

    def path(self, path: Any) -> RemotePath:
        return path if isinstance(path, RemotePath) else remote_path(str(path), self.storage_options)

    def source(self, path: str) -> Source:
        raise FormatError(f"{path}: a URL has no file descriptor; read it with Files.pread or Files.read")

    def check(self, dst: Any, *, overwrite: bool, sources: tuple[Any, ...] = (),
              dry_run: bool = False) -> RemotePath:
        return check_object_destination(self.path(dst), overwrite=overwrite, sources=sources, dry_run=dry_run)

    def stage(self, dst: Any, plan: WritePlan, *, overwrite: bool, fsync: bool = False) -> Staged:
        dst = self.path(dst)
        if not plan.files:
            raise UsageError(f"{dst}: nothing to write")
        commit = plan.commit or plan.files[-1].relpath
        return _ObjectStaged(stage_object(dst, replace=overwrite, commit=None if plan.single_file else commit,
                                          keep=plan.kept), plan, commit)

    def recover(self, directory: Any) -> list[str]:
        return recover_objects(self.path(directory))

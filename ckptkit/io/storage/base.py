"""The storage interface: where an output is written and its sources read, whatever holds them."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from ...core.plan import WritePlan
from ...core.split import Slice
from ...errors import FormatError, UsageError
from ..moves import Moves

__all__ = ["Source", "Staged", "Storage", "bounds_error"]


class Source(ABC):
    """One source file, open for reading until :meth:`close`."""

    size: int
    """The file's size in bytes."""

    @abstractmethod
    def fileno(self) -> int:
        """A descriptor of the file, for ``copy_file_range`` and ``preadv`` (storages with ``descriptors``)."""

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes from ``offset``, as :func:`os.pread` reads them."""
        return os.pread(self.fileno(), n, offset)

    def close(self) -> None:
        os.close(self.fileno())


class Staged(ABC):
    """A staged output: the handle :meth:`Storage.stage` returns (or :meth:`Storage.join`, another process's
    view of it, which writes and nothing more). Used as a context manager, an exception aborts it."""

    dst: Any
    """Where the output goes, as its storage's path."""
    token: str
    """What another process passes to :meth:`Storage.join` to write into this staged output."""

    @abstractmethod
    def write(self, pieces: Iterable[Slice | Moves], *, max_memory: int, fsync: bool = False,
              progress: Callable[[int], None] = lambda n: None, streamed: bool = False) -> None:
        """Call 3: write ``pieces`` (byte ranges or whole files of the plan, packed moves from a worker's share)
        reading the sources through a :class:`~ckptkit.io.sources.Files` of its own, within ``max_memory``.
        ``streamed``: some sources are read by ranged requests (their storage has no descriptors).

        Raises:
            OSError: a write failed; the message names the file as the user knows it.
            CheckpointError: a source is short or unreadable.
        """

    @abstractmethod
    def commit(self) -> Any:
        """Call 4: publish the output at ``dst`` in one step, once every file has its planned size; returns
        ``dst``. A failure aborts.

        Raises:
            UsageError: DST appeared meanwhile (without ``overwrite``).
            FormatError: a file is missing or short (a process wrote somewhere else).
        """

    @abstractmethod
    def abort(self) -> None:
        """Call 4, on any failure: remove what was staged; ``dst`` is left as it was."""

    def __enter__(self) -> Staged:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.abort()


class Storage(ABC):
    """Where checkpoints are read and written: the local filesystem, an object store, memory.

    The calls a write makes, in order (:func:`ckptkit.io.execute.execute`):

    1. :meth:`check` the destination: refuse one that exists (without ``overwrite``), that is, holds or lies
       inside any source, or that cannot be written; ``dry_run`` judges without cleaning anything up;
    2. :meth:`stage` an output for the plan, returning a :class:`Staged` handle (what dead runs of this host
       left beside DST is recovered first); other processes :meth:`join` it by its ``token`` when
       ``shared_writes`` allows;
    3. :meth:`Staged.write` the plan's pieces, from every process that shares the work;
    4. :meth:`Staged.commit` once all have written, or :meth:`Staged.abort` on any failure;
    5. :meth:`recover` what dead runs of this host left in a directory (also part of 1 and 2).

    Reads: :meth:`path` gives the pathlib-like object the readers use (``/``, ``name``, ``exists``,
    ``iterdir``, ``read_bytes``...), and :meth:`source` opens one file's bytes.
    """

    scheme: ClassVar[str]
    """The URL scheme the storage is registered under (``file`` for local paths)."""
    shared_writes: ClassVar[bool]
    """Whether several processes may write byte ranges of one staged file (``--workers``, torchrun ranks)."""
    descriptors: ClassVar[bool]
    """Whether sources give descriptors (kernel copies, ``preadv``); otherwise they are streamed by ranged
    reads (:class:`~ckptkit.io.storage.fsspec.reads.RemoteFiles`)."""

    @abstractmethod
    def path(self, path: Any) -> Any:
        """``path`` (a string, or a path of this storage) as the pathlib-like object readers use."""

    def exists(self, path: Any) -> bool:
        return bool(self.path(path).exists())

    def iterdir(self, path: Any) -> Iterator[Any]:
        return iter(self.path(path).iterdir())

    @abstractmethod
    def source(self, path: str) -> Source:
        """Open the source file ``path`` for reading.

        Raises:
            OSError: it cannot be opened.
        """

    @abstractmethod
    def check(self, dst: Any, *, overwrite: bool, sources: tuple[Any, ...] = (), dry_run: bool = False) -> Any:
        """Call 1: refuse a destination this run may not write; returns DST as the path :meth:`stage` takes.

        Raises:
            UsageError: DST exists (without ``overwrite``), overlaps a source, or cannot be written.
        """

    @abstractmethod
    def stage(self, dst: Any, plan: WritePlan, *, overwrite: bool, fsync: bool = False) -> Staged:
        """Call 2: stage an output for ``plan`` at ``dst`` (checked by :meth:`check`).

        Raises:
            UsageError: DST exists by now (without ``overwrite``), or the staged output cannot be made.
        """

    def join(self, dst: Any, token: str, *, single_file: bool, who: str) -> Staged:
        """Another process's view of the output staged by ``token``: it writes its share, nothing more. ``who``
        names the process in an error (``rank 1``).

        Raises:
            UsageError: this storage has no ``shared_writes``, or the staged output is not visible here.
        """
        raise UsageError(f"{dst}: {self.scheme}:// outputs are written by one process")

    @abstractmethod
    def recover(self, directory: Any) -> list[str]:
        """Call 5: clean up after runs of this host that are gone, in ``directory``; returns what was done."""


def bounds_error(path: str, key: str, start: int, need_end: int, size: int) -> FormatError:
    """The error for bytes ``[start, need_end)`` of a file of ``size`` bytes that does not hold them."""
    what = f"{key!r} " if key else ""
    if start < 0 or need_end < start:
        return FormatError(f"{path}: {what}is said to lie at offset {start}, {need_end - start} bytes long; "
                           "offsets and lengths cannot be negative")
    return FormatError(f"{path}: {what}needs bytes up to offset {need_end} but the file has {size} (truncated?)")

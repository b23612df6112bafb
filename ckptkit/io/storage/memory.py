"""``ckmem://``: checkpoints in this process's memory, a whole backend in one file (importing it registers it).

Its files are bytes in :data:`FILES`, keyed by their path (``ckmem://run/model.safetensors`` is
``FILES["run/model.safetensors"]``); directories are the prefixes of those paths. A source is read through an
anonymous in-memory file (``memfd_create``), so it gives a descriptor as a local file does and the local writer
copies from it kernel-side; a staged output is such files too, put into :data:`FILES` whole at the commit, or
dropped by an abort. One process writes an output (the memory is its own), and there is nothing for
:meth:`MemoryStorage.recover` to find after a run that is gone.
"""

from __future__ import annotations

import fnmatch
import io
import os
import posixpath
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from ...core.plan import WritePlan
from ...core.split import Slice
from ...errors import FormatError, UsageError
from ..moves import Moves
from . import register
from .base import Source, Staged, Storage

__all__ = ["FILES", "SCHEME", "MemoryPath", "MemoryStorage"]

SCHEME = "ckmem"
FILES: dict[str, bytes] = {}
"""Every file of the backend, by path (without ``ckmem://``)."""


def _key(text: str) -> str:
    return posixpath.normpath(text.removeprefix(f"{SCHEME}://")).strip("/") if text else ""


class _Stat(NamedTuple):
    st_size: int


class MemoryPath:
    """A file or directory of :data:`FILES`, with the part of :class:`pathlib.Path`'s API the readers use."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = _key(key)

    def __str__(self) -> str:
        return f"{SCHEME}://{self.key}"

    def __repr__(self) -> str:
        return f"MemoryPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryPath) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __lt__(self, other: MemoryPath) -> bool:
        return self.key < other.key

    def __truediv__(self, name: object) -> MemoryPath:
        return MemoryPath(posixpath.join(self.key, str(name)))

    name = property(lambda self: posixpath.basename(self.key))
    suffix = property(lambda self: posixpath.splitext(self.name)[1])
    stem = property(lambda self: posixpath.splitext(self.name)[0])
    parent = property(lambda self: MemoryPath(posixpath.dirname(self.key)))

    def absolute(self) -> MemoryPath:
        return self

    def resolve(self) -> MemoryPath:
        return self

    def is_file(self) -> bool:
        return self.key in FILES

    def is_dir(self) -> bool:
        return any(k.startswith(self.key + "/") for k in FILES)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[MemoryPath]:
        if not self.is_dir():
            raise FileNotFoundError(f"{self}: no such directory")
        names = {k[len(self.key) + 1:].split("/", 1)[0] for k in FILES if k.startswith(self.key + "/")}
        return iter([self / n for n in sorted(names)])

    def glob(self, pattern: str) -> Iterator[MemoryPath]:
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def stat(self) -> _Stat:
        return _Stat(len(self.read_bytes()))

    def read_bytes(self) -> bytes:
        try:
            return FILES[self.key]
        except KeyError:
            raise FileNotFoundError(f"{self}: no such file") from None

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def open(self, mode: str = "rb") -> io.BytesIO:
        if mode != "rb":
            raise UsageError(f"{self}: opened {mode!r}; memory paths are read here, written by the executor")
        return io.BytesIO(self.read_bytes())


def _anonymous_file(name: str, data: bytes | int) -> int:
    """A descriptor of an in-memory file holding ``data`` (bytes), or of ``data`` zero bytes."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name)
    else:  # not Linux: an unlinked temporary file
        fd, path = tempfile.mkstemp()
        os.unlink(path)
    if isinstance(data, int):
        os.ftruncate(fd, data)
    else:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    return fd


class _MemorySource(Source):
    def __init__(self, path: str) -> None:
        data = MemoryPath(path).read_bytes()
        self.fd, self.size = _anonymous_file(path, data), len(data)

    def fileno(self) -> int:
        return self.fd


class _MemoryStaged(Staged):
    """Every file of the plan as an in-memory file at its planned size, until the commit puts them in FILES."""

    def __init__(self, dst: MemoryPath, plan: WritePlan, overwrite: bool) -> None:
        self.dst, self.plan, self.overwrite = dst, plan, overwrite
        self.token = str(dst)
        self._fds = {fp.relpath: _anonymous_file(fp.relpath, fp.nbytes) for fp in plan.files}

    def _target(self, relpath: str) -> MemoryPath:
        return self.dst if self.plan.single_file else self.dst / relpath

    def write(self, pieces: Iterable[Slice | Moves], *, max_memory: int, fsync: bool = False,
              progress: Callable[[int], None] = lambda n: None, streamed: bool = False) -> None:
        from .local.writer import write_descriptors

        write_descriptors(pieces, lambda relpath: os.dup(self._fds[relpath]), max_memory=max_memory,
                          progress=progress, name_of=self._target, streamed=streamed)

    def commit(self) -> MemoryPath:
        try:
            if self.dst.exists() and not self.overwrite:
                raise UsageError(f"{self.dst} already exists (another run wrote it meanwhile?); pass --overwrite "
                                 "(overwrite=True) to replace it")
            files = {}
            for fp in self.plan.files:
                data = os.pread(self._fds[fp.relpath], fp.nbytes + 1, 0)
                if len(data) != fp.nbytes:
                    raise FormatError(f"{self._target(fp.relpath)}: expected {fp.nbytes} bytes, found {len(data)}")
                files[self._target(fp.relpath).key] = data
            root, kept = self.dst.key + "/", self.plan.kept
            for key in [k for k in FILES if k == self.dst.key or k.startswith(root)]:
                rel = key.removeprefix(root)
                if key != self.dst.key and (rel in kept or rel.startswith(tuple(k for k in kept if k[-1:] == "/"))):
                    continue  # a file of the old DST the output keeps (a model folder's tokenizer)
                del FILES[key]  # the old DST goes as the new one comes: one step, as no reader runs meanwhile
            FILES.update(files)
        finally:
            self.abort()
        return self.dst

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class MemoryStorage(Storage):
    """Checkpoints in :data:`FILES`."""

    scheme = SCHEME
    shared_writes = False
    descriptors = True

    def path(self, path: Any) -> MemoryPath:
        return path if isinstance(path, MemoryPath) else MemoryPath(str(path))

    def source(self, path: str) -> Source:
        return _MemorySource(path)

    def check(self, dst: Any, *, overwrite: bool, sources: tuple[Any, ...] = (),
              dry_run: bool = False) -> MemoryPath:
        dst = self.path(dst)
        for src in sources:
            if isinstance(src, MemoryPath) and (src == dst or src.key.startswith(dst.key + "/")
                                                or dst.key.startswith(src.key + "/")):
                raise UsageError(f"destination {dst} overlaps the input {src}; ckptkit never writes into its input")
        if dst.exists() and not overwrite:
            raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
        return dst

    def stage(self, dst: Any, plan: WritePlan, *, overwrite: bool, fsync: bool = False) -> Staged:
        return _MemoryStaged(self.path(dst), plan, overwrite)

    def recover(self, directory: Any) -> list[str]:
        return []  # a run's staged files die with its process


def _storage(storage_options: Mapping[str, Any] | None) -> Storage:
    return _MEMORY


_MEMORY = MemoryStorage()
register(SCHEME, _storage)

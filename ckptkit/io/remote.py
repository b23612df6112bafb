"""Checkpoints behind fsspec URLs: ``s3://``, ``gs://``, ``az://``, ``hf://`` (and any protocol fsspec knows).

Readers keep the part of :mod:`pathlib`'s API they use on a local checkpoint (``/``, ``name``, ``parent``,
``suffix``, ``exists``, ``is_file``, ``is_dir``, ``iterdir``, ``glob``, ``stat().st_size``, ``read_bytes``,
``open``): :func:`as_path` gives a :class:`pathlib.Path` for a local path, untouched, and a :class:`RemotePath`
for a URL. A remote checkpoint's byte spans name their object by URL, and :class:`RemoteFiles` reads them:
ranged GETs, a bounded number in flight, adjacent ranges coalesced, and read-ahead in the order a reader
announces (:meth:`RemoteFiles.expect`), so that 50,000 DCP chunk headers are not 100,000 round trips in a row.
Local bytes never pass through here.

Credentials and endpoints come from where each filesystem's own library looks (s3fs and botocore: the
``AWS_*`` variables, ``AWS_ENDPOINT_URL``, profiles, instance roles; gcsfs: application default credentials;
adlfs: ``AZURE_STORAGE_*``; huggingface_hub: ``HF_TOKEN``), or from ``storage_options``
(``--storage-options JSON``), keyword arguments of the filesystem. The filesystem a URL was opened with is
kept for its protocol, so that spans read later by URL alone reach the same endpoint with the same
credentials: one set of storage options per protocol and process.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import posixpath
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ..errors import CheckpointError, FormatError, UsageError

if TYPE_CHECKING:  # the pool is made on the first remote read: local runs never import it (start-up time)
    from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["PIECE", "REQUESTS", "Job", "NoCredentialsError", "Range", "RemoteFiles", "RemotePath", "abort_uploads",
           "as_path", "bounds_error", "calling", "coalesce", "filesystem", "is_url", "url_error"]

REQUESTS = 16
"""Range requests in flight at once, per operation."""
PIECE = 8 << 20
"""Largest single range request: big tensors are fetched as several, concurrently."""
_AHEAD = 4 << 20
"""Largest coalesced read-ahead request (:meth:`RemoteFiles.expect`)."""

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# pathlib turns "s3://b/k" into "s3:/b/k"; such a path names a local directory "s3:" that nobody means.
_MANGLED = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub"}
_EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure"}
_filesystems: dict[str, Any] = {}
_lock = threading.Lock()


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) other than ``file://``; Path objects never are."""
    if not isinstance(path, str):
        return isinstance(path, RemotePath)
    m = _URL.match(path)
    return m is not None and m.group(1).lower() != "file"


def _scheme(url: str) -> str:
    m = _URL.match(url)
    assert m is not None
    return m.group(1).lower()


_S3_CREDENTIALS = ("set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or pass --storage-options "
                   "'{\"profile\": \"NAME\"}' or '{\"key\": \"...\", \"secret\": \"...\"}'")
_NO_CREDENTIALS = {"s3": _S3_CREDENTIALS, "s3a": _S3_CREDENTIALS}
"""What to do when a store's library finds no credentials, by URL scheme."""


class NoCredentialsError(UsageError):
    """The object store's library found no credentials for a URL: the message says where to put them."""

    @classmethod
    def of(cls, url: str) -> NoCredentialsError:
        """The error for ``url``, one of :data:`_NO_CREDENTIALS`' schemes."""
        scheme = _scheme(url)
        return cls(f"{url}: no credentials for {scheme}:// found; {_NO_CREDENTIALS[scheme]}")


def _no_credentials(e: BaseException) -> bool:
    """Whether ``e``, or an exception it was raised from, is botocore's NoCredentialsError (s3fs raises it as is,
    or from inside its own calls)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "NoCredentialsError":
            return True
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def url_error(url: str, e: BaseException) -> Exception:
    """One line naming ``url`` for what a filesystem library raised; ckptkit's own errors pass through."""
    if isinstance(e, CheckpointError):
        return e
    if _no_credentials(e) and _URL.match(url) and _scheme(url) in _NO_CREDENTIALS:
        return NoCredentialsError.of(url)
    detail = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, FileNotFoundError):
        return FileNotFoundError(f"{url}: no such object ({detail})")
    if isinstance(e, PermissionError):
        return PermissionError(f"{url}: permission denied by the server ({detail})")
    if isinstance(e, OSError):
        return OSError(f"{url}: {detail}")
    return OSError(f"{url}: {type(e).__name__}: {detail}")


@contextlib.contextmanager
def calling(url: str) -> Iterator[None]:
    """Errors of the block raised as :func:`url_error` makes them."""
    try:
        yield
    except Exception as e:
        raise url_error(url, e) from e


def _filesystem_class(scheme: str, url: str) -> type:
    import fsspec

    try:
        return fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise UsageError(f"{url}: unknown protocol {scheme}://; ckptkit reads and writes local paths and the URLs "
                         "of fsspec's filesystems (s3://, gs://, az://, hf:// ...)") from None
    except ImportError:
        package = _PACKAGES.get(scheme, f"the package fsspec names for {scheme}://")
        extra = f" (or 'ckptkit[{_EXTRAS[package]}]')" if package in _EXTRAS else ""
        raise UsageError(f"{url}: {scheme}:// needs {package}; install it: pip install {package}{extra}") from None


def known_filesystems() -> dict[str, Any]:
    """The filesystems kept, by protocol: what a worker process needs to read with the run's storage options
    (fsspec filesystems pickle with their options)."""
    with _lock:
        return dict(_filesystems)


def keep_filesystems(filesystems: dict[str, Any]) -> None:
    """Keep ``filesystems`` (from :func:`known_filesystems` of the process that started this one)."""
    with _lock:
        _filesystems.update(filesystems)


def filesystem(url: str, storage_options: dict | None = None) -> tuple[Any, str]:
    """The filesystem of ``url`` and the path within it. The filesystem is kept for the protocol (see above);
    ``storage_options`` given here replace the ones kept."""
    scheme = _scheme(url)
    with _lock:
        fs = _filesystems.get(scheme)
        if fs is None or storage_options is not None:
            _filesystem_class(scheme, url)
            from fsspec.core import url_to_fs

            with calling(url):
                fs, _ = url_to_fs(url, **(storage_options or {}))
            _filesystems[scheme] = fs
    return fs, fs._strip_protocol(url)


def as_path(path: str | Path, storage_options: dict | None = None) -> Path:
    """``path`` as a :class:`pathlib.Path` (local) or a :class:`RemotePath` (a URL) that stands in for one.

    ``file://`` URLs are local paths. A path pathlib made of a URL (``s3:/bucket``) is refused rather than
    read or written as a local directory named ``s3:``. A URL given as a string is looked at afresh: the
    filesystem's cached listings (another process may have written since) are dropped.
    """
    if isinstance(path, RemotePath):
        return cast(Path, path)
    text = str(path)
    if is_url(text):
        fs, inner = filesystem(text, storage_options)
        fs.invalidate_cache()
        return cast(Path, RemotePath(fs, inner))
    if text.lower().startswith("file://"):
        return Path(text[len("file://"):])
    m = _MANGLED.match(text)
    if m and m.group(1).lower() in _known_protocols():
        raise UsageError(f"{text}: looks like a {m.group(1)}:// URL that lost a slash (pathlib.Path makes "
                         f"{m.group(1)}:/... of it); pass the URL as a string")
    return Path(path)


def _known_protocols() -> set[str]:
    from fsspec.registry import known_implementations

    return set(known_implementations) | set(_PACKAGES)


class _Stat(NamedTuple):
    st_size: int


class RemotePath:
    """A file or directory of an fsspec filesystem, with the part of :class:`pathlib.Path`'s API the readers
    use. ``str()`` is its URL. It has no ``__fspath__``: no ``os`` call can take it for a local path."""

    __slots__ = ("fs", "path")

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path.rstrip("/") or path

    def __str__(self) -> str:
        return cast(str, self.fs.unstrip_protocol(self.path))

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: RemotePath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name: str | Path) -> RemotePath:
        return RemotePath(self.fs, posixpath.join(self.path, str(name)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, posixpath.dirname(self.path))

    def absolute(self) -> RemotePath:
        return self

    def resolve(self) -> RemotePath:
        return self

    def exists(self) -> bool:
        with calling(str(self)):
            return bool(self.fs.exists(self.path))

    def is_file(self) -> bool:
        with calling(str(self)):
            return bool(self.fs.isfile(self.path))

    def is_dir(self) -> bool:
        with calling(str(self)):
            return bool(self.fs.isdir(self.path))

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[RemotePath]:
        with calling(str(self)):
            names = self.fs.ls(self.path, detail=False)
        return iter([RemotePath(self.fs, n) for n in names if n.rstrip("/") != self.path])

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """The entries of this directory whose names match ``pattern`` (one level, as the readers use it)."""
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def stat(self) -> _Stat:
        with calling(str(self)):
            return _Stat(int(self.fs.size(self.path)))

    def read_bytes(self) -> bytes:
        with calling(str(self)):
            return cast(bytes, self.fs.cat_file(self.path))

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def open(self, mode: str = "rb") -> Any:
        if mode != "rb":
            raise UsageError(f"{self}: opened {mode!r}; remote paths are read here, written by the executor")
        with calling(str(self)):
            return self.fs.open(self.path, "rb", block_size=1 << 16, cache_type="readahead")


def bounds_error(path: str, key: str, start: int, need_end: int, size: int) -> FormatError:
    """The error for bytes ``[start, need_end)`` of a file of ``size`` bytes that does not hold them."""
    what = f"{key!r} " if key else ""
    if start < 0 or need_end < start:
        return FormatError(f"{path}: {what}is said to lie at offset {start}, {need_end - start} bytes long; "
                           "offsets and lengths cannot be negative")
    return FormatError(f"{path}: {what}needs bytes up to offset {need_end} but the file has {size} (truncated?)")


Range = tuple[str, int, int]
"""(URL, start, end) of bytes to read."""


class Job(NamedTuple):
    """A piece of an output file: ``run()`` gives its ``nbytes`` bytes."""

    nbytes: int
    run: Callable[[], bytes | bytearray | memoryview]
    inline: bool = False
    """Run in the consumer's thread when reached (literal bytes; a cast, whose reads use the pool themselves)."""


def coalesce(ranges: Iterable[Range], limit: int) -> Iterator[Range]:
    """``ranges`` in order, each run of back-to-back ranges of one object joined up to ``limit`` bytes, and
    ranges longer than ``limit`` split."""
    run: Range | None = None
    for url, start, end in ranges:
        if run is not None and run[0] == url and run[2] == start and end - run[1] <= limit:
            run = (url, run[1], end)
            continue
        if run is not None:
            yield run
        while end - start > limit:
            yield url, start, start + limit
            start += limit
        run = (url, start, end)
    if run is not None:
        yield run


class RemoteFiles:
    """Byte ranges of remote objects for one operation: object sizes checked once, range GETs on a bounded
    pool of threads. :meth:`close` stops it. Thread-safe for :meth:`read`, :meth:`fetch` and :meth:`size`."""

    def __init__(self, requests: int = REQUESTS) -> None:
        self.requests = requests
        self._sizes: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._plan: Iterator[Range] = iter(())
        self._ahead: deque[tuple[Range, Future]] = deque()
        self._pool_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the pool (:data:`REQUESTS` threads)."""
        with self._pool_lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.requests, thread_name_prefix="ckptkit-get")
            return self._pool.submit(fn, *args)

    def size(self, url: str) -> int:
        if url not in self._sizes:
            fs, path = filesystem(url)
            with calling(url):
                self._sizes[url] = int(fs.size(path))
        return self._sizes[url]

    def check(self, url: str, start: int, need_end: int, key: str = "") -> None:
        """Refuse a span the object does not hold, as :meth:`Files.fd` refuses one of a local file."""
        size = self.size(url)
        if not 0 <= start <= need_end <= size:
            raise bounds_error(url, key, start, need_end, size)

    @staticmethod
    def get(url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``url`` in one GET (unchecked: see :meth:`check`); any thread may call it."""
        fs, path = filesystem(url)
        with calling(url):
            data = fs.cat_file(path, start=start, end=end) if end > start else b""
        if len(data) != end - start:
            raise FormatError(f"{url}: expected {end - start} bytes at offset {start}, the server sent {len(data)} "
                              "(did the object change while it was read?)")
        return cast(bytes, data)

    def read(self, url: str, offset: int, length: int, key: str = "") -> bytes:
        """``length`` bytes of ``url`` from ``offset``, from the read-ahead where announced, else one GET."""
        self.check(url, offset, offset + length, key)
        for i, ((u, start, end), future) in enumerate(self._ahead):
            if u == url and start <= offset and offset + length <= end:
                for _ in range(i):  # skipped: the reader went past them
                    self._ahead.popleft()
                self._fill()
                try:
                    return future.result()[offset - start:offset - start + length]
                except Exception:
                    break  # asked for again below, where the failure is reported as the reader reads
        return self.get(url, offset, offset + length)

    def pread(self, url: str, need_end: int, start: int = 0, key: str = "") -> Callable[[int, int], bytes]:
        """``os.pread`` of ``url`` (length, offset), for readers written against a descriptor."""
        self.check(url, start, need_end, key)
        return lambda n, offset: self.read(url, offset, max(0, min(n, self.size(url) - offset)), key)

    def expect(self, ranges: Iterable[Range]) -> None:
        """Announce the reads to come, in order: they are fetched ahead, :data:`REQUESTS` at a time, joined where
        back to back. Reads outside the announcement are served as they come."""
        self._ahead.clear()
        self._plan = coalesce(ranges, _AHEAD)
        self._fill()

    def _fill(self) -> None:
        while len(self._ahead) < self.requests:
            r = next(self._plan, None)
            if r is None:
                return
            self._ahead.append((r, self.submit(self.get, *r)))

    def fetch(self, ranges: Iterable[Range], budget: int) -> Iterator[bytes]:
        """The bytes of ``ranges`` in order, fetched ahead (see :meth:`ahead`)."""
        jobs = (Job(end - start, functools.partial(self.get, url, start, end)) for url, start, end in ranges)
        return cast(Iterator[bytes], self.ahead(jobs, budget))

    def ahead(self, jobs: Iterable[Job], budget: int) -> Iterator[bytes | bytearray | memoryview]:
        """The results of ``jobs`` in order. Pool jobs run ahead of the consumer, at most :data:`REQUESTS` and
        ``budget`` bytes of them (one at least) running or waiting to be taken; inline jobs run in the consumer's
        thread when their turn comes."""
        window: deque[tuple[Job, Future | None]] = deque()
        held = running = 0
        pending = iter(jobs)
        nxt = next(pending, None)
        try:
            while nxt is not None or window:
                while nxt is not None and (nxt.inline or running < self.requests
                                           and (running == 0 or held + nxt.nbytes <= budget)):
                    window.append((nxt, None if nxt.inline else self.submit(nxt.run)))
                    if not nxt.inline:
                        held, running = held + nxt.nbytes, running + 1
                    nxt = next(pending, None)
                job, future = window.popleft()
                if future is None:
                    yield job.run()
                    continue
                held, running = held - job.nbytes, running - 1
                yield future.result()
        finally:
            for _, future in window:
                if future is not None:
                    future.cancel()

    def close(self) -> None:
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def abort_uploads(path: RemotePath, *, under: bool) -> int:
    """Abort the incomplete multipart uploads to ``path`` (``under``: to any key below it) and return how many.

    Only S3 keeps them (invisible, but stored and billed) until someone aborts them; a killed run leaves its own.
    GCS resumable uploads and Azure uncommitted blocks expire by themselves (a week), so there is nothing to do.
    """
    fs = path.fs
    if "s3" not in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
        return 0
    bucket, _, key = path.path.partition("/")
    prefix = key + "/" if under else key
    with calling(str(path)):
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
        mine = [u for u in uploads if under or u["Key"] == key]
        for u in mine:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    return len(mine)

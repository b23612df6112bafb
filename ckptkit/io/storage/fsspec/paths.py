"""Object stores' paths: ``s3://``, ``gs://``, ``az://``, ``hf://`` (and any protocol fsspec knows).

Readers keep the part of :mod:`pathlib`'s API they use on a local checkpoint (``/``, ``name``, ``parent``,
``suffix``, ``exists``, ``is_file``, ``is_dir``, ``iterdir``, ``glob``, ``stat().st_size``, ``read_bytes``,
``open``): a URL's is a :class:`RemotePath`.

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
import posixpath
import re
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

from ....errors import CheckpointError, UsageError

__all__ = ["NoCredentialsError", "RemotePath", "calling", "check_protocol", "filesystem", "keep_filesystems",
           "known_filesystems", "known_protocols", "remote_path", "url_error"]

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub"}
_EXTRAS = {"s3fs": "s3", "gcsfs": "gcs", "adlfs": "azure"}
_filesystems: dict[str, Any] = {}
_lock = threading.Lock()


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


def check_protocol(url: str) -> None:
    """Refuse a URL whose protocol fsspec does not know, or whose package is not installed."""
    _filesystem_class(_scheme(url), url)


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


def remote_path(url: str, storage_options: Mapping[str, Any] | None = None) -> RemotePath:
    """``url`` as a :class:`RemotePath`. A URL is looked at afresh: the filesystem's cached listings (another
    process may have written since) are dropped."""
    fs, inner = filesystem(url, dict(storage_options) if storage_options is not None else None)
    fs.invalidate_cache()
    return RemotePath(fs, inner)


def known_protocols() -> set[str]:
    """The protocols fsspec knows, with or without their packages installed."""
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



"""Storage: one seam between ckptkit and whatever holds checkpoints.

A path or URL is resolved to its backend once, at the edge of the library calls (:func:`storage_at`); below
that, code asks the :class:`Storage` it was given (its calls numbered in its docstring) and its capabilities
(``shared_writes``, ``descriptors``), never whether a path is a URL.

Backends: :mod:`.local` (plain paths and ``file://``: a staging directory beside DST, moved into place in one
step), :mod:`.fsspec` (every other ``scheme://`` fsspec knows: object stores, written in place with their commit
file last) and :mod:`.memory` (``ckmem://``, in this process's memory; importing it registers it). A new one is a
module that subclasses :class:`Storage` and calls :func:`register` with its scheme.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from ...errors import UsageError
from .base import Source, Staged, Storage

__all__ = ["Source", "Staged", "Storage", "register", "storage_at", "storage_for"]

Factory = Callable[[Mapping[str, Any] | None], Storage]
"""Makes a backend from the run's storage options (``--storage-options``; None: its defaults)."""

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# pathlib turns "s3://b/k" into "s3:/b/k"; such a path names a local directory "s3:" that nobody means.
_MANGLED = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):/(?!/)")
_registry: dict[str, Factory] = {}


def register(scheme: str, factory: Factory) -> None:
    """Have URLs ``scheme://...`` read and written by the storage ``factory`` makes (a backend's module calls
    this when imported).

    Args:
        scheme: the URL scheme, matched without regard to case.
        factory: makes the backend from the run's storage options.
    """
    _registry[scheme.lower()] = factory


def storage_for(path: Any, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage of ``path``: a string, a :class:`os.PathLike` (local) or a path a storage gave.

    ``file://`` URLs and plain paths are local; a registered scheme's URLs go to its backend, and any other
    ``scheme://`` to fsspec's.

    Raises:
        UsageError: an unknown protocol, a protocol whose package is missing, or a URL that pathlib mangled
            (``s3:/bucket``).
    """
    if isinstance(path, os.PathLike):
        text = os.fspath(path)
        if isinstance(text, str):
            _refuse_mangled(text)
        return _local()
    text = str(path)
    m = _URL.match(text)
    scheme = m.group(1).lower() if m else "file"
    if scheme == "file":
        _refuse_mangled(text)
        return _local()
    factory = _registry.get(scheme)
    if factory is not None:
        return factory(storage_options)
    return cast(Storage, _builtin("fsspec", "FsspecStorage").of(text, storage_options))


def storage_at(path: Any, storage_options: Mapping[str, Any] | None = None) -> tuple[Storage, Path]:
    """``path`` resolved once: its storage (:func:`storage_for`) and the object readers use: a
    :class:`pathlib.Path`, or one that stands in for it (:class:`~.fsspec.paths.RemotePath`, a memory path).

    Raises:
        UsageError: as :func:`storage_for`.
    """
    storage = storage_for(path, storage_options)
    return storage, cast(Path, storage.path(path))


def _local() -> Storage:
    return cast(Storage, _builtin("local", "LOCAL"))


def _builtin(module: str, name: str) -> Any:
    """A built-in backend's ``name``, its module imported on first use (as :mod:`ckptkit.formats` loads its
    readers): a run that reads only local files imports nothing of fsspec's, and the backends, which read
    through :mod:`ckptkit.io.sources`, are not imported by what they use."""
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def _refuse_mangled(text: str) -> None:
    """Refuse a path pathlib made of a URL (``s3:/bucket``) rather than read or write a local ``s3:``."""
    m = _MANGLED.match(text)
    if m is None:
        return
    if m.group(1).lower() in _builtin("fsspec.paths", "known_protocols")() | set(_registry):
        raise UsageError(f"{text}: looks like a {m.group(1)}:// URL that lost a slash (pathlib.Path makes "
                         f"{m.group(1)}:/... of it); pass the URL as a string")

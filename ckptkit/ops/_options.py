"""How ``convert``, ``reshard`` and ``export_hf`` take their :class:`~ckptkit.io.options.WriteOptions`: as one
object, or as keywords (:class:`WriteKeywords`) that one helper turns into one."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ParamSpec, TypedDict, TypeVar

from ..io.options import WriteOptions

__all__ = ["WriteKeywords", "storage_of", "write_options"]

P = ParamSpec("P")
R = TypeVar("R")


class WriteKeywords(TypedDict, total=False):
    """The fields of :class:`ckptkit.io.options.WriteOptions`, as keywords of ``convert``, ``reshard`` and
    ``export_hf``."""

    overwrite: bool
    max_memory: int
    fsync: bool
    progress: bool
    dry_run: bool
    storage_options: Mapping[str, Any] | None
    workers: int | str
    distributed: bool
    verify_checksums: bool


def write_options(options: WriteOptions | None, keywords: WriteKeywords) -> WriteOptions:
    """``options`` (default: the defaults) with the fields given as keywords replaced."""
    return dataclasses.replace(options or WriteOptions(), **keywords)


def storage_of(options: WriteOptions) -> dict | None:
    """The ``storage_options`` to open URLs with; None keeps a filesystem's own."""
    return dict(options.storage_options) if options.storage_options is not None else None

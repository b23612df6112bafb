"""How ``convert``, ``reshard`` and ``export_hf`` take their :class:`~ckptkit.io.options.WriteOptions`: as one
object, or as keywords (:class:`WriteKeywords`) that one helper turns into one, on one rank or all of them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypedDict, TypeVar

from ..io.execute import all_ranks
from ..io.options import WriteOptions

__all__ = ["WriteKeywords", "on_all_ranks", "storage_of", "write_options"]

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


def write_options(options: WriteOptions | None, keywords: WriteKeywords) -> WriteOptions:
    """``options`` (default: the defaults) with the fields given as keywords replaced."""
    return dataclasses.replace(options or WriteOptions(), **keywords)


def on_all_ranks(fn: Callable[P, R]) -> Callable[P, R]:
    """:func:`ckptkit.io.execute.all_ranks` for a function that takes ``distributed`` as a keyword or in its
    ``options`` (a :class:`WriteOptions`)."""
    ranked = all_ranks(fn)

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        options = kwargs.get("options")
        if "distributed" not in kwargs and isinstance(options, WriteOptions) and options.distributed:
            kwargs["distributed"] = True  # what all_ranks looks at; the same value as the options'
        return ranked(*args, **kwargs)

    return run


def storage_of(options: WriteOptions) -> dict | None:
    """The ``storage_options`` to open URLs with; None keeps a filesystem's own."""
    return dict(options.storage_options) if options.storage_options is not None else None

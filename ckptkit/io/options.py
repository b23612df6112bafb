"""How an output is written, whatever its format: the options every writing command shares."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError

__all__ = ["DEFAULT_MAX_MEMORY", "WriteOptions"]

DEFAULT_MAX_MEMORY = 1 << 30
"""Bytes a write may hold in memory at once (``--max-memory``)."""


@dataclass(frozen=True, kw_only=True)
class WriteOptions:
    """The write tail that ``convert``, ``reshard``, ``export_hf`` and their commands share.

    Each format's own choices (shard size, world size, casts) travel in that format's options; these say how
    the bytes get to the destination.
    """

    overwrite: bool = False
    """Replace an existing destination (atomically); without it, an existing one is refused."""
    max_memory: int = DEFAULT_MAX_MEMORY
    """Bytes held in memory at once: write buffers, cast and transform blocks, read-ahead."""
    fsync: bool = False
    """Make the output durable before it is published."""
    progress: bool = False
    """Show a progress bar on stderr."""
    dry_run: bool = False
    """Plan the output and check the destination; write nothing."""
    storage_options: Mapping[str, Any] | None = None
    """Keyword arguments of the object store's filesystem (``--storage-options``); None uses its defaults."""
    workers: int | str = 1
    """Processes of this machine that write the output files, or ``"auto"``."""
    distributed: bool = False
    """Every rank of the default process group writes a share (torchrun)."""
    verify_checksums: bool = True
    """Check the source bytes read against the checksums its ``ckptkit.json`` recorded (a ``ckptkit.save``
    checkpoint), as the output is written; a mismatch fails the command and nothing is written."""

    def __post_init__(self) -> None:
        if self.max_memory < 1:
            raise UsageError(f"max_memory must be at least 1 byte, got {self.max_memory}")

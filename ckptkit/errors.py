"""The exceptions ckptkit raises. Every message names the file or key at fault and what was expected."""

from __future__ import annotations

__all__ = ["CheckpointError", "ChecksumError", "FormatError", "IncompleteCheckpointError", "UnsafeCheckpointError",
           "UsageError"]


class CheckpointError(ValueError):
    """Base class: the checkpoint (or a request about it) cannot be handled as asked."""


class FormatError(CheckpointError):
    """A file does not hold what its format promises (bad header, offset past the end, unknown dtype)."""


class ChecksumError(FormatError):
    """Bytes of a checkpoint differ from the checksums its ``ckptkit.json`` recorded when it was saved."""


class IncompleteCheckpointError(CheckpointError):
    """Parts of the checkpoint are missing or overlap: a rank file, a chunk, a shard named by an index."""


class UnsafeCheckpointError(CheckpointError):
    """A pickle asked for a global outside the allow-list; ckptkit never runs code from a checkpoint."""


class UsageError(CheckpointError):
    """The request itself is inconsistent (existing destination, unknown option value, bad key selection)."""

"""ckptkit: convert, re-shard, export and verify PyTorch (FSDP) checkpoints by streaming bytes.

Four forms, one :class:`Manifest`: FULL (``torch.save``), SHARDED (``torch.distributed.checkpoint``),
LOCAL (FSDP1 ``LOCAL_STATE_DICT``) and HF safetensors.
"""

import importlib

from .errors import (CheckpointError, FormatError, IncompleteCheckpointError, UnsafeCheckpointError,
                     UsageError)

# Public names load on first use (PEP 562): the command line imports only what a command runs, and
# never torch on the byte-moving paths.
_LAZY = {
    "convert": "convert", "reshard": "convert", "Report": "convert",
    "export_hf": "export", "inspect": "inspect", "verify": "verify", "VerifyReport": "verify",
    "Chunk": "manifest", "Format": "manifest", "Manifest": "manifest", "ObjectEntry": "manifest",
    "Span": "manifest", "TensorEntry": "manifest",
}

__all__ = ["CheckpointError", "FormatError", "IncompleteCheckpointError", "UnsafeCheckpointError", "UsageError",
           *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

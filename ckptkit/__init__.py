"""ckptkit: convert, re-shard, export and verify PyTorch (FSDP) checkpoints by streaming bytes.

Four forms, one :class:`Manifest`: FULL (``torch.save``), SHARDED (``torch.distributed.checkpoint``),
LOCAL (FSDP1 ``LOCAL_STATE_DICT``) and HF safetensors. None of this imports torch; only a dtype cast does.
"""

from . import _startup  # noqa: F401  (first: the console script's Ctrl-C handling while the rest imports)
from ._version import __version__  # noqa: F401  (the one place the version is kept)

# Imported eagerly: a function bound here after its module (``convert`` in ``ckptkit.convert``) stays the
# package attribute, whereas a lazily fetched one is replaced by the module on the module's first import.
from .core.manifest import Chunk, Format, Manifest, ObjectEntry, Span, TensorEntry
from .errors import (
    CheckpointError,
    ChecksumError,
    FormatError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    UsageError,
)
from .formats import LocalOptions
from .io.options import WriteOptions
from .models.mapping import KeyMapping, key_mapping
from .ops.convert import ConvertOptions, Report, convert, reshard
from .ops.export import ExportOptions, export_hf

__all__ = [
    "load", "save", "CheckpointError", "ChecksumError", "Chunk", "ConvertOptions", "ExportOptions", "Format",
    "FormatError", "IncompleteCheckpointError", "KeyMapping", "LocalOptions", "Manifest", "ObjectEntry", "Report",
    "Span", "TensorEntry", "UnsafeCheckpointError", "UsageError", "VerifyReport", "WriteOptions", "convert",
    "export_hf", "inspect", "key_mapping", "reshard", "verify",
]


def __getattr__(name: str):
    # save/load import torch; loading them on first use keeps ``import ckptkit`` (and the CLI) torch-free.
    # inspect and verify load on first use too: their imports are start-up time for every conversion.
    if name in ("save", "load"):
        from .training import load, save

        return {"save": save.save, "load": load.load}[name]
    if name == "inspect":
        from .ops.inspect import inspect

        return inspect
    if name in ("verify", "VerifyReport"):
        from .ops import verify

        return getattr(verify, name)
    raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")

"""The checkpoint formats, each a reader and a writer behind :class:`FormatIO`."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, FormatError, UsageError
from ..manifest import Format, Manifest
from .base import FormatIO, WriteOptions
from .dcp import DcpIO
from .full import FullIO
from .hf import HfIO

__all__ = ["FormatIO", "WriteOptions", "detect", "io_for", "read"]

# Order matters: a DCP directory may also carry safetensors or .bin side files; its .metadata decides.
_ALL: tuple[type[FormatIO], ...] = (DcpIO, HfIO, FullIO)


def io_for(fmt: Format | str) -> FormatIO:
    try:
        fmt = Format(fmt)
    except ValueError:
        raise UsageError(f"unknown format {fmt!r}; expected one of {', '.join(f.value for f in Format)}") from None
    for cls in _ALL:
        if cls.format == fmt:
            return cls()
    raise CheckpointError(f"no reader/writer for format {fmt.value!r}")


def detect(path: Path | str) -> FormatIO:
    path = Path(path)
    if not path.exists():
        raise FormatError(f"{path}: no such file or directory")
    for cls in _ALL:
        if cls.detect(path):
            return cls()
    listing = ", ".join(sorted(p.name for p in path.iterdir())[:8]) if path.is_dir() else "a file of unknown type"
    raise FormatError(
        f"{path}: not a checkpoint ckptkit knows (found: {listing or 'an empty directory'}); expected a DCP "
        "directory with .metadata, a torch.save file or pytorch_model.bin[.index.json], or model.safetensors[.index.json]")


def read(path: Path | str) -> Manifest:
    return detect(path).read(Path(path))

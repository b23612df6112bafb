"""HF-SHARDS: the per-rank safetensors files torch's ``HuggingFaceStorageWriter(save_distributed=True)`` writes
when it does not consolidate them, read as the sharded checkpoint they are.

Rank r writes ``shard-<r+1>-model-00001-of-00001.safetensors`` holding its own chunk of every tensor it has,
and records where each chunk lies in the global tensor in the header's ``__metadata__``: ``DCP_SHARDING_INFO``
is a JSON ``{key: {"saved_offsets": [...]}}``. There is no ``.metadata`` and no index. As torch's
``HuggingFaceStorageReader`` does, a tensor's global shape is the far corner of its chunks; unlike it, chunks
that leave a gap or overlap are refused rather than loaded into whatever the caller's tensor held. ckptkit
reads this layout and writes the others (converting or re-sharding it writes SHARDED by default).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..codecs.safetensors_header import read_header
from ..core.manifest import Chunk, Format, Manifest, TensorEntry
from ..errors import FormatError
from .base import ReadOnlyIO

__all__ = ["SHARDING_INFO", "HfShardsIO"]

SHARDING_INFO = "DCP_SHARDING_INFO"
"""The ``__metadata__`` field in which torch's HF storage writer records each chunk's offsets."""
_SHARD = re.compile(r"shard-(\d+)-")
_CONSOLIDATED = ("model.safetensors", "model.safetensors.index.json")


class HfShardsIO(ReadOnlyIO):
    format = Format.HF_SHARDS

    @classmethod
    def detect(cls, path: Path) -> bool:
        if not path.is_dir() or any((path / name).is_file() for name in _CONSOLIDATED):
            return False
        files = sorted(path.glob("*.safetensors"))
        try:
            return bool(files) and SHARDING_INFO in read_header(files[0])[1]
        except FormatError:
            return False  # not this format's to say what is wrong with it

    def read(self, path: Path) -> Manifest:
        root = path.absolute()
        chunks: dict[str, list[TensorEntry]] = {}
        files = sorted(root.glob("*.safetensors"))
        for file in files:
            found, meta = read_header(file)
            offsets = _offsets(file, meta, found)
            for t in found:
                chunks.setdefault(t.key, []).append(TensorEntry(t.key, t.path, t.dtype, t.shape, (
                    Chunk(offsets[t.key], t.shape, t.chunks[0].span),)))
        tensors = tuple(_joined(key, parts) for key, parts in chunks.items())
        shards = {int(m.group(1)) for f in files if (m := _SHARD.match(f.name))}
        world = max(shards) if len(shards) == len(files) else len(files)
        details = (("files", len(files)),
                   ("layout", f"torch HuggingFaceStorageWriter(save_distributed=True), chunk offsets in "
                              f"{SHARDING_INFO}"))
        return Manifest(Format.HF_SHARDS, str(root), tensors, (), world, details)


def _offsets(file: Path, meta: dict[str, str], found: list[TensorEntry]) -> dict[str, tuple[int, ...]]:
    """Each tensor's offsets in its global tensor, from the file's ``DCP_SHARDING_INFO``, checked."""
    if SHARDING_INFO not in meta:
        raise FormatError(f"{file}: no {SHARDING_INFO} in its __metadata__, which the other safetensors files "
                          "beside it have; it is not one of torch's HF storage writer shards")
    try:
        info: Any = json.loads(meta[SHARDING_INFO])
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{file}: {SHARDING_INFO} is not JSON ({str(e)[:80]})") from None
    out = {}
    for t in found:
        entry = info.get(t.key) if isinstance(info, dict) else None
        saved = entry.get("saved_offsets") if isinstance(entry, dict) else None
        if not (isinstance(saved, list) and len(saved) == len(t.shape)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in saved)):
            raise FormatError(f"{file}: {SHARDING_INFO} gives {t.key!r} the offsets {json.dumps(saved)[:60]}; "
                              f"expected {len(t.shape)} non-negative integers under 'saved_offsets'")
        out[t.key] = tuple(saved)
    return out


def _joined(key: str, parts: list[TensorEntry]) -> TensorEntry:
    """One tensor from its chunks in the rank files: the shape reaches the far corner of every chunk."""
    first = parts[0]
    for p in parts[1:]:
        if p.dtype != first.dtype or len(p.shape) != len(first.shape):
            raise FormatError(f"{p.chunks[0].span.file}: {key!r} is {p.dtype} of rank {len(p.shape)}, but "
                              f"{first.dtype} of rank {len(first.shape)} in {first.chunks[0].span.file}")
    chunks = tuple(c for p in parts for c in p.chunks)
    shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(first.shape)))
    entry = TensorEntry(key, first.path, first.dtype, shape, chunks)
    entry.validate()
    return entry

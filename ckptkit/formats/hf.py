"""HF: ``model.safetensors`` or shards with ``model.safetensors.index.json``.

Headers are read as data (:mod:`ckptkit.codecs.safetensors_header`), so reading moves no tensor bytes and
imports no torch; ``safetensors.safe_open`` reads what is written here, and the tests check it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..codecs.safetensors_header import file_parts, read_header
from ..core.dtypes import DType, by_name
from ..core.manifest import Format, Manifest, TensorEntry
from ..core.plan import Bytes, FilePlan, Region, WritePlan
from ..errors import FormatError, UsageError
from .base import FormatIO, FormatOptions, Target, cast_for, index_json, read_index, split_files

__all__ = ["FLOAT32", "HfIO", "HfOptions"]

FLOAT32 = by_name("float32")
"""The dtype ``keep_fp32`` keeps tensors in under a cast."""
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class HfOptions(FormatOptions):
    max_shard_size: int | None = None
    """Largest safetensors file in bytes; None writes one file."""
    keep_fp32: frozenset[str] = frozenset()
    """Keys of floating tensors written in float32 whatever ``cast`` says."""
    uncast: frozenset[str] = frozenset()
    """Keys written in their own dtype whatever ``cast`` says (FP8 weights and their scales, which mean
    something only together)."""

    def cast_of(self, tensor: TensorEntry) -> DType | None:
        """The dtype ``tensor`` is written in when that is not its own: the one rule of which keys are cast and
        which stay in float32, for the plan and for the report alike."""
        if tensor.key in self.uncast:
            return None
        return cast_for(tensor.dtype, FLOAT32 if tensor.key in self.keep_fp32 else self.cast)


class HfIO(FormatIO):
    format = Format.HF
    names = ("hf",)
    hf_model = True
    casts = True

    @classmethod
    def detect(cls, path: Path) -> bool:
        if path.is_file():
            return path.suffix == ".safetensors"
        return (path / INDEX).is_file() or any(path.glob("*.safetensors"))

    def read(self, path: Path) -> Manifest:
        if path.is_file():
            files = [path]
        elif (path / INDEX).is_file():
            keys = read_index(path / INDEX, ".safetensors")
            files = list(dict.fromkeys(keys.values()))
        elif (path / SINGLE).is_file():
            files = [path / SINGLE]
        else:
            files = sorted(path.glob("*.safetensors"))
            if len(files) > 1:
                raise FormatError(f"{path}: {len(files)} safetensors files but no {INDEX} to say which key lives where")
        tensors, details = [], []
        for file in files:
            found, meta = read_header(file)
            if (path / INDEX).is_file():
                for t in found:
                    if keys.get(t.key) != file:
                        raise FormatError(f"{file}: holds {t.key!r}, which {INDEX} places in "
                                          f"{keys.get(t.key, 'no file')}")
            tensors += found
            details += [(f"metadata.{k}", v) for k, v in meta.items()]
        if (path / INDEX).is_file():
            missing = set(keys) - {t.key for t in tensors}
            if missing:
                raise FormatError(f"{path / INDEX}: lists keys no shard holds: {sorted(missing)[:5]}")
        return Manifest(Format.HF, str(path.absolute()), tuple(tensors), (), None, tuple(dict(details).items()))

    def options(self, target: Target, manifest: Manifest) -> HfOptions:
        return HfOptions(cast=target.cast, max_shard_size=target.max_shard_size)

    def not_held(self, manifest: Manifest) -> tuple[str, ...]:
        if not manifest.objects:
            return ()
        return (f"{len(manifest.objects)} non-tensor entries not written (safetensors holds tensors only): "
                + ", ".join(o.key for o in manifest.objects[:5]) + (" ..." if len(manifest.objects) > 5 else ""),)

    def plan(self, manifest: Manifest, options: HfOptions) -> WritePlan:
        regions: dict[str, Region] = {}
        for t in manifest.tensors:
            region = Region.whole(t, options.cast_of(t))
            if region.dtype.safetensors is None:
                raise UsageError(f"tensor {t.key!r} has dtype {region.dtype}, which safetensors cannot store")
            regions[t.key] = region
        files = split_files(regions, "model{suffix}.safetensors", options.max_shard_size)
        plans = [FilePlan(name, file_parts([regions[k] for k in keys])) for name, keys in files.items()]
        if len(plans) > 1:
            plans.append(FilePlan(INDEX, (Bytes(index_json(files, regions)),)))
        return WritePlan(tuple(plans), commit=plans[-1].relpath)

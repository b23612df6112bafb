"""FULL: unsharded state dicts written by ``torch.save``: one file, or HF-style ``pytorch_model-*.bin`` shards.

Read without torch: each archive's pickle becomes a tree whose tensors are byte spans (``_torchzip``);
nested dicts flatten to dotted keys with DCP's rules. Written as ``torch.save`` archives whose tensor
records are streamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..codecs.torchzip_read import is_archive, read_archive
from ..codecs.torchzip_write import archive_parts
from ..core.manifest import Format, Manifest, ObjectEntry, TensorRef, key_of
from ..core.plan import Bytes, FilePlan, Region, WritePlan
from ..core.tree import flatten, unflatten
from ..errors import FormatError, UsageError
from .base import (
    FormatIO,
    FormatOptions,
    Target,
    cast_for,
    index_json,
    object_value,
    read_index,
    regions_in,
    split_files,
)
from .run_args import RUN_ARGS_GLOBALS

__all__ = ["SUFFIXES", "FullIO", "FullOptions"]

INDEX = "pytorch_model.bin.index.json"
SINGLE_NAMES = ("pytorch_model.bin", "model.pt", "model.pth", "checkpoint.pt", "state_dict.pt")
SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
"""File name endings of ``torch.save`` files, as found in checkpoint directories."""


def _is_tensor(v: object) -> bool:
    return isinstance(v, TensorRef)


@dataclass(frozen=True, kw_only=True, slots=True)
class FullOptions(FormatOptions):
    max_shard_size: int | None = None
    """Largest file in bytes: HF-style ``pytorch_model-*.bin`` shards with an index; None writes one file."""
    single_file: bool = True
    """One ``torch.save`` file rather than a directory holding ``pytorch_model.bin``."""


class FullIO(FormatIO):
    format = Format.FULL
    names = ("full",)
    casts = True

    @classmethod
    def detect(cls, path: Path) -> bool:
        if path.is_file():
            return is_archive(str(path))
        return (path / INDEX).is_file() or any((path / n).is_file() for n in SINGLE_NAMES)

    def read(self, path: Path) -> Manifest:
        if path.is_dir():
            if (path / INDEX).is_file():
                return self._read_sharded(path)
            path = next(path / n for n in SINGLE_NAMES if (path / n).is_file())
        if not is_archive(str(path)):
            raise FormatError(f"{path}: not a torch.save zip archive (legacy pre-1.6 pickles are not supported)")
        # Megatron-LM's run arguments, as convert --to full writes them from a torch_dist checkpoint (and Megatron-LM's
        # own single-file checkpoints hold them): admitted as data.
        tree = read_archive(str(path.absolute()), extra_globals=RUN_ARGS_GLOBALS)
        tensors, objects = [], []
        for p, leaf in flatten(tree, _is_tensor):
            if isinstance(leaf, TensorRef):
                tensors.append(leaf.as_entry(p))
            else:
                objects.append(ObjectEntry(key_of(p), p, leaf))
        return Manifest(Format.FULL, str(path), tuple(tensors), tuple(objects))

    def _read_sharded(self, root: Path) -> Manifest:
        keys = read_index(root / INDEX, ".bin")
        tensors = []
        for shard in dict.fromkeys(keys.values()):
            tree = read_archive(str(shard.absolute()))
            if not isinstance(tree, dict):
                raise FormatError(f"{shard}: expected a flat dict of tensors, found {type(tree).__name__}")
            for key, leaf in tree.items():
                if not isinstance(leaf, TensorRef):
                    raise FormatError(f"{shard}: entry {key!r} is {type(leaf).__name__}; shards hold tensors only")
                if keys.get(key) != shard:
                    raise FormatError(f"{shard}: holds {key!r}, which {INDEX} places in {keys.get(key, 'no file')}")
                tensors.append(leaf.as_entry((key,)))
        missing = set(keys) - {t.key for t in tensors}
        if missing:
            raise FormatError(f"{root / INDEX}: lists keys no shard holds: {sorted(missing)[:5]}")
        return Manifest(Format.FULL, str(root), tuple(tensors))

    def options(self, target: Target, manifest: Manifest) -> FullOptions:
        single = target.max_shard_size is None and Path(target.destination).suffix in SUFFIXES
        return FullOptions(cast=target.cast, max_shard_size=target.max_shard_size, single_file=single)

    def plan(self, manifest: Manifest, options: FullOptions) -> WritePlan:
        regions = {t.key: Region.whole(t, cast_for(t.dtype, options.cast)) for t in manifest.tensors}
        if options.max_shard_size is None:
            items = [(t.path, regions[t.key]) for t in manifest.tensors]
            items += [(o.path, regions_in(object_value(o), options.cast)) for o in manifest.objects]
            name = "model.pt" if options.single_file else "pytorch_model.bin"
            return WritePlan((FilePlan(name, archive_parts(unflatten(items))),), single_file=options.single_file,
                             commit=name)
        if manifest.objects:
            raise UsageError(f"{manifest.root}: sharded FULL output (pytorch_model-*.bin) holds model tensors only, "
                             f"but the checkpoint has {len(manifest.objects)} non-tensor entries; "
                             "write one file (no --max-shard-size) or export the model part")
        files = split_files(regions, "pytorch_model{suffix}.bin", options.max_shard_size)
        plans = [FilePlan(name, archive_parts({k: regions[k] for k in keys})) for name, keys in files.items()]
        if len(plans) > 1:
            plans.append(FilePlan(INDEX, (Bytes(index_json(files, regions)),)))
        return WritePlan(tuple(plans), commit=plans[-1].relpath)

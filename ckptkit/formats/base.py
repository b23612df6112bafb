"""The one interface every format implements.

Call order: 1. ``detect(path)`` picks the format; 2. ``read(path)`` builds the :class:`Manifest` (headers and
metadata only, no tensor bytes); 3. ``options(target, manifest)`` turns a format-neutral :class:`Target`
into the writer's own options type; 4. ``plan(manifest, options)`` lays the output out as a
:class:`WritePlan`, a pure function; 5. the executor streams the plan into a staging directory.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..codecs.torchzip_read import load_blob
from ..core.dtypes import DType
from ..core.manifest import Format, Manifest, ObjectEntry, TensorRef, map_tensor_refs
from ..core.plan import Region, WritePlan
from ..errors import FormatError, IncompleteCheckpointError, UsageError

__all__ = ["RANK", "FormatIO", "LocalOptions", "Target", "WriteOptions", "rank_pattern", "cast_for", "index_json",
           "is_empty_container", "read_index", "regions_in", "split_files"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalOptions:
    """How to find and interpret a LOCAL checkpoint (FSDP1 ``LOCAL_STATE_DICT``), and its layout for output."""

    rank_files: str | None = None
    """File name pattern with ``{rank}``, e.g. ``shard_{rank}.pt``; None finds rank files by their names."""
    model: str | None = None
    """``package.module:factory`` building the model, to derive the flat layout where no sidecar has it."""
    auto_wrap: str = "none"
    """The wrap policy FSDP was given: ``none``, ``size:<min_num_params>`` or ``block:<module.path:Class>``."""
    use_orig_params: bool | None = None
    """How FSDP wrapped the model; None tries both against a checkpoint's sizes, and means False for output."""

    def __post_init__(self) -> None:
        if self.rank_files is not None:
            rank_pattern(self.rank_files)


RANK = "{rank}"


def rank_pattern(pattern: str) -> re.Pattern:
    """The regular expression of a ``--rank-files`` pattern; refuses one without exactly one ``{rank}``."""
    if pattern.count(RANK) != 1 or "/" in pattern or "\\" in pattern:
        raise UsageError(f"--rank-files {pattern!r}: expected a file name with exactly one {RANK}, "
                         f"e.g. shard_{RANK}.pt")
    head, tail = pattern.split(RANK)
    return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """What a conversion asks of its output, whatever the format: each format's :meth:`FormatIO.options`
    takes what applies to it."""

    world_size: int = 1
    """Ranks the output is laid out for (SHARDED, LOCAL)."""
    max_shard_size: int | None = None
    """Largest output file in bytes (HF, FULL); None writes one file."""
    cast: DType | None = None
    """Floating tensors are cast to this dtype; others keep theirs."""
    destination: str = ""
    """Where the output goes: FULL writes one ``torch.save`` file when it names one (``model.pt``)."""
    local: LocalOptions = LocalOptions()
    """LOCAL: rank file names and how to derive the flat layout."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {self.world_size}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WriteOptions:
    """What every format's writer takes; each format's options type adds its own fields."""

    cast: DType | None = None
    """Floating tensors are cast to this dtype; others keep theirs."""


class FormatIO(abc.ABC):
    format: Format

    @classmethod
    @abc.abstractmethod
    def detect(cls, path: Path) -> bool:
        """Whether ``path`` holds a checkpoint of this format (cheap: names and magic bytes only)."""

    @abc.abstractmethod
    def read(self, path: Path) -> Manifest:
        """The manifest of the checkpoint at ``path``; raises a :class:`CheckpointError` naming the bad file."""

    @abc.abstractmethod
    def options(self, target: Target, manifest: Manifest) -> WriteOptions:
        """This format's own options for writing ``manifest`` as ``target`` asks."""

    @abc.abstractmethod
    def plan(self, manifest: Manifest, options: Any) -> WritePlan:
        """The files that represent ``manifest`` in this format, given options of this format's type. No I/O."""


def cast_for(dtype: DType, cast: DType | None) -> DType | None:
    """The cast to apply to a tensor of ``dtype``: only floating tensors change type."""
    return cast if cast is not None and dtype.is_floating and cast != dtype else None


def object_value(entry: ObjectEntry) -> Any:
    """The entry's value, decoded from its serialized bytes where the format keeps it so (DCP)."""
    if entry.blob is None:
        return entry.value
    return load_blob(entry.blob, where=f"object {entry.key!r}")


def is_empty_container(entry: ObjectEntry) -> bool:
    """An entry that only records an empty dict or list (a disabled GradScaler's state, say)."""
    return entry.blob is None and isinstance(entry.value, (dict, list)) and not entry.value


def regions_in(value: Any, cast: DType | None = None) -> Any:
    """``value`` with its :class:`TensorRef` leaves turned into whole-tensor regions, ready to write."""
    def region(ref: TensorRef) -> Region:
        entry = ref.as_entry(("<tensor inside an object>",))
        return Region.whole(entry, cast_for(entry.dtype, cast))
    return map_tensor_refs(value, region)


def split_files(regions: dict[str, Region], pattern: str, max_shard_size: int | None) -> dict[str, list[str]]:
    """File name to keys, by huggingface_hub's own splitter (keys keep their order; a big tensor gets a file)."""
    from huggingface_hub.serialization._base import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        regions, get_storage_size=lambda r: r.nbytes, filename_pattern=pattern,
        max_shard_size=max_shard_size if max_shard_size is not None else 1 << 62)
    return split.filename_to_tensors


def index_json(files: dict[str, list[str]], regions: dict[str, Region]) -> bytes:
    weight_map = {k: name for name, keys in files.items() for k in keys}
    index = {"metadata": {"total_size": sum(r.nbytes for r in regions.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2) + "\n").encode()


def read_index(path: Path, suffix: str) -> dict[str, Path]:
    """Key to shard file from an HF-style index, checked as untrusted input (structure, names, existence)."""
    try:
        if path.stat().st_size > 64 << 20:
            raise FormatError(f"{path}: index file is {path.stat().st_size} bytes; an index is expected under 64 MiB")
        index = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: cannot read index JSON ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()) or not weight_map:
        raise FormatError(f"{path}: expected {{\"weight_map\": {{key: file name}}}}")
    out = {}
    for key, name in weight_map.items():
        if "/" in name or "\\" in name or name in ("", ".", "..") or not name.endswith(suffix):
            raise FormatError(f"{path}: weight_map[{key!r}] = {name!r} is not a plain '*{suffix}' file name")
        shard = path.parent / name
        if not shard.is_file():
            raise IncompleteCheckpointError(f"{path}: shard {name} (holding {key!r}) does not exist")
        out[key] = shard
    return out

"""The one interface every format implements.

Call order: 1. ``detect(path)`` picks the format; 2. ``read(path)`` builds the :class:`Manifest` (headers and
metadata only, no tensor bytes); 3. ``options(target, manifest)`` turns a format-neutral :class:`Target`
into the writer's own options type (a :class:`FormatOptions`); 4. ``plan(manifest, options)`` lays the
output out as a :class:`WritePlan`, a pure function; 5. the executor streams the plan into a staging
directory. What a format can hold and how it is named (``writable``, ``names``, ``ranked``, ...) are class
attributes of its :class:`FormatIO`, which commands ask instead of the format's name.
"""

from __future__ import annotations

import abc
import json
import re
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..codecs.pickle_read import Call, Record
from ..codecs.torchzip_read import load_blob
from ..core.dtypes import DType, parse_floating
from ..core.manifest import Format, Manifest, ObjectEntry, Path_, TensorEntry, TensorRef, key_of, map_tensor_refs
from ..core.plan import Region, WritePlan
from ..errors import FormatError, IncompleteCheckpointError, UsageError
from .run_args import RUN_ARGS_GLOBALS

__all__ = ["RANK", "FormatIO", "LocalOptions", "ReadOnlyIO", "Target", "FormatOptions", "rank_pattern", "cast_for",
           "index_json", "is_empty_container", "plain_object", "read_index", "regions_in", "scalar_value",
           "split_files"]


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
    param_dtype: str | None = None
    """The dtype FSDP ran the model in: ``MixedPrecision(param_dtype=...)``, else the parameters' own dtype when
    FSDP wrapped them. With ``use_orig_params`` FSDP aligns every parameter to 16 bytes of it, so it moves the
    offsets. ``bf16``, ``fp16``, ``fp32`` or torch's names, kept as torch's (``bfloat16``); None: the dtype the
    factory builds the model in."""

    def __post_init__(self) -> None:
        if self.rank_files is not None:
            rank_pattern(self.rank_files)
        if self.param_dtype is not None:
            object.__setattr__(self, "param_dtype", parse_floating(self.param_dtype, "--param-dtype").name)


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
    """What a conversion asks of its output, whatever the format it names.

    Only what any format may be asked is here. Each format's own choices live in its options type (a
    :class:`FormatOptions`: ``HfOptions``, ``FullOptions``, ``DcpOptions``, ``LocalWriteOptions``), which
    :meth:`FormatIO.options` builds from a Target and the manifest; a command that writes one known format
    (``export_hf``: HF with a cast and ``keep_fp32``) builds that format's options itself. A LOCAL writer takes its
    :class:`LocalOptions` when it is made (``LocalIO(local)``), as its reader does.
    """

    to: str = ""
    """The name the output was asked for by (``convert --to``): one of :attr:`FormatIO.names`."""
    destination: str = ""
    """Where the output goes, as the user named it."""
    world_size: int = 1
    """Ranks the output is laid out for, by a format with :attr:`FormatIO.ranked`."""
    max_shard_size: int | None = None
    """Largest output file in bytes, by a format that splits its files; None writes one file."""
    state_groups: tuple[str, ...] | None = None
    """Top-level groups that are neither the model nor optimizer state, for a format with
    :attr:`FormatIO.keeps_state_apart`; None: only what the source kept apart."""
    cast: DType | None = None
    """Floating tensors are cast to this dtype, by a format with :attr:`FormatIO.casts`; None: kept."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {self.world_size}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FormatOptions:
    """What every format's writer takes; each format's options type adds its own fields."""

    cast: DType | None = None
    """Floating tensors are cast to this dtype; others keep theirs."""

    def cast_of(self, tensor: TensorEntry) -> DType | None:
        """The dtype ``tensor`` is written in when that is not its own."""
        return cast_for(tensor.dtype, self.cast)


class FormatIO(abc.ABC):
    """A format's reader and writer, and what it can hold: commands ask these capabilities rather than the
    format's name."""

    format: Format
    writable: ClassVar[bool] = True
    """False for another framework's own layout, which ckptkit reads but does not write (:class:`ReadOnlyIO`)."""
    names: ClassVar[tuple[str, ...]] = ()
    """The names ``convert --to`` writes this format by, its own first (``sharded``, ``megatron``)."""
    ranked: ClassVar[bool] = False
    """Laid out for a number of ranks (``--world-size``): a sharded checkpoint."""
    hf_model: ClassVar[bool] = False
    """Holds a model's weights alone, under Hugging Face's names: a conversion writes the model part, mapped
    towards HF names (``preset="auto"`` by default)."""
    keeps_state_apart: ClassVar[bool] = False
    """Writes the training state that is neither model nor optimizer apart (Lightning's ``meta.pt``), given as
    :attr:`Target.state_groups`."""
    casts: ClassVar[bool] = False
    """Writes floating tensors in the dtype :attr:`Target.cast` asks (``convert --dtype``)."""

    @classmethod
    @abc.abstractmethod
    def detect(cls, path: Path) -> bool:
        """Whether ``path`` holds a checkpoint of this format (cheap: names and magic bytes only)."""

    @abc.abstractmethod
    def read(self, path: Path) -> Manifest:
        """The manifest of the checkpoint at ``path``; raises a :class:`CheckpointError` naming the bad file."""

    def read_part(self, path: Path, wanted: Callable[[Manifest], Collection[str]]) -> Manifest:
        """:meth:`read`, where a format that can tells which tensors are ``wanted`` (the keys it returns for a
        manifest whose tensors have no chunks yet) before it reads theirs: the others come without chunks,
        so that planning them fails rather than writes anything. This one reads them all."""
        return self.read(path)

    @abc.abstractmethod
    def options(self, target: Target, manifest: Manifest) -> FormatOptions:
        """This format's own options for writing ``manifest`` as ``target`` asks."""

    def not_held(self, manifest: Manifest) -> tuple[str, ...]:
        """Notes on entries of ``manifest`` this format cannot hold as they are, for the report."""
        return ()

    @abc.abstractmethod
    def plan(self, manifest: Manifest, options: Any) -> WritePlan:
        """The files that represent ``manifest`` in this format, given options of this format's type. No I/O."""


class ReadOnlyIO(FormatIO):
    """A format ckptkit reads but does not write: converting it writes one of ckptkit's own formats, and
    re-sharding it writes SHARDED."""

    writable = False

    def options(self, target: Target, manifest: Manifest) -> FormatOptions:
        raise self._not_written()

    def plan(self, manifest: Manifest, options: Any) -> WritePlan:
        raise self._not_written()

    def _not_written(self) -> UsageError:
        return UsageError(f"ckptkit reads {self.format.value} checkpoints but does not write them; convert to "
                          "full, sharded, local or hf")


def cast_for(dtype: DType, cast: DType | None) -> DType | None:
    """The cast to apply to a tensor of ``dtype``: only floating tensors change type."""
    return cast if cast is not None and dtype.is_floating and cast != dtype else None


def object_value(entry: ObjectEntry) -> Any:
    """The entry's value, decoded from its serialized bytes where the format keeps it so (DCP). Megatron-LM's
    run arguments are admitted as data there too, as in a ``torch.save`` file: a DCP written from a Megatron
    checkpoint holds them."""
    if entry.blob is None:
        return entry.value
    return load_blob(entry.blob, where=f"object {entry.key!r}", extra_globals=RUN_ARGS_GLOBALS)


_SCALARS = {"float32": "<f", "float64": "<d", "float16": "<e", "int64": "<q", "int32": "<i"}


def scalar_value(entry: TensorEntry | ObjectEntry, files: Any = None) -> Any:
    """The value of a scalar entry (a step, a count): an object's value, or a one-element tensor's number, read
    from its few bytes (through ``files``, an open :class:`ckptkit.io.sources.Files`, where given).

    Raises:
        FormatError: A tensor of more than one element, or of a dtype other than float or int 16-64 bit.
    """
    if isinstance(entry, ObjectEntry):
        return object_value(entry)
    code = _SCALARS.get(entry.dtype.name)
    if code is None or entry.shape not in ((), (1,)):
        raise FormatError(f"{entry.key!r}: a tensor of dtype {entry.dtype}, shape {list(entry.shape)}; expected "
                          "one number")
    from ..io.sources import Files, read_region

    if files is not None:
        return struct.unpack(code, bytes(read_region(Region.whole(entry), files)))[0]
    with Files() as opened:
        return struct.unpack(code, bytes(read_region(Region.whole(entry), opened)))[0]


_PLAIN = (type(None), bool, int, float, complex, str, bytes, TensorRef, DType)


def plain_object(path: Path_, value: Any, where: str) -> ObjectEntry:
    """An entry for ``value``, which must be data: numbers, strings, containers of them, tensors, torch's own
    values. A corrupt pickle can make an allow-listed global itself the value (a memo reference that points at
    ``_rebuild_tensor_v2``); written out, that would name ckptkit's code, so it is refused."""
    def check(v: Any) -> None:
        if isinstance(v, dict):
            for k, item in v.items():
                check(k)
                check(item)
        elif isinstance(v, (list, tuple, set, frozenset)):
            for item in v:
                check(item)
        elif isinstance(v, (Record, Call)):
            check(vars(v) if isinstance(v, Record) else v.args)
        elif not isinstance(v, _PLAIN):
            raise FormatError(f"{where}: {key_of(path)!r:.100} holds a {type(v).__name__} ({v!r:.60}), not data; is "
                              "the file corrupt?")

    check(path)  # dict keys become path elements
    check(value)
    return ObjectEntry(key_of(path), path, value)


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
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

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

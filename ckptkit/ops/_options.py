"""How ``convert``, ``reshard`` and ``export_hf`` take their options: each group as one object, or its fields as
keywords that one helper turns into it (the keywords win).

- how the output is written: :class:`~ckptkit.io.options.WriteOptions` (:class:`WriteKeywords`);
- how the model's keys are mapped: :class:`~ckptkit.models.mapping.KeyMapping` (:class:`MappingKeywords`);
- what the output is: :class:`ConvertOptions` for ``convert``, :class:`ExportOptions` for ``export_hf``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict, TypeVar

from ..core.dtypes import CastName
from ..io.options import WriteOptions
from ..models.mapping import KeyMapping, KeyMapSource, Renames, key_mapping

__all__ = ["ConvertKeywords", "ConvertOptions", "ExportKeywords", "ExportOptions", "MappingKeywords", "WriteKeywords",
           "check_keywords", "mapping_of", "options_of", "storage_of", "write_options"]

Opts = TypeVar("Opts")


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """What :func:`ckptkit.convert`'s output is, beside its form (``to``)."""

    world_size: int | None = None
    """Ranks of a ``sharded``, ``local`` or ``megatron`` output (default: the source's, 1 for a single-file
    source); the other forms have no ranks and refuse more than 1."""
    max_shard_size: int | str | None = None
    """Largest output file of a FULL or HF output (``"5GB"``, ``"1GiB"`` or bytes); None: one file."""
    dtype: CastName = "keep"
    """``keep``, or the cast of floating tensors (``bf16``, ``fp16``, ``fp32`` or their long names) of a ``full``,
    ``sharded``, ``megatron`` or ``hf`` output; quantized weights (FP8 blocks, MXFP4) are then written as values,
    their scales left out (:mod:`ckptkit.models.quantized`)."""


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """What :func:`ckptkit.export_hf` writes: the model part it finds, and how its tensors are written."""

    model_key: str = "auto"
    """Where the model sits, as a dotted path; ``auto`` finds it (:mod:`ckptkit.ops.select`)."""
    strip_prefixes: tuple[str, ...] = ()
    """Further leading key prefixes to strip."""
    strip_wrappers: bool = True
    """Strip the wrapper names (:mod:`ckptkit.models.wrappers`)."""
    dtype: CastName | Literal["fp8"] = "keep"
    """``keep``, or the cast of floating tensors: ``bf16``, ``fp16``, ``fp32`` (or their long names); ``fp8``: the
    linear layers' weights as float8 e4m3 with 128x128 block scales, the rest bf16 (:mod:`ckptkit.ops._fp8`)."""
    keep_fp32: tuple[str, ...] = ()
    """Regular expressions of HF names kept in float32 under a cast."""
    max_shard_size: int | str | None = "5GB"
    """Largest safetensors file (``"5GB"``, ``"1GiB"`` or bytes); None: one file."""


class WriteKeywords(TypedDict, total=False):
    """The fields of :class:`ckptkit.io.options.WriteOptions`, as keywords of ``convert``, ``reshard`` and
    ``export_hf``."""

    overwrite: bool
    max_memory: int
    fsync: bool
    progress: bool
    dry_run: bool
    storage_options: Mapping[str, Any] | None
    workers: int | str
    distributed: bool
    verify_checksums: bool


class MappingKeywords(TypedDict, total=False):
    """The fields of a :class:`ckptkit.models.mapping.KeyMapping`, as keywords of ``convert`` and ``export_hf``,
    in the forms :func:`ckptkit.models.mapping.key_mapping` reads."""

    preset: str | None
    renames: Renames
    key_map: KeyMapSource
    strict_map: bool
    hf_assets: Path | str | None
    megatron_args: Mapping[str, Any] | None


class ConvertKeywords(WriteKeywords, MappingKeywords, total=False):
    """``convert``'s keywords: the fields of its options objects."""

    world_size: int | None
    max_shard_size: int | str | None
    dtype: CastName


class ExportKeywords(WriteKeywords, MappingKeywords, total=False):
    """``export_hf``'s keywords: the fields of its options objects."""

    model_key: str
    strip_prefixes: Iterable[str]
    strip_wrappers: bool
    dtype: CastName | Literal["fp8"]
    keep_fp32: Iterable[str]
    max_shard_size: int | str | None


_WRITE = frozenset(WriteKeywords.__annotations__)
_MAPPING = frozenset(MappingKeywords.__annotations__)


def check_keywords(function: str, keywords: Mapping[str, Any], accepted: type) -> None:
    """Refuses keywords that are no field of ``function``'s options (``accepted``: its keywords' TypedDict), as
    Python refuses an unknown keyword.

    Raises:
        TypeError: naming the first unknown keyword.
    """
    unknown = sorted(set(keywords) - set(accepted.__annotations__))
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")


def write_options(options: WriteOptions | None, keywords: Mapping[str, Any]) -> WriteOptions:
    """``options`` (default: the defaults) with the fields given among ``keywords`` replaced."""
    return dataclasses.replace(options or WriteOptions(), **{k: v for k, v in keywords.items() if k in _WRITE})


def mapping_of(mapping: KeyMapping | None, keywords: Mapping[str, Any], preset: str | None = None) -> KeyMapping:
    """``mapping`` (default: none, with ``preset``) with the fields given among ``keywords`` replaced.

    Raises:
        UsageError: a field given that cannot be read (:func:`ckptkit.models.mapping.key_mapping`).
    """
    given = {k: v for k, v in keywords.items() if k in _MAPPING}
    if mapping is not None and not given:
        return mapping
    base = mapping or KeyMapping(preset=preset)
    fields: dict[str, Any] = dict(preset=base.preset, renames=base.renames, key_map=dict(base.key_map),
                                  strict_map=base.strict, hf_assets=base.hf_assets, megatron_args=base.megatron_args)
    fields.update(given)
    fields["strict"] = fields.pop("strict_map")
    return key_mapping(**fields)


def options_of(cls: type[Opts], options: Opts | None, keywords: Mapping[str, Any]) -> Opts:
    """``options`` of ``cls`` (default: the defaults) with its fields given among ``keywords`` replaced; tuples
    where the fields hold tuples."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    given = {k: tuple(v) if k in ("strip_prefixes", "keep_fp32") else v for k, v in keywords.items() if k in names}
    return dataclasses.replace(options or cls(), **given)  # type: ignore[type-var]


def storage_of(options: WriteOptions) -> dict | None:
    """The ``storage_options`` to open URLs with; None keeps a filesystem's own."""
    return dict(options.storage_options) if options.storage_options is not None else None

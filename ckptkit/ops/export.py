"""The model part of any checkpoint as a Hugging Face safetensors directory (:func:`export_hf`).

The rules, in the order an export applies them:

- The model part is found by :mod:`ckptkit.ops.select`'s rule (``model_key`` names it as a dotted path); a
  checkpoint of training state alone is refused. Wrapper prefixes are stripped unless ``strip_wrappers=False``.
- A key mapping then renames the keys as for :func:`ckptkit.convert` (``key_map``, ``renames``, ``preset``
  towards HF names, ``strict_map``); ``preset="auto"`` picks the family's preset where the keys are
  torchtitan's names of a known family (:mod:`ckptkit.models.detect`), and None maps nothing.
- Every file and folder of ``hf_assets`` but weights, training state, caches and hidden files is copied
  (config, tokenizer, sentence-transformers modules, generation config, chat template, model card;
  :mod:`ckptkit.ops.assets`), by default those the checkpoint carries (verl's ``huggingface/``).
- ``lm_head.weight`` is left out only when the model ties it (the config's ``tie_word_embeddings``, else its
  ``model_type``'s default) and it equals the input embedding.
- A cast (``dtype``) touches floating tensors only. Under it, floating tensors whose key matches a regular
  expression of ``keep_fp32`` (searched anywhere in the HF name), and those transformers keeps in float32 when
  it loads the config's model class in that dtype (``_keep_in_fp32_modules`` under fp16,
  ``_keep_in_fp32_modules_strict`` under fp16 and bf16), are written in float32: the rule is
  :meth:`ckptkit.formats.hf.HfOptions.cast_of`, which the writer and the report share.
- The copied config.json names the dtype written after a cast, or where it named another, as
  ``save_pretrained`` does.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.dtypes import DType, parse_cast
from ..core.manifest import Format, Manifest, TensorEntry
from ..core.plan import Bytes, Check, FilePlan
from ..errors import FormatError, UsageError
from ..formats import LocalOptions, locate, writer_for
from ..formats.hf import FLOAT32, HfOptions
from ..io.execute import all_ranks
from ..io.options import WriteOptions
from ..io.sources import Files
from ..io.storage import storage_at
from ..models.hfconfig import INPUT_EMBEDDINGS, TIE_DEFAULTS, keep_in_fp32, tie_word_embeddings
from ..models.mapping import KeyMapping
from ..models.quantized import QUANTIZED, dequantize
from ..models.resolve import Plan
from ._fp8 import fp8_config, quantize_fp8
from ._model import plan_of
from ._options import ExportKeywords, ExportOptions, check_keywords, mapping_of, options_of, storage_of, write_options
from ._read_checks import recorded_checks, unread_damage
from .assets import find_assets
from .convert import parse_size, write
from .report import Changes, Report
from .select import model_keys, select_model

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["TIE_DEFAULTS", "ExportKeywords", "ExportOptions", "export_hf", "tie_word_embeddings"]


def _assets(directory: Path) -> tuple[tuple[FilePlan, ...], dict, str | None]:
    """The asset files to copy (:func:`ckptkit.ops.assets.find_assets`), the parsed config, and a note on what
    was left out."""
    found = find_assets(directory)
    plans = tuple(FilePlan(rel, (Bytes(f.read_bytes()),)) for rel, f in found.files)
    try:
        config = json.loads((directory / "config.json").read_text())
    except ValueError as e:
        raise FormatError(f"{directory / 'config.json'}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise FormatError(f"{directory / 'config.json'}: expected a JSON object, found {type(config).__name__}")
    return plans, config, found.note()


def _untie(tensors: list[TensorEntry], config: dict, max_memory: int) -> tuple[list[TensorEntry], str | None]:
    """Leave out ``lm_head.weight`` when the model ties it to the input embedding, as ``save_pretrained`` does."""
    head = next((t for t in tensors if t.key == "lm_head.weight"), None)
    if head is None:
        return tensors, None
    tied, why = tie_word_embeddings(config)
    if tied is None:
        return tensors, f"lm_head.weight kept: {why}"
    if not tied:
        return tensors, None
    embed = next((t for t in tensors if t.key.endswith(INPUT_EMBEDDINGS)), None)
    if embed is None:
        return tensors, f"lm_head.weight kept: {why}, but no input embedding was found to tie it to"
    with Files() as files:
        from .verify import first_difference  # only here: verify's imports are start-up time for every export

        diff = first_difference(head, embed, files, max_memory)
    if diff:
        raise UsageError(f"{why}, but lm_head.weight and {embed.key} differ ({diff}); refusing to drop "
                         "lm_head.weight: use assets whose config says tie_word_embeddings: false")
    return [t for t in tensors if t is not head], f"lm_head.weight left out: tied to {embed.key} ({why})"


def _without_quantization(config: dict, tensors: list[TensorEntry], cast: DType | None) -> tuple[dict, str | None]:
    """``config`` without its ``quantization_config`` where the weights written (after the ``cast``) are not in a
    quantized form (no float8 or integer weights, none of the tensors a quantized release holds beside them):
    transformers would build the quantized layers that config names and read plain weights into them."""
    quant = config.get("quantization_config")
    if quant is None:
        return config, None
    written = {t.key: cast if cast is not None and t.dtype.is_floating else t.dtype for t in tensors}
    quantized = [k for k, dtype in written.items()
                 if QUANTIZED.search(k) or dtype.name.startswith(("float8", "int", "uint")) and k.endswith("weight")]
    if quantized:
        return config, None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return ({k: v for k, v in config.items() if k != "quantization_config"},
            f"config.json: quantization_config ({method or 'unnamed'}) left out: the weights written are not quantized")


def _with_written_dtype(config: dict, tensors: list[TensorEntry], cast: DType | None) -> tuple[dict, str | None]:
    """``config`` naming the floating dtype written, which ``from_pretrained(dtype="auto")`` then loads in:
    after a cast, and wherever the config names another dtype (verl's config says bfloat16 over fp32
    masters). ``dtype`` is transformers 5's key, ``torch_dtype`` 4.x's; both are written. A config that names
    no dtype and saw no cast is left alone: "auto" then takes the weights' own. With several floating dtypes,
    the widest holds every value exactly. Other keys keep their order and values."""
    written = {cast or t.dtype for t in tensors if t.dtype.is_floating}
    named = {config[k] for k in ("dtype", "torch_dtype") if k in config}
    if not written or (cast is None and not named):
        return config, None
    dtype = max(written, key=lambda d: d.itemsize).name
    if cast is None and named == {dtype}:
        return config, None
    out = {**config, "dtype": dtype, "torch_dtype": dtype}
    text = out.get("text_config")
    if isinstance(text, dict) and ("dtype" in text or "torch_dtype" in text):
        out["text_config"] = {**text, "dtype": dtype, "torch_dtype": dtype}
    said = f" (it said {', '.join(sorted(named))})" if named and named != {dtype} else ""
    return out, f"config.json: dtype and torch_dtype set to {dtype}, the dtype written{said}"


def _with_config(assets: tuple[FilePlan, ...], config: dict) -> tuple[FilePlan, ...]:
    """``assets`` writing ``config`` as their ``config.json`` (added where they have none)."""
    plan = FilePlan("config.json", (Bytes((json.dumps(config, indent=2) + "\n").encode()),))
    if not any(p.relpath == "config.json" for p in assets):
        return (*assets, plan)
    return tuple(plan if p.relpath == "config.json" else p for p in assets)


@all_ranks
def export_hf(src: Path | str, dst: Path | str, *, mapping: KeyMapping | None = None,
              output: ExportOptions | None = None, local: LocalOptions | None = None,
              options: WriteOptions | None = None, **keywords: Unpack[ExportKeywords]) -> Report:
    """Write the model tensors of ``src`` as HF safetensors at ``dst`` (with the index file when sharded).

    The model part is found, stripped of wrapper prefixes and renamed towards HF names as :func:`convert` maps
    keys; the files of ``hf_assets`` are copied beside it, ``lm_head.weight`` is left out where the model ties
    it, and a cast keeps in float32 what ``keep_fp32`` and the model class say (the rules: :mod:`ckptkit.ops.export`).
    In a save hook, call it from rank 0 alone, or with ``distributed=True`` from every rank. ``src`` may be a run
    directory of :func:`ckptkit.save` (its ``latest`` step is read); ``src``, ``dst`` and ``hf_assets`` may be URLs.

    Each group of options is one object, or its fields as keywords, which win over it:
    ``export_hf(src, dst, hf_assets="base", dtype="bf16")`` is ``export_hf(src, dst,
    mapping=key_mapping(preset="auto", hf_assets="base"), output=ExportOptions(dtype="bf16"))``.

    Args:
        src: The checkpoint to read: a file, a directory, a run directory or a URL.
        dst: The HF folder to write; must not exist unless ``overwrite``.
        mapping: How the model's keys are renamed towards HF names (:class:`ckptkit.KeyMapping`; default:
            ``preset="auto"``, the family's preset where the keys are a framework's names of a known family, and
            ``preset=None`` maps nothing); its ``hf_assets`` is the HF model directory whose files are copied
            (default: the checkpoint's, verl's ``huggingface/``); its ``megatron_args`` are Megatron-LM arguments
            over the source's own (:mod:`ckptkit.models.megatron_args`).
        output: The model part written and how (:class:`ckptkit.ExportOptions`): ``model_key``,
            ``strip_prefixes``, ``strip_wrappers``, the ``dtype`` cast, ``keep_fp32``, ``max_shard_size``.
        local: How to read a LOCAL checkpoint.
        options: How the output is written (:class:`ckptkit.WriteOptions`).
        **keywords: Fields of ``mapping`` (``preset``, ``renames``, ``key_map``, ``strict_map``, ``hf_assets``,
            ``megatron_args``), of ``output`` and of ``options``.

    Returns:
        What was written (or, with ``dry_run``, would be): files and sizes, keys renamed, left out and cast,
        assets copied, notes.

    Raises:
        CheckpointError: As :func:`convert` raises them.
        UsageError: ``keep_fp32`` comes without a cast, or the checkpoint holds training state alone.
    """
    check_keywords("export_hf", keywords, ExportKeywords)
    options = write_options(options, keywords)
    output = options_of(ExportOptions, output, keywords)
    mapping = mapping_of(mapping, keywords, preset="auto")
    fp8 = output.dtype == "fp8"
    cast, keep_patterns = _cast_rule(output.dtype, output.keep_fp32)
    src, dst = storage_at(src, storage_of(options))[1], storage_at(dst, storage_of(options))[1]
    part = _model_part(src, local, output, mapping, verify=options.verify_checksums)
    part = _values(part, output.dtype) if cast is not None and not fp8 else part
    part = _with_assets(part, storage_of(options), cast, options.max_memory, fp8)
    part, quantized = _quantized(part) if fp8 else (part, frozenset[str]())
    layout, cast_notes = _hf_options(part, keep_patterns, cast, parse_size(output.max_shard_size), quantized)
    casts = tuple((t.key, to.name) for t in part.tensors if (to := layout.cast_of(t)) is not None)
    return write(Manifest(part.source.format, part.source.root, part.tensors), writer_for(Format.HF), dst, layout,
                 dataclasses.replace(options, progress=options.progress and not options.distributed), src=src,
                 extra_files=part.assets, notes=part.notes + cast_notes,
                 changes=Changes(part.renamed, part.dropped, casts, part.permuted), checks=part.checks)


def _cast_rule(dtype: str, keep_fp32: Iterable[str]) -> tuple[DType | None, tuple[re.Pattern, ...]]:
    """The cast of ``--dtype`` (``fp8`` casts what it leaves unquantized to bf16) and the ``--keep-fp32``
    patterns, which need a cast."""
    cast = parse_cast("bf16" if dtype == "fp8" else dtype)
    keep_patterns = _patterns(keep_fp32, "--keep-fp32")
    if keep_patterns and cast is None:
        raise UsageError("--keep-fp32 keeps tensors in float32 under a cast: use it with --dtype bf16 or fp16")
    return cast, keep_patterns


def _values(part: _Part, dtype: str) -> _Part:
    """``part`` with its quantized weights as values (:mod:`ckptkit.models.quantized`), which the cast writes."""
    found = dequantize(part.tensors, f"--dtype {dtype}")
    return dataclasses.replace(part, tensors=found.tensors, dropped=part.dropped + found.dropped,
                               notes=part.notes + found.notes())


def _quantized(part: _Part) -> tuple[_Part, frozenset[str]]:
    """``part`` in the block-scaled FP8 release form (:mod:`._fp8`), and the keys written as they are."""
    tensors, quantized, note = quantize_fp8(part.tensors)
    config = fp8_config(part.config, any(p.relpath == "config.json" for p in part.assets))
    return dataclasses.replace(part, tensors=tensors, assets=_with_config(part.assets, config), config=config,
                               notes=part.notes + (note,)), quantized


@dataclass(frozen=True)
class _Part:
    """The model part an export writes, and what happened to it on the way."""

    source: Manifest
    tensors: tuple[TensorEntry, ...]
    notes: tuple[str, ...]
    hf_assets: Path | str | None
    plan: Plan
    """The command's plan: the preset that mapped the keys, and how."""
    renamed: tuple[tuple[str, str], ...] = ()
    dropped: tuple[tuple[str, str], ...] = ()
    permuted: tuple[str, ...] = ()
    assets: tuple[FilePlan, ...] = ()
    checks: tuple[Check, ...] = ()
    """The source's recorded checksums (:func:`ckptkit.ops._read_checks.recorded_checks`)."""
    config: dict | None = None


def _model_part(src: Path, local: LocalOptions | None, output: ExportOptions, mapping: KeyMapping, *,
                verify: bool = True) -> _Part:
    """The model's tensors of ``src`` under ``mapping``'s names; ``hf_assets`` defaults to the checkpoint's.
    ``verify``: with the checks of the checksums the source records."""
    # Only the model's chunks are read (DCP): the rest, optimizer state above all, is never written here.
    found = locate(src, local)
    select = (output.model_key, output.strip_prefixes, output.strip_wrappers)
    manifest = found.reader.read_part(found.path, model_keys(*select))
    checks = recorded_checks(manifest, found.path) if verify else ()
    sel = select_model(manifest, *select)
    notes = ((found.note,) if found.note else ()) + sel.notes + unread_damage(manifest)
    if mapping.hf_assets is None and manifest.hf_assets is not None:
        mapping = dataclasses.replace(mapping, hf_assets=manifest.hf_assets)
        notes += (f"config and tokenizer from the checkpoint's {Path(manifest.hf_assets).name}/",)
    plan = plan_of(mapping, found.path, manifest, tuple(t.key for t in sel.tensors), "hf" if mapping else None)
    if not mapping:
        return _Part(manifest, sel.tensors, notes, mapping.hf_assets, plan, checks=checks)
    mapped = plan.map(sel.tensors)
    config, said = plan.megatron_config(mapped.tensors) if mapping.hf_assets is None else (None, None)
    return _Part(manifest, mapped.tensors, notes + plan.notes + mapped.notes + ((said,) if said else ()),
                 mapping.hf_assets, plan, renamed=mapped.renamed, dropped=mapped.dropped, permuted=mapped.permuted,
                 config=config, checks=checks)


def _with_assets(part: _Part, storage: dict | None, cast: DType | None, max_memory: int, quantizing: bool) -> _Part:
    """``part`` with the files of its ``hf_assets`` to copy (or the config made from a Megatron run's arguments),
    untied as their config says, checked against the config's transformers class (:meth:`Plan.check_class`), the
    config naming the dtype written; its ``quantization_config`` is kept where the weights will be
    (``quantizing``) or are quantized."""
    if part.hf_assets is not None:
        directory = storage_at(part.hf_assets, storage)[1]
        assets, config, left_note = _assets(directory)
        where = str(directory / "config.json")
    elif part.config is not None:
        config, left_note, where = part.config, None, "the config.json made from Megatron's arguments"
        assets = _with_config((), config)
    else:
        return part
    tensors, tie_note = _untie(list(part.tensors), config, max_memory)
    kept = {t.key for t in tensors}
    untied = [(t.key, "tied to the input embedding") for t in part.tensors if t.key not in kept]
    config, quant_note = (config, None) if quantizing else _without_quantization(config, tensors, cast)
    # A quantized model's layers are the quantizer's, which from_pretrained builds and a bare class lacks.
    class_notes = () if "quantization_config" in config else \
        part.plan.check_class(config, [t.key for t in tensors], where)
    config, dtype_note = _with_written_dtype(config, tensors, cast)
    if quant_note or dtype_note:
        assets = _with_config(assets, config)
    notes = [n for n in (tie_note, quant_note, dtype_note) if n]
    notes += ["copied " + ", ".join(p.relpath for p in assets)] if part.hf_assets is not None else []
    notes += [left_note] if left_note else []
    return dataclasses.replace(part, tensors=tuple(tensors), notes=part.notes + tuple(notes) + class_notes,
                               dropped=part.dropped + tuple(untied), assets=assets, config=config)


def _hf_options(part: _Part, keep_patterns: tuple[re.Pattern, ...], cast: DType | None,
                max_shard_size: int | None, quantized: frozenset[str]) -> tuple[HfOptions, tuple[str, ...]]:
    """The HF writer's options for ``part``: the cast, the keys kept in float32 under it, and those written as
    they are (``quantized``: FP8 weights and their scales); with notes."""
    keep, keep_note = _kept_in_fp32(list(part.tensors), keep_patterns, part.config, cast)
    layout = HfOptions(cast=cast, max_shard_size=max_shard_size, keep_fp32=frozenset(keep), uncast=quantized)
    notes: tuple[str, ...] = ()
    if cast:
        n = sum(1 for t in part.tensors if t.key not in keep and layout.cast_of(t) is not None)
        notes += (f"cast {n} floating tensors to {cast}; others kept their dtype",)
    return layout, notes + ((keep_note,) if keep_note else ())


def _patterns(values: Iterable[str], option: str) -> tuple[re.Pattern, ...]:
    try:
        return tuple(re.compile(v) for v in values)
    except re.error as e:
        raise UsageError(f"{option} {e.pattern!r}: not a regular expression ({e})") from None


def _kept_in_fp32(tensors: list[TensorEntry], patterns: tuple[re.Pattern, ...], config: dict | None,
                  cast: DType | None) -> tuple[set[str], str | None]:
    """The floating tensors written in float32 under ``cast``: those ``--keep-fp32`` names, and those the config's
    model class keeps in float32 when transformers loads it in ``cast``; and a note saying which and why."""
    if cast is None or cast == FLOAT32:
        return set(), None
    modules, said = keep_in_fp32(config, cast) if config is not None else (None, None)
    keep, why = set(), []
    for t in tensors:
        if not t.dtype.is_floating:
            continue
        if any(p.search(t.key) for p in patterns) or (modules is not None and modules.search(t.key)):
            keep.add(t.key)
    if patterns:
        why.append("--keep-fp32 " + " ".join(repr(p.pattern) for p in patterns))
    if said:
        why.append(said)
    if not keep:
        return keep, (f"no tensor matches {'; '.join(why)}" if why else None)
    return keep, f"kept {len(keep)} floating tensors in float32 ({'; '.join(why)})"

"""The model part of any checkpoint as a Hugging Face safetensors directory."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from ..core.dtypes import CastName, DType, by_name, parse_cast
from ..core.manifest import Format, Manifest, TensorEntry
from ..core.plan import Bytes, FilePlan
from ..errors import FormatError, UsageError
from ..formats import LocalOptions, Target, locate
from ..formats.base import cast_for
from ..io.execute import all_ranks
from ..io.options import DEFAULT_MAX_MEMORY
from ..io.sources import Files
from ..io.storage import storage_at
from .assets import find_assets
from .convert import Changes, Report, map_model, parse_size, write
from .hfconfig import TIE_DEFAULTS, keep_in_fp32, tie_word_embeddings
from .mapping import KeyMapSource, Renames, key_mapping
from .select import model_keys, select_model

__all__ = ["TIE_DEFAULTS", "export_hf", "tie_word_embeddings"]

_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "shared.weight")
FLOAT32 = by_name("float32")


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
    embed = next((t for t in tensors if t.key.endswith(_EMBEDDINGS)), None)
    if embed is None:
        return tensors, f"lm_head.weight kept: {why}, but no input embedding was found to tie it to"
    with Files() as files:
        from .verify import first_difference  # only here: verify's imports are start-up time for every export

        diff = first_difference(head, embed, files, max_memory)
    if diff:
        raise UsageError(f"{why}, but lm_head.weight and {embed.key} differ ({diff}); refusing to drop "
                         "lm_head.weight: use assets whose config says tie_word_embeddings: false")
    return [t for t in tensors if t is not head], f"lm_head.weight left out: tied to {embed.key} ({why})"


def _with_written_dtype(assets: tuple[FilePlan, ...], config: dict, tensors: list[TensorEntry],
                        cast: DType | None) -> tuple[tuple[FilePlan, ...], str | None]:
    """``config.json`` naming the floating dtype written, which ``from_pretrained(dtype="auto")`` then loads in:
    after a cast, and wherever the config names another dtype (verl's config says bfloat16 over fp32
    masters). ``dtype`` is transformers 5's key, ``torch_dtype`` 4.x's; both are written. A config that names
    no dtype and saw no cast is left alone: "auto" then takes the weights' own. With several floating dtypes,
    the widest holds every value exactly. Other keys keep their order and values."""
    written = {cast or t.dtype for t in tensors if t.dtype.is_floating}
    named = {config[k] for k in ("dtype", "torch_dtype") if k in config}
    if not written or (cast is None and not named):
        return assets, None
    dtype = max(written, key=lambda d: d.itemsize).name
    if cast is None and named == {dtype}:
        return assets, None
    out = {**config, "dtype": dtype, "torch_dtype": dtype}
    text = out.get("text_config")
    if isinstance(text, dict) and ("dtype" in text or "torch_dtype" in text):
        out["text_config"] = {**text, "dtype": dtype, "torch_dtype": dtype}
    data = (json.dumps(out, indent=2) + "\n").encode()
    assets = tuple(FilePlan(p.relpath, (Bytes(data),)) if p.relpath == "config.json" else p for p in assets)
    said = f" (it said {', '.join(sorted(named))})" if named and named != {dtype} else ""
    return assets, f"config.json: dtype and torch_dtype set to {dtype}, the dtype written{said}"


@all_ranks
def export_hf(src: Path | str, dst: Path | str, *, model_key: str = "auto", dtype: CastName = "keep",
              max_shard_size: int | str | None = "5GB", strip_prefixes: tuple[str, ...] = (),
              strip_wrappers: bool = True, hf_assets: Path | str | None = None, preset: str | None = "auto",
              renames: Renames = (), key_map: KeyMapSource = None,
              strict_map: bool = False, keep_fp32: Iterable[str] = (), overwrite: bool = False,
              max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False, progress: bool = False,
              distributed: bool = False, local: LocalOptions | None = None, dry_run: bool = False,
              storage_options: dict | None = None, workers: int | str = 1) -> Report:
    """Write the model tensors of ``src`` as HF safetensors at ``dst`` (with the index file when sharded).

    ``dtype`` is ``keep`` or one of ``bf16``/``fp16``/``fp32`` (or ``bfloat16``/``float16``/``float32``); a cast
    touches floating tensors only. Under a cast, floating tensors whose key matches a regular expression of
    ``keep_fp32`` (searched anywhere in the HF name), and those transformers keeps in float32 when it loads the
    config's model class in that dtype (``_keep_in_fp32_modules`` under fp16, ``_keep_in_fp32_modules_strict``
    under fp16 and bf16), are written in float32; config.json names the cast dtype, as ``save_pretrained``
    does for such a model.

    The model part is found by :mod:`ckptkit.ops.select`'s rule (``model_key`` names it explicitly, as a
    dotted path); a checkpoint of training state alone is refused. Wrapper prefixes are stripped unless
    ``strip_wrappers=False``. A key mapping then renames the keys, as for :func:`ckptkit.convert` (``key_map``,
    ``renames``, ``preset`` towards HF names, ``strict_map``); ``preset="auto"`` (the default) picks the
    family's preset where the keys are torchtitan's names of a known family (:mod:`ckptkit.ops.detect`), and
    None maps nothing. ``hf_assets`` names a model directory whose every file and folder but weights, training
    state, caches and hidden files is copied (config, tokenizer, sentence-transformers modules, generation
    config, chat template, model card; :mod:`ckptkit.ops.assets`), by default the one the checkpoint carries
    (verl's ``huggingface/``); ``lm_head.weight`` is left out only when
    the model ties it (the config's ``tie_word_embeddings``, else its ``model_type``'s default) and it equals
    the input embedding. The copied config.json names the dtype written after a cast, or where it named another.

    ``dry_run`` plans and reports the output (files and sizes, keys renamed, left out and cast, assets copied)
    without writing anything.

    In a save hook, call it from rank 0 alone, or with ``distributed=True`` from every rank of the default
    process group: each rank then writes its share of the output files and rank 0 publishes the result; an
    error on any rank fails every rank, and no DST is written. ``workers`` processes of one machine split the
    files the same way.

    ``src`` may be a run directory of :func:`ckptkit.save` (its ``latest`` step is read, as for
    :func:`ckptkit.convert`). ``src``, ``dst`` and ``hf_assets`` may be URLs; ``storage_options`` go to their
    filesystem (see :func:`ckptkit.convert`).

    Args:
        src: The checkpoint to read: a file, a directory or a URL.
        dst: The HF folder to write; must not exist unless ``overwrite``.
        model_key: Where the model sits, as a dotted path; ``auto`` finds it.
        dtype: ``keep``, or the cast of floating tensors: ``bf16``, ``fp16``, ``fp32`` (or their long names).
        max_shard_size: Largest safetensors file (``"5GB"``, ``"1GiB"`` or bytes); None: one file.
        strip_prefixes: Further leading key prefixes to strip.
        strip_wrappers: Strip ``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.`` and
            ``_checkpoint_wrapped_module.``.
        hf_assets: An HF model directory whose config, generation config and tokenizer files are copied.
        preset: A named key mapping towards HF names (``torchtitan-llama``, ``meta-llama``, ...).
        renames: ``'REGEX=REPLACEMENT'`` renames, applied in order.
        key_map: Old key to new key (None leaves the key out), as a dict or a JSON file.
        strict_map: Refuse keys that neither ``key_map`` nor ``renames`` maps.
        keep_fp32: Regular expressions of HF names kept in float32 under a cast.
        overwrite: Replace an existing ``dst``, atomically on a local filesystem.
        max_memory: Bytes of tensor data held in memory at once (casts, the tied-weight check).
        fsync: Make the output durable across power loss before it is published.
        progress: Show a progress bar.
        distributed: Every rank of the default process group calls this, and each writes its share.
        local: How to read a LOCAL checkpoint.
        dry_run: Plan and report, write nothing.
        storage_options: Keyword arguments of the filesystem of a URL.
        workers: Processes of this machine that write the output files.

    Returns:
        What was written (or, with ``dry_run``, would be): files and sizes, keys renamed, left out and cast,
        assets copied, notes.

    Raises:
        FormatError: A file of ``src`` is not what its format promises, or ``src`` is no checkpoint ckptkit
            knows.
        IncompleteCheckpointError: A rank file, chunk or shard of ``src`` is missing, or chunks overlap.
        UnsafeCheckpointError: A pickle in ``src`` names a global outside the allow-list.
        UsageError: The request is inconsistent: ``dst`` exists without ``overwrite``, lies inside ``src``,
            ``keep_fp32`` comes without a cast, the checkpoint holds training state
            alone, or an option value is unknown.
    """
    cast = parse_cast(dtype)
    keep_patterns = _patterns(keep_fp32, "--keep-fp32")
    if keep_patterns and cast is None:
        raise UsageError("--keep-fp32 keeps tensors in float32 under a cast: use it with --dtype bf16 or fp16")
    mapping = key_mapping(preset=preset, renames=renames, key_map=key_map, strict=strict_map)
    src, dst = storage_at(src, storage_options)[1], storage_at(dst, storage_options)[1]
    # Only the model's chunks are read (DCP): the rest, optimizer state above all, is never written here.
    found = locate(src, local)
    manifest = found.reader.read_part(found.path, model_keys(model_key, tuple(strip_prefixes), strip_wrappers))
    sel = select_model(manifest, model_key, tuple(strip_prefixes), strip_wrappers)
    notes = [found.note] if found.note else []
    notes += sel.notes
    tensors = list(sel.tensors)
    assets: tuple[FilePlan, ...] = ()
    config: dict | None = None
    renamed: tuple[tuple[str, str], ...] = ()
    permuted: tuple[str, ...] = ()
    dropped: list[tuple[str, str]] = []
    if hf_assets is None and manifest.hf_assets is not None:
        hf_assets = manifest.hf_assets
        notes.append(f"config and tokenizer from the checkpoint's {Path(hf_assets).name}/")
    if mapping:
        mapped = map_model(tuple(tensors), mapping, found.path, hf_assets, to_hf=True)
        tensors, renamed, dropped, permuted = (list(mapped.tensors), mapped.renamed, list(mapped.dropped),
                                               mapped.permuted)
        notes += mapped.notes
    if hf_assets is not None:
        assets, config, left_note = _assets(storage_at(hf_assets, storage_options)[1])
        kept = {t.key for t in tensors}
        tensors, tie_note = _untie(tensors, config, max_memory)
        dropped += [(k, "tied to the input embedding") for k in kept - {t.key for t in tensors}]
        assets, dtype_note = _with_written_dtype(assets, config, tensors, cast)
        notes += [n for n in (tie_note, dtype_note) if n]
        notes.append("copied " + ", ".join(p.relpath for p in assets))
        notes += [left_note] if left_note else []
    keep, keep_note = _kept_in_fp32(tensors, keep_patterns, config, cast)
    casts = tuple((t.key, to.name) for t in tensors
                  if (to := cast_for(t.dtype, FLOAT32 if t.key in keep else cast)) is not None)
    if cast:
        n = sum(1 for t in tensors if t.dtype.is_floating and t.dtype != cast and t.key not in keep)
        notes.append(f"cast {n} floating tensors to {cast}; others kept their dtype")
    notes += [keep_note] if keep_note else []
    model = Manifest(manifest.format, manifest.root, tuple(tensors))
    target = Target(max_shard_size=parse_size(max_shard_size), cast=cast, keep_fp32=frozenset(keep))
    return write(model, Format.HF, dst, target, overwrite=overwrite, max_memory=max_memory, fsync=fsync,
                 progress=progress and not distributed, extra_files=assets, notes=tuple(notes), distributed=distributed,
                 src=src, dry_run=dry_run, changes=Changes(renamed, tuple(dropped), casts, permuted), workers=workers)


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

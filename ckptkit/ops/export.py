"""The model part of any checkpoint as a Hugging Face safetensors directory."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.dtypes import parse_cast
from ..core.manifest import Format, Manifest, TensorEntry
from ..core.plan import Bytes, FilePlan
from ..errors import FormatError, UsageError
from ..formats import LocalOptions, Target, detect
from ..io.execute import DEFAULT_MAX_MEMORY
from ..io.sources import Files
from .convert import Report, parse_size, write
from .names import select_model
from .verify import first_difference

__all__ = ["ASSET_FILES", "export_hf"]

ASSET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
               "vocab.txt", "chat_template.jinja", "chat_template.json", "preprocessor_config.json")
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "shared.weight")
_MAX_ASSET = 256 << 20


def _assets(directory: Path) -> tuple[tuple[FilePlan, ...], dict]:
    if not (directory / "config.json").is_file():
        raise UsageError(f"--hf-assets {directory}: no config.json there; expected a Hugging Face model directory")
    plans = []
    for name in ASSET_FILES:
        f = directory / name
        if f.is_file():
            if f.stat().st_size > _MAX_ASSET:
                raise UsageError(f"{f}: {f.stat().st_size} bytes is too large for a config or tokenizer file")
            plans.append(FilePlan(name, (Bytes(f.read_bytes()),)))
    try:
        config = json.loads((directory / "config.json").read_text())
    except ValueError as e:
        raise FormatError(f"{directory / 'config.json'}: not valid JSON ({e})") from e
    return tuple(plans), config


def _untie(tensors: list[TensorEntry], config: dict, max_memory: int) -> tuple[list[TensorEntry], str | None]:
    """Leave out ``lm_head.weight`` when the config ties it to the input embedding, as ``save_pretrained`` does."""
    # transformers' PretrainedConfig defaults tie_word_embeddings to True when a config omits it.
    tied = config.get("tie_word_embeddings", True)
    by_key = {t.key: t for t in tensors}
    head = by_key.get("lm_head.weight")
    if not tied or head is None:
        return tensors, None
    embed = next((t for t in tensors if t.key.endswith(_EMBEDDINGS)), None)
    if embed is None:
        return tensors, "config ties word embeddings but no input embedding was found; lm_head.weight kept"
    with Files() as files:
        diff = first_difference(head, embed, files, max_memory)
    if diff:
        raise UsageError(f"config.json says tie_word_embeddings, but lm_head.weight and {embed.key} differ ({diff}); "
                         "refusing to drop lm_head.weight: use assets whose config says tie_word_embeddings: false")
    return [t for t in tensors if t is not head], f"lm_head.weight left out: tied to {embed.key} (tie_word_embeddings)"


def export_hf(src: Path | str, dst: Path | str, *, model_key: str = "auto", dtype: str = "keep",
              max_shard_size: int | str | None = "5GB", strip_prefixes: tuple[str, ...] = (),
              strip_wrappers: bool = True, hf_assets: Path | str | None = None, overwrite: bool = False,
              max_memory: int = DEFAULT_MAX_MEMORY, fsync: bool = False, progress: bool = False,
              distributed: bool = False, local: LocalOptions | None = None) -> Report:
    """Write the model tensors of ``src`` as HF safetensors at ``dst`` (with the index file when sharded).

    ``dtype`` is ``keep`` or one of ``bf16``/``fp16``/``fp32``; a cast touches floating tensors only.
    Wrapper prefixes are stripped unless ``strip_wrappers=False``; ``hf_assets`` copies config and
    tokenizer files and applies the config's ``tie_word_embeddings``.

    In a save hook, call it from rank 0 alone, or with ``distributed=True`` from every rank of the default
    process group: each rank then writes its share of the output files and rank 0 publishes the result.
    """
    cast = parse_cast(dtype)
    manifest = detect(src, local).read(Path(src))
    sel = select_model(manifest, model_key, tuple(strip_prefixes), strip_wrappers)
    if not sel.tensors:
        raise UsageError(f"{src}: no model tensors found (model key {model_key!r})")
    notes = [f"model taken from top-level key {sel.model_key!r}" if sel.model_key
             else "checkpoint is a flat model state dict"]
    notes += [f"stripped {prefix!r} from {n} keys" for prefix, n in sel.renamed]
    if sel.left_out:
        notes.append(f"{sel.left_out} non-model entries (optimizer state, counters) left out")
    tensors = list(sel.tensors)
    assets: tuple[FilePlan, ...] = ()
    if hf_assets is not None:
        assets, config = _assets(Path(hf_assets))
        tensors, tie_note = _untie(tensors, config, max_memory)
        notes += [tie_note] if tie_note else []
        notes.append("copied " + ", ".join(p.relpath for p in assets))
    if cast:
        n = sum(1 for t in tensors if t.dtype.is_floating and t.dtype != cast)
        notes.append(f"cast {n} floating tensors to {cast}; others kept their dtype")
    model = Manifest(manifest.format, manifest.root, tuple(tensors))
    target = Target(max_shard_size=parse_size(max_shard_size), cast=cast)
    return write(model, Format.HF, dst, target, overwrite=overwrite, max_memory=max_memory, fsync=fsync,
                 progress=progress and not distributed, extra_files=assets, notes=tuple(notes), distributed=distributed,
                 src=src)

"""The model part a conversion writes: selected, and renamed by a key mapping (a preset's, megatron-core's)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..core.manifest import Manifest, ObjectEntry, TensorEntry
from ..errors import UsageError
from ..formats import FormatIO
from ..formats.dcp import check_blobs
from ..formats.megatron import COMMON, extra_states, has_buckets, join_buckets, split_buckets
from ..models.apply import NameTable, listed
from ..models.detect import check_family, detect_family
from ..models.hfclass import class_keys
from ..models.hfconfig import check_single_file, find_config
from ..models.mapping import KeyMapping, KeyMapSource, MappedKeys, Renames, key_mapping, map_keys
from ..models.megatron_args import MEGATRON_SIDE, for_run, run_args
from ..models.preset import ModelShape, Preset
from ..models.registry import MEGATRON, MEGATRON_REFUSED, PRESETS, preset
from ..models.unmapped import refuse_unmapped
from ._optimizer import Entry, MapFn, carry_training_state
from .report import Changes
from .select import ModelSelection, optimizer_sections, select_model

__all__ = ["MEGATRON_STEP_0", "TO_MEGATRON", "Resolved", "check_class", "check_megatron_args", "key_mapping_for",
           "map_model", "megatron_preset", "model_part", "resolve_mapping"]

TO_MEGATRON = "megatron"
"""The ``--to`` name of a megatron-core checkpoint: SHARDED, with megatron-core's names and files."""


def key_mapping_for(io: FormatIO, to: str, src: Path, hf_assets: Path | str | None, preset: str | None,
                    renames: Renames, key_map: KeyMapSource, strict: bool,
                    megatron_args: dict | None = None) -> KeyMapping:
    """The key mapping of a conversion to ``io`` (asked for as ``to``): a model-only HF output maps towards HF
    names by default (``preset="auto"``), a megatron-core one with its family's Megatron preset. ``--megatron-args``
    without any preset to read them is refused."""
    if to == TO_MEGATRON:
        preset = megatron_preset(src, hf_assets, preset)
    elif preset is None and io.hf_model:
        preset = "auto"
    mapping = key_mapping(preset=preset, renames=renames, key_map=key_map, strict=strict)
    if mapping.preset is None:
        check_megatron_args(megatron_args, None)
    return mapping


def model_part(manifest: Manifest, io: FormatIO, to: str, mapping: KeyMapping, src: Path,
               hf_assets: Path | str | None, megatron_args: dict | None = None
               ) -> tuple[Manifest, Changes, tuple[str, ...]]:
    """What a conversion writes of ``manifest``: all of it; or, to a model-only output or under a key mapping,
    the model part under the mapping's names, with (to a checkpoint that holds training state) the optimizer
    state mapped alike (:mod:`._optimizer`) and the rest of the training state. With the renames and drops
    made, and notes for the report."""
    if not (io.hf_model or mapping):
        return manifest, Changes(), ()
    # A model file holds the model: the same part, under the same names, as export-hf writes. The entries it
    # leaves out are decoded all the same (write() decodes only those it writes): convert reads everything,
    # and refuses a checkpoint torch cannot load.
    check_blobs(manifest)
    split: tuple[str, ...] = ()
    if mapping and not io.hf_model and to != TO_MEGATRON and has_buckets(manifest):
        # Megatron's DistributedOptimizer state, as per-parameter state the carrier maps with the weights.
        manifest = split_buckets(manifest)
        split = tuple(f"{k}: {v}" for k, v in manifest.details[-2:])
    sel = select_model(manifest)
    tensors, notes, changes = sel.tensors, sel.notes + split, Changes()
    state: tuple[Entry, ...] = ()
    mapped_by = None
    if mapping:
        to_hf = True if io.hf_model else False if to == TO_MEGATRON else None
        r = resolve_mapping(tensors, mapping, src, hf_assets, to_hf, megatron_args)
        mapped = r.map(tensors, to_hf)
        tensors, notes, mapped_by = mapped.tensors, notes + r.notes + mapped.notes, r.mapping.preset
        changes = Changes(mapped.renamed, mapped.dropped, permuted=mapped.permuted)
        if not io.hf_model and to != TO_MEGATRON:
            carried = carry_training_state(manifest, sel, mapped, lambda ts: r.map(ts, to_hf),
                                           _into_titan(r.mapping, mapped))
            state = carried.entries
            left = tuple(d for d in sel.left_out if d.split(" (", 1)[0] not in carried.groups)
            notes = dataclasses.replace(sel, left_out=left).notes + notes[len(sel.notes):] + carried.notes
        elif to == TO_MEGATRON and len(optimizer_sections(manifest)) == 1 and not has_buckets(manifest):
            state, joined = _joined(manifest, sel, mapped, lambda ts: r.map(ts, to_hf))
            left = tuple(d for d in sel.left_out if d.split(" (", 1)[0] != optimizer_sections(manifest)[0])
            notes = dataclasses.replace(sel, left_out=left).notes + notes[len(sel.notes):] + joined
    if io.hf_model and isinstance(hf_assets, (str, os.PathLike)):  # a URL's assets are not read for this
        config = find_config(Path(src), hf_assets)
        if config is not None and config.is_hf:
            notes += check_class(config.data, [t.key for t in tensors], str(config.path), mapping.preset is None,
                                 mapped_by)
    objects = (*extra_states(tensors), *MEGATRON_STEP_0) if to == TO_MEGATRON else ()
    if to == TO_MEGATRON and megatron_args:
        notes += ("common.pt holds no run arguments (Megatron-LM checks a checkpoint's against its own): pass the "
                  "same --megatron-args to read this checkpoint back",)
    tensors += tuple(e for e in state if isinstance(e, TensorEntry))
    objects += tuple(e for e in state if isinstance(e, ObjectEntry))
    return Manifest(manifest.format, manifest.root, tensors, objects), changes, notes


def _joined(manifest: Manifest, sel: ModelSelection, mapped: MappedKeys, map_fn: MapFn
            ) -> tuple[tuple[Entry, ...], tuple[str, ...]]:
    """The optimizer state of ``manifest`` carried to megatron-core's names and joined into its
    DistributedOptimizer's buckets, which megatron-core's ``dp_reshardable`` load reads; notes for the report."""
    (section,) = optimizer_sections(manifest)
    carried = carry_training_state(manifest, sel, mapped, map_fn, False)
    mine = tuple(e for e in carried.entries if e.key.startswith(section + "."))
    tensors, objects = join_buckets(mapped.tensors, mine, section)
    return (*tensors, *objects), (f"optimizer {section!r} joined into megatron-core's DistributedOptimizer bucket "
                                  "(dp_reshardable, one bucket, the local spec's parameter order): load it with "
                                  "metadata={'distrib_optim_sharding_type': 'dp_reshardable'}",)


def _into_titan(mapping: KeyMapping, mapped: MappedKeys) -> bool:
    """Whether ``mapped`` names the model as torchtitan does (its optimizer state then takes torchtitan's
    layout, which its CheckpointManager loads)."""
    if mapping.preset is None or not mapped.tensors:
        return False
    chosen = preset(mapping.preset)
    table = NameTable(chosen)
    key = mapped.tensors[0].key
    return chosen.other_side == "torchtitan" and bool(table.find(table.other, key)) and not table.find(table.hf, key)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A key mapping made concrete for one checkpoint: ``--preset auto`` resolved, the model's shape a preset
    needs, the preset as adjusted to a Megatron run's arguments, and notes for the report."""

    mapping: KeyMapping
    shape: ModelShape | None = None
    preset: Preset | None = None
    """The preset to apply in place of ``mapping.preset``'s own (a Megatron preset adjusted to the run); None:
    its own."""
    notes: tuple[str, ...] = ()

    def map(self, tensors: tuple[TensorEntry, ...], to_hf: bool | None) -> MappedKeys:
        """``tensors`` under the resolved mapping."""
        return map_keys(tensors, self.mapping, shape=self.shape, to_hf=to_hf, preset=self.preset)


def resolve_mapping(tensors: tuple[TensorEntry, ...], mapping: KeyMapping, src: Path | str,
                    hf_assets: Path | str | None, to_hf: bool | None = None,
                    megatron_args: dict | None = None) -> Resolved:
    """``mapping`` resolved for ``tensors``: ``--preset auto`` to a family's preset; the head counts a preset
    needs from the model's config (:func:`ckptkit.models.hfconfig.find_config`: ``hf_assets``, the source's own
    ``config.json``, Meta's ``params.json`` beside it); a Megatron preset adjusted to the run's arguments, or
    refused (:mod:`ckptkit.models.megatron_args`: the source's own, with ``megatron_args`` over them)."""
    shape = None
    adjusted = None
    notes: tuple[str, ...] = ()
    if mapping.preset is not None:
        remote = any(not isinstance(p, (str, os.PathLike, type(None))) for p in (src, hf_assets))  # read by name
        config = (find_config(Path(src), hf_assets) if not remote and (mapping.preset == "auto" or hf_assets)
                  else None)
        model_type = config.data.get("model_type") if config is not None and config.is_hf else None
        where = str(config.path) if config is not None else "config.json"
        keys = [t.key for t in tensors]
        if mapping.preset == "auto":
            refuse_unmapped(keys, config.data if config is not None else None, where)
            found = detect_family(keys, model_type if isinstance(model_type, str) else None, where)
            if found.unmapped and to_hf:
                raise UsageError(f"--preset auto: {found.why}")
            mapping = dataclasses.replace(mapping, preset=found.preset)
            notes = (f"--preset auto: {found.preset} ({found.why})",) if found.preset else ()
        if mapping.preset is not None:
            chosen = preset(mapping.preset)
            check_single_file(chosen, Path(src))
            check_family(chosen, keys, model_type if isinstance(model_type, str) else None, where)
            if config is None and (chosen.needs_shape or any(r.tied_to for r in chosen.rows)):
                config = find_config(Path(src), hf_assets)
            shape = config.shape() if config is not None else None
            if chosen.other_side == MEGATRON_SIDE:
                own = None if remote or to_hf is False else Path(src)  # an HF source has no Megatron arguments
                adjusted, shape, said = for_run(chosen, shape, run_args(own, megatron_args))
                notes += said
    check_megatron_args(megatron_args, mapping.preset)
    return Resolved(mapping, shape, adjusted, notes)


def map_model(tensors: tuple[TensorEntry, ...], mapping: KeyMapping, src: Path | str,
              hf_assets: Path | str | None, to_hf: bool | None, megatron_args: dict | None = None) -> MappedKeys:
    """The model's tensors under ``mapping``, resolved by :func:`resolve_mapping`."""
    r = resolve_mapping(tensors, mapping, src, hf_assets, to_hf, megatron_args)
    mapped = r.map(tensors, to_hf)
    return dataclasses.replace(mapped, notes=r.notes + mapped.notes, preset=r.mapping.preset)


def check_megatron_args(megatron_args: dict | None, preset_name: str | None) -> None:
    """Refuses ``--megatron-args`` under a mapping that is not a Megatron preset's: they would go unread."""
    if megatron_args and (preset_name in (None, "auto") or preset(preset_name).other_side != MEGATRON_SIDE):
        raise UsageError(f"--megatron-args applies to a Megatron preset ({', '.join(MEGATRON.values())}), not "
                         f"--preset {preset_name or 'none'}")


MEGATRON_STEP_0 = tuple(ObjectEntry(k, (k,), v, sidecar=COMMON) for k, v in (("checkpoint_version", 3.0),
                                                                              ("iteration", 0)))
"""``common.pt`` of a model written for megatron-core: the state Megatron-LM's loader reads beside the model
(its checkpoint format version, and the step, 0), and no run arguments or optimizer."""


def megatron_preset(src: Path, hf_assets: Path | str | None, preset: str | None) -> str:
    """The preset ``convert --to megatron`` maps with: ``preset`` (a ``megatron-*`` one), else the one for the
    model's ``model_type`` (:data:`ckptkit.models.registry.MEGATRON`).

    Raises:
        UsageError: another family's preset, or no preset and a config that names no family with a table.
    """
    if preset not in (None, "auto"):
        if preset not in MEGATRON.values():
            raise UsageError(f"--to megatron maps HF names to megatron-core's with a Megatron preset "
                             f"({', '.join(MEGATRON.values())}), not --preset {preset}")
        return preset
    config = find_config(Path(src), hf_assets)
    model_type = config.data.get("model_type") if config is not None else None
    where = str(config.path) if config is not None else f"{src}: no config.json, and"
    if isinstance(model_type, str) and model_type in MEGATRON_REFUSED:
        raise UsageError(f"{where}: model_type {model_type!r}: {MEGATRON_REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in MEGATRON:
        raise UsageError(f"{where} model_type {model_type!r:.40} has no Megatron table; pass --preset "
                         f"({', '.join(MEGATRON.values())})")
    return MEGATRON[model_type]


def check_class(config: dict, keys: list[str], where: str, keep_names: bool, mapped_by: str | None = None
                ) -> tuple[str, ...]:
    """Refuses an HF output that transformers' class of ``config`` (read from ``where``) would load differently:
    keys it does not load, or weights of it that no key gives (:func:`ckptkit.models.hfclass.class_keys`).
    ``keep_names`` (``--preset none``): the names were asked for as they are, so keys it does not load are a
    note. Buffers the class computes itself are always a note. Keys that preset ``mapped_by`` wrote for the
    family the config names are not checked again: each table is tested against that family's class, and
    importing transformers' model code costs seconds.

    Returns:
        Notes for the report.

    Raises:
        UsageError: the keys and the class disagree.
    """
    if mapped_by is not None and config.get("model_type") in PRESETS[mapped_by].model_types:
        return ()
    found = class_keys(config, keys)
    if found is None:
        return ()
    notes = []
    if found.unexpected and keep_names:
        notes.append(f"--preset none: transformers' {found.name} ({where}) does not load {len(found.unexpected)} of "
                     f"the keys written: {listed(found.unexpected)}")
    elif found.unexpected or found.missing:
        said = [f"does not load {len(found.unexpected)} of the keys to write ({listed(found.unexpected)})"
                ] if found.unexpected else []
        said += [f"would initialise {len(found.missing)} of its weights afresh, which no key gives "
                 f"({listed(found.missing)})"] if found.missing else []
        advice = (f"the names need a --preset ({', '.join(PRESETS)}), or --hf-assets of the model these weights are; "
                  "--preset none writes the names as they are" if found.unexpected
                  else "--hf-assets of the model these weights are")
        raise UsageError(f"{where}: transformers' {found.name} {' and '.join(said)}: {advice}")
    if found.buffers:
        notes.append(f"transformers' {found.name} computes {len(found.buffers)} buffers the output does not hold: "
                     f"{listed(found.buffers)}")
    return tuple(notes) or (f"every key loads in transformers' {found.name} ({where}), and none of its weights is "
                            "missing",)

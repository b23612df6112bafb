"""The model part a conversion writes: selected, and renamed by the command's one plan
(:func:`ckptkit.models.resolve.resolve`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..core.manifest import Manifest, ObjectEntry, TensorEntry
from ..formats import FormatIO
from ..formats.dcp import check_blobs
from ..formats.megatron import COMMON, extra_states, has_buckets, join_buckets, split_buckets
from ..models.evidence import Evidence, read_evidence
from ..models.mapping import KeyMapping, MappedKeys
from ..models.matching import NameTable
from ..models.resolve import Plan, Towards, resolve
from ._optimizer import Entry, MapFn, carry_training_state
from ._step import saved_step
from .report import Changes
from .select import ModelSelection, optimizer_sections, select_model

__all__ = ["TO_MEGATRON", "megatron_common", "model_part", "plan_of", "towards"]

TO_MEGATRON = "megatron"
"""The ``--to`` name of a megatron-core checkpoint: SHARDED, with megatron-core's names and files."""


def towards(io: FormatIO, to: str) -> Towards | None:
    """The names a conversion to ``io`` (asked for as ``to``) writes."""
    return "hf" if io.hf_model else "megatron" if to == TO_MEGATRON else None


def plan_of(mapping: KeyMapping, src: Path, manifest: Manifest | None, keys: tuple[str, ...],
            to: Towards | None) -> Plan:
    """The command's plan: ``mapping`` resolved once against what the checkpoint at ``src`` (read as
    ``manifest``, its model part named ``keys``) says of its model."""
    asked = mapping.preset is not None or to is not None
    evidence = read_evidence(src, keys, manifest, mapping.hf_assets, mapping.megatron_args, config=asked) \
        if asked or mapping.megatron_args else Evidence(keys)
    return resolve(mapping, evidence, to)


def model_part(manifest: Manifest, io: FormatIO, to: str, mapping: KeyMapping, src: Path
               ) -> tuple[Manifest, Changes, tuple[str, ...]]:
    """What a conversion writes of ``manifest``: all of it; or, to a model-only output or under a key mapping,
    the model part under the mapping's names, with (to a checkpoint that holds training state) the optimizer
    state mapped alike (:mod:`._optimizer`) and the rest of the training state. With the renames and drops
    made, and notes for the report."""
    direction = towards(io, to)
    if not (direction or mapping):
        plan_of(mapping, src, None, (), None)  # refuses --megatron-args that nothing would read
        return manifest, Changes(), ()
    # A model file holds the model: the same part, under the same names, as export-hf writes. The entries it
    # leaves out are decoded all the same (write() decodes only those it writes): convert reads everything,
    # and refuses a checkpoint torch cannot load.
    check_blobs(manifest)
    split: tuple[str, ...] = ()
    if mapping and direction is None and has_buckets(manifest):
        # Megatron's DistributedOptimizer state, as per-parameter state the carrier maps with the weights.
        manifest = split_buckets(manifest)
        split = tuple(f"{k}: {v}" for k, v in manifest.details[-2:])
    sel = select_model(manifest)
    tensors, notes, changes = sel.tensors, sel.notes + split, Changes()
    state: tuple[Entry, ...] = ()
    plan = plan_of(mapping, src, manifest, tuple(t.key for t in tensors), direction)
    if plan.preset is not None or mapping:
        mapped = plan.map(tensors)
        tensors, notes = mapped.tensors, notes + plan.notes + mapped.notes
        changes = Changes(mapped.renamed, mapped.dropped, permuted=mapped.permuted)
        if direction is None:
            carried = carry_training_state(manifest, sel, mapped, plan.map, _into_titan(plan, mapped))
            state = carried.entries
            left = tuple(d for d in sel.left_out if d.split(" (", 1)[0] not in carried.groups)
            notes = dataclasses.replace(sel, left_out=left).notes + notes[len(sel.notes):] + carried.notes
        elif direction == "megatron" and len(optimizer_sections(manifest)) == 1 and not has_buckets(manifest):
            state, joined = _joined(manifest, sel, mapped, plan.map)
            left = tuple(d for d in sel.left_out if d.split(" (", 1)[0] != optimizer_sections(manifest)[0])
            notes = dataclasses.replace(sel, left_out=left).notes + notes[len(sel.notes):] + joined
    else:
        notes += plan.notes
    if io.hf_model and isinstance(mapping.hf_assets, (str, os.PathLike)):  # a URL's assets are not read for this
        config = plan.config
        if config is not None and config.is_hf:
            notes += plan.check_class(config.data, [t.key for t in tensors], str(config.path))
    objects: tuple[ObjectEntry, ...] = ()
    if direction == "megatron":
        step = saved_step(manifest)
        objects = (*extra_states(tensors), *megatron_common(step.value if step else 0))
        notes += (f"common.pt: iteration {step.value}, the step the source records ({step.where})",) if step else ()
    if direction == "megatron" and mapping.megatron_args:
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


def _into_titan(plan: Plan, mapped: MappedKeys) -> bool:
    """Whether ``mapped`` names the model as torchtitan does (its optimizer state then takes torchtitan's
    layout, which its CheckpointManager loads)."""
    if plan.preset is None or not mapped.tensors:
        return False
    table = NameTable(plan.preset)
    key = mapped.tensors[0].key
    return (plan.preset.other_side == "torchtitan" and bool(table.find(table.other, key))
            and not table.find(table.hf, key))


def megatron_common(iteration: int) -> tuple[ObjectEntry, ...]:
    """``common.pt`` of a model written for megatron-core: the state Megatron-LM's loader reads beside the model
    (its checkpoint format version, and the step, ``iteration``), and no run arguments or optimizer."""
    return tuple(ObjectEntry(k, (k,), v, sidecar=COMMON) for k, v in (("checkpoint_version", 3.0),
                                                                      ("iteration", iteration)))


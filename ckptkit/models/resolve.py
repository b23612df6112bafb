"""One resolution per command: a :class:`~ckptkit.models.mapping.KeyMapping` and what the checkpoint says of its
model (:class:`~ckptkit.models.evidence.Evidence`) made into a frozen :class:`Plan`.

Call order: :func:`ckptkit.models.evidence.read_evidence` reads the checkpoint's evidence once (its config, its
Megatron run's arguments); :func:`resolve` decides, reading nothing: ``--preset auto``'s family
(:mod:`ckptkit.models.detect`), or ``convert --to megatron``'s by ``model_type``; the checks of an explicit preset
against the config and the keys; the Megatron run's arguments against the family's table
(:func:`ckptkit.models.megatron_args.for_run`). The plan then renames tensors (:meth:`Plan.map`), asks
transformers' class (:meth:`Plan.check_class`) and makes a ``config.json`` from the run's arguments
(:meth:`Plan.megatron_config`) as often as the command needs, without resolving again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..core.manifest import TensorEntry
from ..errors import UsageError
from .detect import check_family, detect_family, refuse_unmapped
from .evidence import Evidence, ModelConfig
from .family import Family
from .hfclass import check_class
from .mapping import KeyMapping, MappedKeys, map_keys
from .megatron_args import MEGATRON_SIDE, RunArgs, for_run
from .preset import Preset
from .registry import FAMILIES, MEGATRON, MEGATRON_REFUSED, family_of, kin, preset
from .shape import ModelShape

__all__ = ["Plan", "Towards", "resolve"]

Towards = Literal["hf", "megatron"]
"""Which names a conversion writes: HF's (an HF output), megatron-core's (``convert --to megatron``), or, when
None, the other side of whichever the keys are."""


@dataclass(frozen=True)
class Plan:
    """A key mapping made concrete for one checkpoint (see the module docstring)."""

    mapping: KeyMapping
    """The mapping asked for."""
    preset: Preset | None = None
    """The table applied: the preset named or detected, as the run's arguments adjust it; None: no preset."""
    family: Family | None = None
    shape: ModelShape | None = None
    """The model's head counts, layers and tying, from its config or the run's arguments."""
    args: RunArgs | None = None
    """The Megatron run's arguments, where there are any."""
    config: ModelConfig | None = None
    """The model's config the evidence held."""
    notes: tuple[str, ...] = ()
    """How it was decided, for the report."""
    to_hf: bool | None = None

    def map(self, tensors: Iterable[TensorEntry]) -> MappedKeys:
        """``tensors`` under the plan's names."""
        mapping = dataclasses.replace(self.mapping, preset=self.preset.name if self.preset is not None else None)
        return map_keys(tensors, mapping, shape=self.shape, to_hf=self.to_hf, preset=self.preset)

    def check_class(self, config: dict, keys: Sequence[str], where: str) -> tuple[str, ...]:
        """Notes on how transformers' class of ``config`` (read from ``where``) loads ``keys``
        (:func:`ckptkit.models.hfclass.check_class`).

        Raises:
            UsageError: the keys and the class disagree.
        """
        return check_class(config, keys, where, self.mapping.preset is None, self.preset)

    def megatron_config(self, tensors: Sequence[TensorEntry]) -> tuple[dict | None, str | None]:
        """The ``config.json`` made from the run's arguments for the exported ``tensors`` (HF names), with a note;
        (None, None) where the table is no Megatron one or there are no arguments; (None, why) where the family
        makes none.

        Raises:
            UsageError: the arguments lack a field the config needs.
        """
        if self.preset is None or self.preset.other_side != MEGATRON_SIDE or self.args is None:
            return None, None
        made = self.family.megatron_config(self.preset, self.args, tensors) if self.family is not None else None
        if made is None:
            made_for = [t for f in FAMILIES if f.megatron is not None for t, _ in f.megatron.configs]
            return None, (f"no config.json written: ckptkit makes one from Megatron's arguments for "
                          f"{', '.join(made_for)} only; pass --hf-assets DIR with the model's config.json")
        return made


def resolve(mapping: KeyMapping, evidence: Evidence, towards: Towards | None = None) -> Plan:
    """``mapping`` made concrete for the checkpoint ``evidence`` describes (see the module docstring).

    Args:
        mapping: the key mapping asked for.
        evidence: what the checkpoint says of its model.
        towards: the names the conversion writes.

    Returns:
        The plan.

    Raises:
        UsageError: no preset maps the keys towards HF names; an explicit preset of another family; a run's
            argument the table does not map; ``--megatron-args`` without a Megatron preset.
    """
    name, notes = mapping.preset, []
    if towards == "megatron":
        name = _megatron_preset(name, evidence)
    if name == "auto":
        refuse_unmapped(evidence.keys, evidence.config.data if evidence.config is not None else None, evidence.where)
        found = detect_family(evidence.keys, evidence.model_type, evidence.where)
        if found.unmapped and towards == "hf":
            raise UsageError(f"--preset auto: {found.why}")
        name = found.preset
        notes += [f"--preset auto: {found.preset} ({found.why})"] if found.preset else []
    to_hf = {"hf": True, "megatron": False}.get(towards or "")
    if name is None:
        _check_megatron_args(mapping, None)
        return Plan(mapping, args=evidence.args, config=evidence.config, notes=tuple(notes), to_hf=to_hf)
    chosen = preset(name)
    family = family_of(chosen)
    if chosen.single_file and len(evidence.model_parallel) > 1:
        parallel = evidence.model_parallel
        advice = f" ({family.model_parallel})" if family is not None and family.model_parallel else ""
        raise UsageError(f"{evidence.source}: one of {len(parallel)} model-parallel files ({parallel[0]} ... "
                         f"{parallel[-1]}); --preset {chosen.name} reads a single-file checkpoint, and joining "
                         f"model-parallel slices is not supported{advice}")
    check_family(chosen, evidence.keys, evidence.model_type, evidence.where)
    shape = evidence.config.shape() if evidence.config is not None else None
    if chosen.other_side == MEGATRON_SIDE:
        rules = family.megatron if family is not None else None
        chosen, shape, said = for_run(chosen, shape, evidence.args, rules, config=evidence.hf_config, kin=kin(chosen))
        notes += said
    _check_megatron_args(mapping, chosen)
    return Plan(mapping, chosen, family, shape, evidence.args, evidence.config, tuple(notes), to_hf)


def _megatron_presets() -> str:
    return ", ".join(dict.fromkeys(MEGATRON.values()))


def _check_megatron_args(mapping: KeyMapping, p: Preset | None) -> None:
    """Refuses ``--megatron-args`` under a mapping that is not a Megatron preset's: they would go unread."""
    if mapping.megatron_args and (p is None or p.other_side != MEGATRON_SIDE):
        raise UsageError(f"--megatron-args applies to a Megatron preset ({_megatron_presets()}), not "
                         f"--preset {p.name if p is not None else mapping.preset or 'none'}")


def _megatron_preset(name: str | None, evidence: Evidence) -> str:
    """The preset ``convert --to megatron`` maps with: ``name`` (a Megatron one), else the one for the model's
    ``model_type`` (:data:`ckptkit.models.registry.MEGATRON`).

    Raises:
        UsageError: another framework's preset, or no preset and a config that names no family with a table.
    """
    if name not in (None, "auto"):
        if name not in MEGATRON.values():
            raise UsageError(f"--to megatron maps HF names to megatron-core's with a Megatron preset "
                             f"({_megatron_presets()}), not --preset {name}")
        return name
    config = evidence.config
    model_type = config.data.get("model_type") if config is not None else None
    where = str(config.path) if config is not None else f"{evidence.source}: no config.json, and"
    if isinstance(model_type, str) and model_type in MEGATRON_REFUSED:
        raise UsageError(f"{where}: model_type {model_type!r}: {MEGATRON_REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in MEGATRON:
        raise UsageError(f"{where} model_type {model_type!r:.40} has no Megatron table; pass --preset "
                         f"({_megatron_presets()})")
    return MEGATRON[model_type]

"""A model family: everything ckptkit knows of it, in one frozen :class:`Family` that the family's module in
:mod:`ckptkit.models.families` exports as ``FAMILY``.

A family has presets (its tables, one per framework that has it: torchtitan's, Meta's, megatron-core's, or HF's
own names checked), its Hugging Face model types with their transformers classes (:class:`HfModel`), the rules
its Megatron table applies to a run's arguments and the ``config.json`` it makes from them
(:class:`ckptkit.models.megatron_args.MegatronRules`), and what detection recognises it by: the ``model_type`` of
``config.json`` (each preset's ``model_types``, the :class:`HfModel` ones), its tables' names, and, for a family
that a framework ships and ckptkit does not map, the names that refuse it (:class:`Unmapped`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..core.manifest import TensorEntry
from .megatron_args import MegatronRules, RunArgs
from .preset import Preset

__all__ = ["Family", "HfModel", "Unmapped"]


@dataclass(frozen=True, slots=True)
class HfModel:
    """One of the family's Hugging Face model types."""

    model_type: str
    """``config.json``'s ``model_type``."""
    architecture: str | None = None
    """transformers' causal-LM class of it, as ``config.json``'s ``architectures`` names it."""
    tied: bool | None = None
    """transformers' default of ``tie_word_embeddings`` for it, used where transformers is not installed to ask."""


@dataclass(frozen=True)
class Unmapped:
    """A family that a framework ships and ckptkit has no table for: ``--preset auto`` refuses it by name, rather
    than writing its tensors under their own names into an HF folder."""

    family: str
    """What the family is, for the message (``torchtitan's flux``)."""
    why: str
    model_types: tuple[str, ...] = ()
    """The ``config.json`` ``model_type`` values (or diffusers' ``_class_name``) that name it."""
    keys: tuple[str, ...] = ()
    """Names, with ``{n}`` placeholders, any of which recognises the family's own checkpoint."""


@dataclass(frozen=True)
class Family:
    """A model family: its presets and every fact about it that a conversion needs."""

    name: str
    """The family's module name."""
    presets: tuple[Preset, ...] = ()
    """Its tables, one per framework whose names they map (and HF's own names, checked)."""
    hf: tuple[HfModel, ...] = ()
    """Its Hugging Face model types."""
    megatron: MegatronRules | None = None
    """What its Megatron table needs of a run beyond its rows, the ``config.json`` made from a run's arguments, or
    why it has no Megatron table."""
    unmapped: Unmapped | None = None
    """For a family a framework ships and no preset maps: how ``--preset auto`` recognises and refuses it."""
    reads: tuple[tuple[str, str], ...] = ()
    """(preset, ``model_type``): the preset's table also maps checkpoints of that model type (an MoE table
    that holds the dense variant's layers too), so an explicit ``--preset`` is not refused for it."""
    model_parallel: str = ""
    """What to do with a model-parallel checkpoint that a single-file table of the family refuses
    (:attr:`ckptkit.models.preset.Preset.single_file`)."""
    rank: int = 100
    """Where its presets are listed among their framework's (``--preset``'s choices, ``ckptkit presets``, the
    presets a refusal names): lower first, then by name."""

    @property
    def model_types(self) -> tuple[str, ...]:
        """Every ``model_type`` the family's presets and HF models name."""
        named = [t for p in self.presets for t in p.model_types] + [m.model_type for m in self.hf]
        return tuple(dict.fromkeys(named))

    def megatron_config(self, p: Preset, args: RunArgs, tensors: Sequence[TensorEntry]) -> tuple[dict, str] | None:
        """The ``config.json`` of preset ``p``'s model made from the run's ``args`` and the exported ``tensors``,
        with a note saying where each field came from; None where the family makes none.

        Raises:
            UsageError: the arguments lack a field the config needs, or describe a model the config cannot.
        """
        build = self.megatron.config_builder(p) if self.megatron is not None else None
        return build(args, tensors) if build is not None else None

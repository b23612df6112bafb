"""The model layer: how a framework's tensor names and layouts become Hugging Face's, and back.

A family has presets; a preset is a table. One module an idea, in the order a conversion uses them:

- :mod:`.families`: one module a model family, each exporting a ``FAMILY``; ``_``-prefixed building blocks.
- :mod:`.family`: :class:`~.family.Family`, everything about one family (presets, HF model types, Megatron rules).
- :mod:`.preset`: the table format (:class:`~.preset.Row`, :class:`~.preset.Preset`), the rotary row gather.
- :mod:`.shape`: :class:`~.shape.ModelShape`, the head counts, layers and tying a table needs from a config.
- :mod:`.registry`: finds every family; the presets by name, and the ``model_type`` maps that follow.
- :mod:`.megatron_args`: a Megatron run's arguments checked against a table, and the family's rules for them.
- :mod:`.evidence`: what a checkpoint says of its model (config, run arguments), read once.
- :mod:`.detect`: which preset ``--preset auto`` takes; an explicit one's family checked; unmapped families refused.
- :mod:`.resolve`: a key mapping and the evidence made into one frozen plan per command.
- :mod:`.mapping`: :class:`~.mapping.KeyMapping` (``--key-map``, ``--rename``, ``--preset`` and what a preset reads),
  and the renames applied.
- :mod:`.matching`: a table's names as regular expressions; the preset nearest to keys; a refusal's advice.
- :mod:`.apply`: a table applied to a model's tensors (byte ranges, row gathers, computed tensors).
- :mod:`.completeness`: every tensor of the table present; what an import adds (tied copies, buffers).
- :mod:`.wrappers`: the wrapper names training leaves in keys, stripped.
- :mod:`.hfconfig`: what a ``config.json`` says (weight tying, modules kept in float32, its transformers class).
- :mod:`.hfclass`: the keys transformers' class loads, compared with an HF output's.
- :mod:`.classcache`: transformers' answers, remembered on disk between runs.

Nothing here reads tensor bytes or imports torch at import time.
"""

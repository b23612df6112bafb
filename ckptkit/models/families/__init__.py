"""The model families, one module each, whose ``FAMILY`` (:class:`ckptkit.models.family.Family`) holds
everything about the family: its presets (one table per framework), its HF model types, its Megatron rules and
the ``config.json`` made from a Megatron run's arguments. :mod:`ckptkit.models.registry` finds every module here
whose name does not start with ``_``; those that do hold the rows families share (:mod:`._rows`, torchtitan's
:mod:`._titan`, megatron-core's :mod:`._mcore`, its config recipe :mod:`._mcore_config`).

Adding a family is adding a module here and its test against the family's own framework code
(``docs/architecture.md``, "Adding a model family").
"""

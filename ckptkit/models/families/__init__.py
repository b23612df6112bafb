"""The model families, one module each: a module's ``PRESETS`` tuple holds its tables
(:class:`ckptkit.models.table.Preset`), and :mod:`ckptkit.models.registry` finds every module here.

Adding a family is adding a module here (its rows, and the ``model_type`` values it is detected by) and a test
that checks it against the family's own framework code.
"""

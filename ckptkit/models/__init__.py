"""The model layer: how a framework's tensor names and layouts become Hugging Face's, and back.

A family is a table (:mod:`.table`: rows, stacking, splits, row gathers), one module a family in
:mod:`.families`, found by :mod:`.registry`. :mod:`.engine` applies a table to a manifest's entries as pure
planning (byte ranges, computed transposes and dequantizations); :mod:`.detect` picks a table from a
checkpoint's own evidence; :mod:`.hfconfig` reads what ``config.json`` (or Megatron's ``args``) says of the
model's shape; :mod:`.mapping` puts ``--preset``, ``--rename`` and ``--key-map`` together; :mod:`.names`
strips the wrapper names training leaves in keys. Nothing here reads tensor bytes or imports torch.
"""

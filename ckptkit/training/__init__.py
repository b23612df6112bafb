"""Checkpoints from inside a training loop: ``ckptkit.save``, ``ckptkit.load`` and what they rely on.

- :mod:`.save`: ``ckptkit.save``, called on every rank, writes a model (plain module, DDP, FSDP1 or FSDP2)
  with its optimizer, scheduler and extra state in one of four forms, synchronously or in the background,
  into a checkpoint directory or a run directory's step.
- :mod:`.load`: ``ckptkit.load`` reads a checkpoint of any form, saved at any world size, into the model at
  hand, checking the checksums the save recorded.
- :mod:`.rotation`: the run directory a save with ``step`` writes: step directories, their completion
  markers, ``latest``, and the removal of the least recent saves.
- :mod:`.hf_trainer`: a ``transformers.Trainer`` callback that exports HF safetensors beside each checkpoint.
- :mod:`.fsdp1_offload`: what a load into FSDP1 with parameter offloading needs first.

Nothing is imported here: ``import ckptkit`` stays torch-free, and ``ckptkit.save`` and ``ckptkit.load`` load
:mod:`.save` and :mod:`.load` (and torch) on first use.
"""

"""The training step a checkpoint records, wherever its framework keeps it.

Frameworks record the step in different places, and some only in the optimizer:

- a top-level ``step`` (``ckptkit.save``, Lightning Fabric's state), or ``global_step`` (Lightning's Trainer);
- ``train_state.step`` (torchtitan's ``CheckpointManager``);
- ``iteration`` (megatron-core's ``common.pt``, as Megatron-LM saves it);
- ``global_steps`` (DeepSpeed's engine, which its reader keeps as a detail);
- where none of these is saved (a plain ``dcp.save`` of ``get_state_dict``, accelerate's ``save_state``, or
  any of them after a conversion that carries the optimizer alone), the optimizer's own ``step`` of each
  parameter (Adam's): the number of optimizer steps taken.

Only these small values are read: an object's value, or a scalar tensor's few bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.manifest import Manifest
from ..formats import scalar_value
from ..io.sources import Files
from .select import optimizer_sections

__all__ = ["Step", "optimizer_step", "recorded_step", "saved_step"]

_RECORDED = (("step",), ("train_state", "step"), ("iteration",), ("global_step",))
"""Where a framework records the step itself, as a path in the checkpoint's tree, in the order asked."""


@dataclass(frozen=True)
class Step:
    """A training step read from a checkpoint."""

    value: int
    where: str
    """The key it was read from, for reports."""


def _whole(value: Any) -> int | None:
    """``value`` as a step: a whole, non-negative number (an optimizer's 3.0 is step 3); else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return int(value) if float(value).is_integer() else None


def recorded_step(manifest: Manifest) -> Step | None:
    """The step a framework recorded itself in ``manifest`` (see the module docstring), if any."""
    entries = {tuple(map(str, e.path)): e for e in manifest.entries if len(e.path) <= 2}
    for path in _RECORDED:
        entry = entries.get(path)
        if entry is not None and (value := _whole(scalar_value(entry))) is not None:
            return Step(value, entry.key)
    steps = dict(manifest.details).get("global_steps")
    if steps is not None and str(steps).isdigit():
        return Step(int(steps), "global_steps")
    return None


def optimizer_step(manifest: Manifest) -> Step | None:
    """The optimizer's step (``<optimizer>.state.<parameter>.step``) where every parameter's is the same whole
    number; None where there is none, or they differ."""
    for section in optimizer_sections(manifest):
        head = section + ".state."
        steps = [e for e in manifest.entries if e.key.startswith(head) and e.key.endswith(".step")]
        with Files() as files:
            values = {_whole(scalar_value(e, files)) for e in steps}
        if len(values) == 1 and (value := values.pop()) is not None:
            return Step(value, f"{head}<parameter>.step")
    return None


def saved_step(manifest: Manifest) -> Step | None:
    """The step ``manifest`` records: the framework's own (:func:`recorded_step`), else the optimizer's."""
    return recorded_step(manifest) or optimizer_step(manifest)

"""The training state torchtitan's ``CheckpointManager`` loads beside the model and the optimizer, written for a
checkpoint converted into torchtitan's names from another framework's.

torchtitan's Trainer registers ``train_state`` (itself: ``{"step", "ntokens_seen"}``) and ``lr_scheduler``
(``LRSchedulersContainer``: ``{"last_epoch"}``, from which each ``LambdaLR`` recomputes its rate) with its
``CheckpointManager``, whose strict ``dcp.load`` wants both unless they are listed in ``exclude_from_loading``.
From the source's step (:mod:`._step`) they are:

- ``train_state.step``: the step, so that the Trainer goes on with the next one;
- ``train_state.ntokens_seen``: a count torchtitan logs; no other framework keeps it, so it is 0, and said so;
- ``lr_scheduler.last_epoch``: the source scheduler's ``last_epoch`` where it saved a torch scheduler's
  state, else the step (torchtitan steps its schedulers once per training step).

A source that saved them (torchtitan's own) keeps its own. The dataloader's state is per data-parallel rank and
does not reshard: load with ``exclude_from_loading=["dataloader"]``.
"""

from __future__ import annotations

from ..core.manifest import Manifest, ObjectEntry
from ..formats import object_value
from ._step import saved_step

__all__ = ["titan_train_state"]

TRAIN_STATE, LR_SCHEDULER = "train_state", "lr_scheduler"


def _last_epoch(manifest: Manifest) -> int | None:
    """``last_epoch`` of the one torch LR scheduler state the source holds, if it holds one."""
    found = [v for o in manifest.objects if o.path[-1] == "last_epoch" and len(o.path) > 1
             and isinstance(v := object_value(o), int) and not isinstance(v, bool)]
    return found[0] if len(found) == 1 else None


def titan_train_state(manifest: Manifest, carried: list[str]) -> tuple[list[ObjectEntry], list[str]]:
    """torchtitan's ``train_state`` and ``lr_scheduler`` entries for ``manifest``, those of the two that are not
    among the top-level groups ``carried`` as saved; and notes for the report.

    Args:
        manifest: The source checkpoint.
        carried: The training state's top-level groups carried as saved.

    Returns:
        The entries (none where the source records no step) and notes saying what was written.
    """
    missing = [g for g in (TRAIN_STATE, LR_SCHEDULER) if g not in carried]
    if not missing:
        return [], []
    step = saved_step(manifest)
    if step is None:
        return [], [f"no {' or '.join(missing)} written: the source records no step; load it in torchtitan with "
                    f"exclude_from_loading={missing + ['dataloader']!r}"]
    entries, notes = [], []
    if TRAIN_STATE in missing:
        entries += [ObjectEntry(f"{TRAIN_STATE}.{k}", (TRAIN_STATE, k), v)
                    for k, v in (("step", step.value), ("ntokens_seen", 0))]
        notes.append(f"train_state written for torchtitan's Trainer: step {step.value} (from {step.where}), "
                     "ntokens_seen 0 (the source does not count tokens)")
    if LR_SCHEDULER in missing:
        last = _last_epoch(manifest)
        epoch = last if last is not None else step.value
        entries.append(ObjectEntry(f"{LR_SCHEDULER}.last_epoch", (LR_SCHEDULER, "last_epoch"), epoch))
        notes.append(f"lr_scheduler written for torchtitan's LRSchedulersContainer: last_epoch {epoch} (from "
                     f"{'the source scheduler' if last is not None else step.where})")
    return entries, notes

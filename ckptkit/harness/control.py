"""Torch-only controls: whether a cell's loss drift is ckptkit's doing or torch's own.

A cell whose resumed losses leave the uninterrupted run's has its target configuration run once more with
no ckptkit anywhere: train under the target configuration at the target's world size, save with torch in
the target's form (FULL for an HF target: torch has no HF writer), load that checkpoint into fresh ranks
of the same configuration, and train on. The control's resumed losses are weighed against the same
uninterrupted run the cell was weighed against (the cell's source run), so a configuration that trains off
that run for reasons of its own counts against torch too; the control's drift from its own uninterrupted
run is reported beside it.

The rule: a cell whose state loaded bit for bit, whose losses drift, and whose control drifts as much is
``torch`` (:data:`CONTROL_SHARE` says how much "as much" is); every other drifting cell is ``FAIL``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .configs import Format, TrainConfig

__all__ = ["CONTROL_SHARE", "Control", "control_config"]

CONTROL_SHARE = 0.5
"""A control "drifts as much as the cell" when it fails the loss check and its drift is at least this share of
the cell's. Where torch resumes off the trajectory, the control and the cell start from states a few
roundings apart when the world size changes, so their drifts agree in size, not to the digit: the factor 2
leaves room for that. (On CPU, a perturbed resume into one rank drifts 7.4e-3 in the cell and in its control
alike, from FSDP1 at 2 ranks as from a plain model.) A conversion that damages what the state check cannot
see drifts beyond what torch alone does."""


def control_config(target: TrainConfig) -> TrainConfig:
    """The configuration a control saves and resumes in: the target's, in the target's form (FULL for HF)."""
    return dataclasses.replace(target, form=Format.FULL) if target.form is Format.HF else target


@dataclass(frozen=True)
class Control:
    """What a torch-only control found, beside the cell it was run for."""

    cell_drift: float
    """The cell's largest relative loss difference from the uninterrupted run."""
    drift: float
    """The control's, from the same uninterrupted run (the cell's source run)."""
    own_drift: float
    """The control's from its own uninterrupted run (the target configuration trained without a break)."""
    rtol: float
    """The cell's loss tolerance."""
    state: str
    """The control's own state check: torch's save and load, compared bit for bit."""
    torch_version: str = torch.__version__

    @property
    def blames_torch(self) -> bool:
        """The control drifts past the tolerance, by at least :data:`CONTROL_SHARE` of the cell's drift."""
        return self.drift > self.rtol and self.drift >= CONTROL_SHARE * self.cell_drift

    @property
    def summary(self) -> str:
        verdict = ("drifts as much" if self.blames_torch
                   else "within rtol" if self.drift <= self.rtol else "drifts less")
        return (f"torch-only control (torch {self.torch_version}, no ckptkit): rel diff {self.drift:.1e} "
                f"against the cell's {self.cell_drift:.1e}, {verdict}")

    def to_json(self) -> dict:
        return {"cell_drift": self.cell_drift, "drift": self.drift, "own_drift": self.own_drift, "rtol": self.rtol,
                "state": self.state, "torch": self.torch_version, "blames_torch": self.blames_torch}

    def detail(self) -> str:
        """The control's figures in full, for a cell's detail."""
        return (f"torch-only control: rel diff {self.drift:.3g} from the cell's uninterrupted run, "
                f"{self.own_drift:.3g} from its own; its state after torch's load: {self.state}")

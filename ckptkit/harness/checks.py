"""What a cell checks: state after loading equals the state before saving, bit for bit; and training
goes on with the losses the uninterrupted run had, within a tolerance this module states and explains.

The state check is exact at any world size: ckptkit moves bytes, and torch's loaders place them without
arithmetic. The losses after resuming cannot be: every step all-reduces (FSDP: reduce-scatters) gradients
over a different number of ranks, so the floating-point sums are taken in another order and round
differently, and AdamW carries the difference forward. Some cells still give bit-identical losses; the
report says so when they do.

Tolerances, from the full CPU matrix (3 resumed steps, world sizes 1-4, torch 2.13; run 2026-11-22):
- fp32 on both sides: relative differences up to 1.3e-7, so ``FP32_RTOL = 1e-5`` (a 75x margin).
- Low precision on either side (the forward rounds to 8 or 11 significant bits, and a cell may resume in
  another precision than it saved in), ``BF16_RTOL = 5e-4``: FSDP2 ``MixedPrecisionPolicy(param_dtype=
  bfloat16)`` up to 5.8e-5; FSDP1 ``MixedPrecision(param_dtype=bfloat16)`` (fp32 reduction) up to 6.2e-5,
  with ``float16`` up to 7.7e-6.
What the loss check is for: the state check cannot see that loaded state took effect. Measured on this
model, resuming with a fresh AdamW moves the next losses by 8.6e-3, resetting the step counts (Adam's
bias correction) or zeroing one moment tensor by 1.2e-3; both tolerances catch these. A single small
tensor off by a little (one LayerNorm's second moment doubled: 3e-6) is the state check's to find.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..core.manifest import key_of
from ..core.tree import flatten
from .configs import Cell

__all__ = ["BF16_RTOL", "FP32_RTOL", "LossCheck", "StateCheck", "compare_losses", "compare_states", "loss_rtol"]

FP32_RTOL = 1e-5
BF16_RTOL = 5e-4


def loss_rtol(cell: Cell) -> float:
    return BF16_RTOL if cell.low_precision else FP32_RTOL


def _leaves(state: Any) -> dict[str, Any]:
    return {key_of(p): v for p, v in flatten(state, lambda v: isinstance(v, torch.Tensor))}


_GROUP_PARAMS = re.compile(r"optim\.param_groups\.\d+\.params")


def _comparable(key: str, value: Any) -> Any:
    """A non-tensor entry as the load check compares it.

    A group's ``params`` lists parameter names in the order the optimizer holds them, which each wrapper
    decides (FSDP1 puts a unit's own parameters before its children's): the names are what a checkpoint
    carries, so they compare as a set. torch's full-state-dict loader turns tuples (AdamW's ``betas``) into
    lists; ckptkit's own fidelity to container types is ``verify``'s to check, on the files.
    """
    if _GROUP_PARAMS.fullmatch(key) and isinstance(value, list):
        return sorted(value)
    if isinstance(value, (tuple, list)):
        return [_comparable("", v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable("", v) for k, v in value.items()}
    return value


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    # Bits, not values: NaN payloads and -0.0 count, and nothing is "close enough".
    if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        return None
    if a.is_floating_point():
        return f"bits differ (max abs difference {(a.double() - b.double()).abs().max().item():.3g})"
    return "bits differ"


@dataclass(frozen=True)
class StateCheck:
    tensors: int
    """Tensors compared."""
    problems: tuple[str, ...]
    """Every difference, key by key."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def summary(self) -> str:
        if self.ok:
            return f"{self.tensors} tensors bit-exact"
        return f"{len(self.problems)} differences after load, first {self.problems[0]}"


def compare_states(expected: dict, actual: dict, *, model_only: bool = False) -> StateCheck:
    """How ``actual`` differs from ``expected``, both ``{"model", "optim", "step"}`` trees.

    ``model_only`` compares the ``model`` part alone (an HF export carries no optimizer state or step).
    """
    if model_only:
        expected, actual = {"model": expected["model"]}, {"model": actual["model"]}
    a, b = _leaves(expected), _leaves(actual)
    problems = [f"{k}: missing after load" for k in a if k not in b]
    problems += [f"{k}: not in the saved state" for k in b if k not in a]
    tensors = 0
    for k in (k for k in a if k in b):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            tensors += 1
            what = _tensor_difference(x, y)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            what = f"{type(x).__name__} vs {type(y).__name__}"
        else:
            what = None if _comparable(k, x) == _comparable(k, y) else f"{x!r:.60} vs {y!r:.60}"
        if what:
            problems.append(f"{k}: {what}")
    return StateCheck(tensors, tuple(problems))


@dataclass(frozen=True)
class LossCheck:
    ok: bool
    summary: str
    """What was found, for the report."""
    worst: float = 0.0
    """The largest relative difference over the steps (infinite where the counts differ or a loss is not
    finite): the figure a torch-only control is weighed against."""


def compare_losses(expected: list[float], actual: list[float], rtol: float, *, first_step: int) -> LossCheck:
    """Losses of the resumed run against the uninterrupted one, step by step."""
    if len(actual) != len(expected):
        return LossCheck(False, f"{len(actual)} resumed losses, expected {len(expected)}", math.inf)
    if actual == expected:
        return LossCheck(True, f"{len(actual)} losses bit-identical")
    rel = [abs(a - e) / max(abs(e), 1e-30) for a, e in zip(actual, expected, strict=True)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    figure = rel[worst] if all(math.isfinite(r) for r in rel) else math.inf
    if figure <= rtol:
        return LossCheck(True, f"{len(actual)} losses within rtol {rtol:g} (max rel diff {figure:.1e})", figure)
    return LossCheck(False, f"loss at step {first_step + worst}: {actual[worst]:.6f}, uninterrupted run "
                            f"{expected[worst]:.6f} (rel diff {rel[worst]:.1e} > rtol {rtol:g})", figure)

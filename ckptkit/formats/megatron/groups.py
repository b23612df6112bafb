"""megatron-core's param groups for optimizer state saved by another framework, from each parameter's
hyperparameters.

megatron-core's ``get_megatron_optimizer`` groups the parameters by its default rule
(``get_standard_config_overrides``): 1-D parameters and biases in a group without weight decay (``wd_mult``
0), every other parameter in the decayed group (``wd_mult`` 1), both at the configured learning rate
(``lr_mult`` 1), neither expert-parallel nor at a decoupled rate. Its ``DistributedOptimizer`` saves the groups
with those four fields, which its load and its ``OptimizerParamScheduler`` read. A source's groups resume
there as they were trained when they follow the same rule: every decayed parameter with the same
hyperparameters, every 1-D parameter and bias with the same ones but no weight decay. Each parameter's own
hyperparameters are what is compared, so the source may have grouped them in any way (one group, per-parameter
groups as torchtitan saves them, megatron-core's own). A parameter that breaks the rule is named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import FormatError

__all__ = ["MEGATRON_FIELDS", "megatron_groups"]

MEGATRON_FIELDS = {"wd_mult": None, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
"""The fields megatron-core's groups carry, with the value its default rule gives (``wd_mult``: by the kind)."""
_APART = frozenset({"params", "param_names", "step", "weight_decay", "wd_mult"})
"""Fields not compared between the two kinds: the decay itself, and what is not a hyperparameter."""


def _first_rates(field: str) -> tuple[bool, str]:
    """Fields in the order a message names the first that differs: the learning rate before the fields that
    follow from it (``initial_lr``, ``max_lr``), then by name."""
    return field != "lr", field


def _checked(kind: list[str], fields: dict[str, dict[str, Any]], what: str) -> dict[str, Any]:
    """The hyperparameters every parameter of ``kind`` shares; the first that differs is named."""
    first = fields[kind[0]]
    for name in kind[1:]:
        odd = sorted((k for k in first.keys() | fields[name].keys() if k not in ("params", "param_names", "step")
                      and first.get(k) != fields[name].get(k)), key=_first_rates)
        if odd:
            raise FormatError(f"convert --to megatron: {name!r} has {odd[0]}={fields[name].get(odd[0])!r} where "
                              f"{kind[0]!r} has {first.get(odd[0])!r}: megatron-core keeps all {what} in one param "
                              "group, with the same hyperparameters")
    return {k: v for k, v in first.items() if k not in ("params", "param_names", "step")}


def megatron_groups(fields: dict[str, dict[str, Any]], names: list[str], undecayed: Callable[[str], bool]
                    ) -> list[dict[str, Any]]:
    """megatron-core's param groups (without ``params``, in its order: the decayed group, then the one of 1-D
    parameters and biases) for parameters ``names`` whose hyperparameters are ``fields``.

    Args:
        fields: Each parameter's hyperparameters, by its megatron-core name (``lr``, ``weight_decay`` ...).
        names: The parameters, in megatron-core's order.
        undecayed: Whether megatron-core's rule puts a parameter in the group without weight decay.

    Returns:
        The groups' fields, each with ``wd_mult``, ``lr_mult``, ``is_expert_parallel`` and ``is_decoupled_lr``.

    Raises:
        FormatError: a parameter without hyperparameters, or one whose grouping megatron-core's rule cannot
            express (named).
    """
    lacking = [n for n in names if n not in fields]
    if lacking:
        raise FormatError(f"convert --to megatron: no param group holds {lacking[0]!r}; megatron-core's optimizer "
                          "takes every parameter")
    kinds = ([n for n in names if not undecayed(n)], [n for n in names if undecayed(n)])
    groups = [_checked(kind, fields, what) for kind, what in zip(kinds, ("decayed parameters", "1-D parameters "
                                                                        "and biases"), strict=True) if kind]
    if all(kinds):
        decayed, plain = groups
        odd = sorted((k for k in decayed.keys() | plain.keys() if k not in _APART and decayed.get(k) != plain.get(k)),
                     key=_first_rates)
        if odd:
            raise FormatError(f"convert --to megatron: {kinds[1][0]!r} has {odd[0]}={plain.get(odd[0])!r} where "
                              f"{kinds[0][0]!r} has {decayed.get(odd[0])!r}: megatron-core's two param groups differ "
                              "in weight decay alone")
        if plain.get("weight_decay", 0.0) != 0.0 and plain.get("weight_decay") != 0:
            raise FormatError(f"convert --to megatron: {kinds[1][0]!r} (a 1-D parameter or bias) trained with "
                              f"weight_decay={plain['weight_decay']!r}: megatron-core decays no 1-D parameter or bias "
                              "(wd_mult 0), so the run cannot go on there as it was trained")
    out = []
    for group, kind in zip(groups, [k for k in kinds if k], strict=True):
        mults = {**MEGATRON_FIELDS, "wd_mult": 0.0 if undecayed(kind[0]) else 1.0}
        odd = sorted(k for k, v in mults.items() if k in group and group[k] != v)
        if odd:
            raise FormatError(f"convert --to megatron: {kind[0]!r} is in a group with {odd[0]}={group[odd[0]]!r}; "
                              f"megatron-core's default grouping, which its load rebuilds, has {mults[odd[0]]!r}")
        out.append({**group, **mults})
    return out

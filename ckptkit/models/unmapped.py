"""Families a framework ships that ckptkit does not map, refused by name (:data:`ckptkit.models.registry.UNMAPPED`).

Under ``--preset auto``, a checkpoint whose config names such a family (``model_type``, or diffusers'
``_class_name``) or whose keys are that family's own names stops with one line saying so, rather than going
into an HF folder under names its consumer does not know. ``--preset none`` keeps the names, explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UsageError
from .matching import pattern
from .registry import UNMAPPED

__all__ = ["refuse_unmapped"]


def refuse_unmapped(keys: Sequence[str], config: dict | None, source: str = "config.json") -> None:
    """Refuses a checkpoint of a family that ckptkit names and does not map.

    Args:
        keys: the model's tensor names.
        config: the model's ``config.json``, or None.
        source: where the config came from, for the message.

    Raises:
        UsageError: the config or the keys name such a family.
    """
    named = [config.get(field) for field in ("model_type", "_class_name")] if config else []
    for u in UNMAPPED:
        by_config = next((n for n in named if isinstance(n, str) and n in u.model_types), None)
        patterns = [pattern(k) for k in u.keys]
        by_key = next((k for k in keys if any(p.fullmatch(k) for p in patterns)), None)
        if by_config or by_key:
            found = f"{source} names {by_config!r}" if by_config else f"the keys are its names ({by_key!r})"
            raise UsageError(f"{u.family} is not mapped: {found}; {u.why}. Pass --preset none to keep the "
                             "checkpoint's own names")

"""Nested state dicts to flat ``(path, leaf)`` lists and back, with DCP's rules, so keys match torch's own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

from .manifest import Path_

__all__ = ["flatten", "unflatten"]


def _is_terminal_list(value: list, is_tensor: Callable[[Any], bool]) -> bool:
    # DCP descends into a list only when it holds containers or tensors (``_traverse._is_terminal``).
    return not any(isinstance(v, (Mapping, list)) or is_tensor(v) for v in value)


def flatten(tree: Any, is_tensor: Callable[[Any], bool], prefix: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Leaves of ``tree`` with their paths. Empty containers are leaves, so round trips keep them."""
    if isinstance(tree, Mapping) and tree:
        for k, v in tree.items():
            yield from flatten(v, is_tensor, (*prefix, k))
    elif isinstance(tree, list) and tree and not _is_terminal_list(tree, is_tensor):
        for i, v in enumerate(tree):
            yield from flatten(v, is_tensor, (*prefix, i))
    else:
        yield prefix, tree


def unflatten(items: list[tuple[Path_, Any]]) -> Any:
    """Rebuild nesting: ``str`` path elements make dicts, ``int`` ones make lists."""
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    root: dict = {}
    for path, value in items:
        node: Any = root
        for here, nxt in zip(path, path[1:]):
            child = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= here:
                    node.append(None)
                if node[here] is None:
                    node[here] = child
                node = node[here]
            else:
                node = node.setdefault(here, child)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return root

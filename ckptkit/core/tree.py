"""Nested state dicts to flat ``(path, leaf)`` lists and back, with DCP's rules, so keys match torch's own."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .manifest import Path_

__all__ = ["ListIndex", "dcp_path", "flatten", "from_dcp_path", "unflatten"]


class ListIndex(int):
    """A list position in a path. Plain ``int`` path elements are dict keys (``optimizer.state`` is keyed by
    int), so the two must stay apart for a round trip to rebuild dicts as dicts and lists as lists."""


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
            yield from flatten(v, is_tensor, (*prefix, ListIndex(i)))
    else:
        yield prefix, tree


def unflatten(items: list[tuple[Path_, Any]]) -> Any:
    """Rebuild nesting: :class:`ListIndex` path elements make lists, any other key makes a dict."""
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    root = _container(items[0][0][0]) if items else {}
    for path, value in items:
        node = root
        for here, nxt in itertools.pairwise(path):
            node = _slot(node, here, _container(nxt))
        _slot(node, path[-1], value, replace=True)
    return root


def _container(key: Any) -> list[Any] | dict[Any, Any]:
    """The empty container that ``key`` indexes."""
    return [] if isinstance(key, ListIndex) else {}


def _slot(node: Any, key: Any, value: Any, replace: bool = False) -> Any:
    """``node[key]``, set to ``value`` first if the slot is empty (or always, with ``replace``)."""
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None or replace:
            node[key] = value
        return node[key]
    if key not in node or replace:
        node[key] = value
    return node[key]


def dcp_path(path: Path_) -> tuple:
    """The path as DCP's ``planner_data`` spells it: dict keys as ``str``, list positions as ``int``."""
    return tuple(int(p) if isinstance(p, ListIndex) else str(p) for p in path)


def from_dcp_path(path: tuple) -> Path_:
    """DCP stringifies dict keys, so an ``int`` in its ``planner_data`` is always a list position."""
    return tuple(ListIndex(p) if isinstance(p, int) else p for p in path)

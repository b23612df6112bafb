"""Boxes of a tensor as plain arithmetic: row-major strides, the elements a strided box spans, the boxes
that hold a flattened range, and the ``Shard(0)`` chunks ``torch.chunk`` gives each rank."""

from __future__ import annotations

import math

__all__ = ["extent", "overlapping", "range_boxes", "row_major", "shard0_boxes"]


def row_major(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides as torch gives them: a zero dimension counts as one, so ``(3, 0, 2)`` has ``(2, 2, 1)``."""
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def extent(sizes: tuple[int, ...], strides: tuple[int, ...] | None) -> int:
    if math.prod(sizes) == 0:
        return 0
    if strides is None:
        return math.prod(sizes)
    return 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides, strict=True))


Box = tuple[tuple[int, ...], tuple[int, ...]]


def _meet(a: Box, b: Box) -> bool:
    return all(max(a_lo, b_lo) < min(a_lo + a_size, b_lo + b_size)
               for a_lo, a_size, b_lo, b_size in zip(a[0], a[1], b[0], b[1], strict=True))


def _rows_in_order(boxes: list[Box]) -> bool:
    """Whether the boxes share their extent past dim 0 and follow each other along it (a ``Shard(0)`` split
    in rank order, what nearly every checkpoint holds): then none overlap, seen in one pass."""
    first_offsets, first_sizes = boxes[0]
    rest, end = (first_offsets[1:], first_sizes[1:]), 0
    for offsets, sizes in boxes:
        if offsets[0] < end or (offsets[1:], sizes[1:]) != rest:
            return False
        end = offsets[0] + sizes[0]
    return True


def overlapping(boxes: list[Box]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of the non-empty boxes that share an element, in order.

    Boxes with the same extent past dim 0 (a ``Shard(0)`` split; one column of a 2-D grid) overlap only where
    their dim-0 ranges do: a sweep along dim 0 finds those in ``n log n``. Only boxes of different extents
    whose extents past dim 0 meet are compared pairwise.
    """
    if not boxes or not boxes[0][0]:
        return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes))]  # 0-d boxes all meet
    if _rows_in_order(boxes):
        return []
    columns: dict[Box, list[int]] = {}
    for i, (offsets, sizes) in enumerate(boxes):
        columns.setdefault((offsets[1:], sizes[1:]), []).append(i)
    pairs = []
    for members in columns.values():
        active: list[tuple[int, int]] = []  # (end along dim 0, index) of boxes the sweep is inside
        for i in sorted(members, key=lambda i: boxes[i][0][0]):
            start = boxes[i][0][0]
            active = [(end, j) for end, j in active if end > start]
            pairs += [(min(i, j), max(i, j)) for _, j in active]
            active.append((start + boxes[i][1][0], i))
    keys = list(columns)
    for a in range(len(keys)):
        for b in range(a + 1, len(keys)):
            if _meet(keys[a], keys[b]):
                pairs += [(min(i, j), max(i, j)) for i in columns[keys[a]] for j in columns[keys[b]]
                          if _meet(boxes[i], boxes[j])]
    return sorted(pairs)


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(offsets, sizes)`` of a tensor of ``shape`` that hold its flattened elements ``[start, stop)``.

    Row-major order makes each box one contiguous run of the range, and the boxes follow each other in it. A
    range of whole rows is one box; otherwise it splits into a partial first row, the whole rows between and
    a partial last row, and each partial row splits the same way one dimension down: at most
    ``2 * len(shape) - 1`` boxes.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    head, tail = start - first * inner, stop - last * inner  # offset into the first row; length of the last
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)

    def rows(a: int, b: int) -> list:
        return [((a, *zeros), (b - a, *rest))] if b > a else []

    def part(row: int, a: int, b: int) -> list:
        return [((row, *o), (1, *s)) for o, s in range_boxes(rest, a, b)]

    if first == last:
        return rows(first, first + 1) if head == 0 and tail == inner else part(first, head, tail)
    out = part(first, head, inner) if head else []
    out += rows(first + (1 if head else 0), last + (1 if tail == inner else 0))
    return out + (part(last, 0, tail) if tail != inner else [])


def shard0_boxes(shape: tuple[int, ...], n: int) -> list[tuple[int, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """(rank, (offsets, sizes)) of each non-empty ``Shard(0)`` chunk, with ``torch.chunk`` sizes."""
    if not shape or shape[0] == 0 or math.prod(shape) == 0:
        return [(0, ((0,) * len(shape), shape))]  # scalars and empty tensors live whole on rank 0
    step = -(-shape[0] // n)
    zeros, rest = (0,) * (len(shape) - 1), shape[1:]
    return [(rank, ((lo, *zeros), (min(shape[0], lo + step) - lo, *rest)))
            for rank, lo in enumerate(range(0, shape[0], step))]

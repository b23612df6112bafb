"""ckptkit.core.boxes: the arithmetic of tensor boxes, as tables."""

from __future__ import annotations

import pytest

from ckptkit.core.boxes import range_boxes


@pytest.mark.parametrize("shape, start, stop, boxes", [
    ((3, 4), 0, 12, [((0, 0), (3, 4))]),                                          # everything: one box
    ((3, 4), 4, 12, [((1, 0), (2, 4))]),                                          # whole rows
    ((3, 4), 1, 3, [((0, 1), (1, 2))]),                                           # inside one row
    ((3, 4), 2, 11, [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]),      # partial, whole, partial
    ((3, 4), 6, 12, [((1, 2), (1, 2)), ((2, 0), (1, 4))]),                        # partial first row, then whole
    ((2, 2, 3), 2, 11, [((0, 0, 2), (1, 1, 1)), ((0, 1, 0), (1, 1, 3)),          # 3-D: at most 2*3-1 boxes
                        ((1, 0, 0), (1, 1, 3)), ((1, 1, 0), (1, 1, 2))]),
    ((7,), 3, 5, [((3,), (2,))]),                                                 # 1-D: always one box
    ((), 0, 1, [((), ())]),                                                       # a scalar
    ((3, 4), 5, 5, []),                                                           # nothing
])
def test_range_boxes_split_a_flat_range_into_row_major_boxes(shape, start, stop, boxes):
    assert range_boxes(shape, start, stop) == boxes

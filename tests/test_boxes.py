"""ckptkit.core.boxes: the arithmetic of tensor boxes, as tables, with torch as the oracle."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from ckptkit.core.boxes import extent, overlapping, range_boxes, row_major, shard0_boxes


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


@pytest.mark.parametrize("shape", [(3, 4), (2, 2, 3), (7,), (1, 1, 3), (2, 1, 2, 2)])
def test_range_boxes_hold_exactly_the_range_in_order(shape):
    # Every range of every small shape: the boxes, read in order from torch's row-major arange, are the range.
    flat = torch.arange(math.prod(shape))
    tensor = flat.reshape(shape)
    for start in range(flat.numel() + 1):
        for stop in range(start, flat.numel() + 1):
            boxes = range_boxes(shape, start, stop)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            got = [tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1)
                   for offsets, sizes in boxes]
            assert torch.equal(torch.cat(got) if got else flat[:0], flat[start:stop]), (shape, start, stop)


@pytest.mark.parametrize("shape", [
    (),            # a scalar
    (5,),          # 1-D
    (4, 3),        # 2-D
    (2, 3, 5),     # 3-D
    (3, 0, 2),     # a zero dimension
])
def test_row_major_is_torch_contiguous_stride(shape):
    assert row_major(shape) == torch.empty(shape).stride()


@pytest.mark.parametrize("sizes, strides", [
    ((2, 3), None),        # row-major: every element
    ((2, 3), (3, 1)),      # row-major, spelled out
    ((3, 2), (1, 3)),      # a transposed 2x3
    ((3, 2), (4, 1)),      # x[:, :2] of a 3x4: rows 4 apart
    ((2, 2), (6, 2)),      # x[::2, ::2] of a 3x3... rows 6 apart, columns 2 apart
    ((4, 3), (0, 1)),      # expanded along dim 0: one row repeated
    ((2, 0), (1, 1)),      # no elements
    ((), ()),              # a scalar
])
def test_extent_is_the_storage_a_strided_tensor_needs(sizes, strides):
    # torch allocates exactly the elements a strided layout reaches.
    t = torch.empty_strided(sizes, strides if strides is not None else row_major(sizes), dtype=torch.int8)
    assert extent(sizes, strides) == t.untyped_storage().nbytes()


@pytest.mark.parametrize("shape", [(5, 3), (7, 2), (2, 5), (1,), (11, 4), (3,), (4, 0, 2), (0, 3), ()])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shard0_boxes_are_torch_chunk_rows(shape, n):
    boxes = shard0_boxes(shape, n)
    if math.prod(shape) == 0 or not shape:
        assert boxes == [(0, ((0,) * len(shape), shape))]  # scalars and empty tensors live whole on rank 0
        return
    chunks = torch.chunk(torch.empty(shape), n)  # FSDP2's Shard(0): the last ranks may hold fewer rows, or none
    starts = [sum(c.shape[0] for c in chunks[:r]) for r in range(len(chunks))]
    assert boxes == [(r, ((starts[r], *[0] * (len(shape) - 1)), tuple(c.shape))) for r, c in enumerate(chunks)]


@pytest.mark.parametrize("seed", range(20))
def test_overlapping_finds_the_pairs_that_share_an_element(seed):
    # Against torch: mark each box in a count tensor; two boxes overlap where both marked one element.
    rng = random.Random(seed)
    shape = (rng.randint(1, 9), rng.randint(1, 4))
    columns = [(0, shape[1])] if seed % 2 else [(0, 2), (1, shape[1] - 1), (2, 1)]  # Shard(0), or a 2-D grid
    boxes = []
    for _ in range(rng.randint(1, 8)):
        lo, hi = sorted(rng.sample(range(shape[0] + 1), 2))
        c_lo, c_size = rng.choice(columns)
        box = ((lo, c_lo), (hi - lo, min(c_size, shape[1] - c_lo)))
        if math.prod(box[1]) > 0:  # the function's contract: non-empty boxes
            boxes.append(box)
    masks = []
    for (o, s) in boxes:
        m = torch.zeros(shape, dtype=torch.bool)
        m[o[0]:o[0] + s[0], o[1]:o[1] + s[1]] = True
        masks.append(m)
    want = [(i, j) for i, j in itertools.combinations(range(len(boxes)), 2) if (masks[i] & masks[j]).any()]
    assert overlapping(boxes) == want

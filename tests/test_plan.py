"""ckptkit.core.plan, pure planning: manifests of hand-built chunks in, byte-range copies out. No files are opened.

Byte offsets are spelled out in comments as ``file[start:end] -> dst[start:end]``; every tensor here is
float32 (4 bytes an element) unless a test says otherwise.
"""

from __future__ import annotations

import sys

import pytest

from ckptkit import Chunk, IncompleteCheckpointError, Span, TensorEntry
from ckptkit.core.boxes import range_boxes
from ckptkit.core.dtypes import by_name
from ckptkit.core.plan import Copy, Region, Strided, plan_copies, plan_strided, row_blocks

F32 = by_name("float32")
BF16 = by_name("bfloat16")


def chunk(offsets, sizes, file, offset=0, strides=None, length=None):
    """A chunk whose bytes start at ``offset`` in ``file``; ``length`` defaults to exactly what it needs."""
    n = 1
    for s in sizes:
        n *= s
    return Chunk(tuple(offsets), tuple(sizes), Span(file, offset, n * 4 if length is None else length),
                 None if strides is None else tuple(strides))


def entry(shape, *chunks, key="w", dtype=F32):
    return TensorEntry(key, (key,), dtype, tuple(shape), tuple(chunks))


def cp(file, offset, length, dst):
    return Copy(Span(file, offset, length), dst)


# ------------------------------------------------------------------------------------------ plan_copies


def test_plan_copies_shard0_chunks_one_copy_each():
    # A 4x3 tensor in two Shard(0) chunks of 2 rows (24 bytes each), rank 0's at byte 100 of its file.
    w = entry((4, 3), chunk((0, 0), (2, 3), "r0", 100), chunk((2, 0), (2, 3), "r1", 0))
    assert plan_copies(Region.whole(w)) == (
        cp("r0", 100, 24, 0),   # r0[100:124] -> dst[0:24]   rows 0-1
        cp("r1", 0, 24, 24),    # r1[0:24]    -> dst[24:48]  rows 2-3
    )


def test_plan_copies_row_sub_box_spans_two_chunks():
    w = entry((4, 3), chunk((0, 0), (2, 3), "r0", 100), chunk((2, 0), (2, 3), "r1", 0))
    region = Region(w, (1, 0), (2, 3))  # rows 1-2
    assert plan_copies(region) == (
        cp("r0", 112, 12, 0),   # r0[112:124] -> dst[0:12]   row 1 (second row of rank 0's chunk)
        cp("r1", 0, 12, 12),    # r1[0:12]    -> dst[12:24]  row 2 (first row of rank 1's chunk)
    )


def test_plan_copies_shard1_chunks_one_copy_per_row():
    # A 2x4 tensor split by columns (Shard(1)): chunk a holds columns 0-1, chunk b columns 2-3, each 2x2
    # row-major (8 bytes a row). The output's rows interleave them.
    w = entry((2, 4), chunk((0, 0), (2, 2), "a"), chunk((0, 2), (2, 2), "b"))
    assert plan_copies(Region.whole(w)) == (
        cp("a", 0, 8, 0),       # a[0:8]   -> dst[0:8]    row 0, columns 0-1
        cp("b", 0, 8, 8),       # b[0:8]   -> dst[8:16]   row 0, columns 2-3
        cp("a", 8, 8, 16),      # a[8:16]  -> dst[16:24]  row 1, columns 0-1
        cp("b", 8, 8, 24),      # b[8:16]  -> dst[24:32]  row 1, columns 2-3
    )


def test_plan_strided_shard1_chunks_one_strided_copy_each():
    # The 2x4 tensor above: each column chunk's rows are one strided copy, 8 bytes a row, 8 apart in the
    # chunk and 16 apart in the output.
    w = entry((2, 4), chunk((0, 0), (2, 2), "a"), chunk((0, 2), (2, 2), "b"))
    assert plan_strided(Region.whole(w)) == (
        Strided(Span("a", 0, 8), 0, rows=2, src_step=8, dst_step=16),   # a[0:8], a[8:16] -> dst[0:8], [16:24]
        Strided(Span("b", 0, 8), 8, rows=2, src_step=8, dst_step=16),   # b[0:8], b[8:16] -> dst[8:16], [24:32]
    )


def test_plan_strided_3d_column_chunk_one_strided_copy_per_index_before():
    # A 2x3x2 tensor split along its last dim: chunk a holds [:, :, 0:1] (2x3x1, 4 bytes a run). Dim 1 is
    # the stride (4 bytes apart in the chunk, 8 in the output); dim 0 is walked, one copy per index.
    w = entry((2, 3, 2), chunk((0, 0, 0), (2, 3, 1), "a"), chunk((0, 0, 1), (2, 3, 1), "b"))
    assert plan_strided(Region.whole(w)) == (
        Strided(Span("a", 0, 4), 0, rows=3, src_step=4, dst_step=8),     # a[0:12]  -> dst 0, 8, 16    i = 0
        Strided(Span("b", 0, 4), 4, rows=3, src_step=4, dst_step=8),     # b[0:12]  -> dst 4, 12, 20   i = 0
        Strided(Span("a", 12, 4), 24, rows=3, src_step=4, dst_step=8),   # a[12:24] -> dst 24, 32, 40  i = 1
        Strided(Span("b", 12, 4), 28, rows=3, src_step=4, dst_step=8),   # b[12:24] -> dst 28, 36, 44  i = 1
    )
    # The box that is chunk a: one plain copy.
    assert plan_strided(Region(w, (0, 0, 0), (2, 3, 1))) == (Strided(Span("a", 0, 24), 0),)


def test_plan_strided_whole_rows_in_order_join_what_follows_on():
    # Shard(0) chunks in order, the first two back to back in one file: one copy for rows 0-3, one for 4-5.
    w = entry((6, 2), chunk((0, 0), (2, 2), "f", 0), chunk((2, 0), (2, 2), "f", 16), chunk((4, 0), (2, 2), "g"))
    assert plan_strided(Region.whole(w)) == (Strided(Span("f", 0, 32), 0), Strided(Span("g", 0, 16), 32))


@pytest.mark.parametrize("w, region", [
    # chunks out of order along dim 0, with a replica
    (entry((4, 3), chunk((2, 0), (2, 3), "r1"), chunk((0, 0), (2, 3), "r0"), chunk((2, 0), (2, 3), "rep")), None),
    # odd column chunks (2 and 3 of 5) of a 7-row tensor, a sub-box across both
    (entry((7, 5), chunk((0, 0), (7, 2), "a"), chunk((0, 2), (7, 3), "b")), ((1, 1), (5, 3))),
    # a padded chunk (rows 4 apart) beside a row-major one
    (entry((3, 4), chunk((0, 0), (3, 2), "p", strides=(4, 1), length=40), chunk((0, 2), (3, 2), "q")), None),
    # a transposed source: one element a run
    (entry((2, 3), chunk((0, 0), (2, 3), "t", strides=(1, 2))), None),
    # a 3-D tensor sharded along dims 1 and 2
    (entry((2, 4, 3), *(chunk((0, i, j), (2, 2, c), f"c{i}{j}") for i in (0, 2) for j, c in ((0, 1), (1, 2)))),
     ((1, 1, 0), (1, 3, 3))),
    # a row gather over column chunks
    (TensorEntry("w", ("w",), F32, (3, 4), (chunk((0, 0), (3, 2), "a"), chunk((0, 2), (3, 2), "b")),
                 rows=(2, 0, 1)), None),
])
def test_plan_strided_expands_to_plan_copies(w, region):
    region = Region(w, *region) if region else Region.whole(w)
    expanded = sorted((c for s in plan_strided(region) for c in s.copies()), key=lambda c: c.dst)
    per_byte = {c.dst + i: (c.src.file, c.src.offset + i) for c in expanded for i in range(c.src.length)}
    want = {c.dst + i: (c.src.file, c.src.offset + i) for c in plan_copies(region) for i in range(c.src.length)}
    assert per_byte == want and len(per_byte) == region.nbytes


def test_plan_strided_missing_chunk_raises():
    w = entry((4, 3), chunk((0, 0), (2, 3), "r0"))
    with pytest.raises(IncompleteCheckpointError, match=r"tensor 'w': chunks supply 24 of the 48 bytes"):
        plan_strided(Region.whole(w))


def test_plan_copies_column_box_of_one_chunk():
    # Columns 1-2 of a 3x4 row-major tensor (16 bytes a row): 8 bytes from the middle of each row.
    w = entry((3, 4), chunk((0, 0), (3, 4), "f", 64))
    assert plan_copies(Region(w, (0, 1), (3, 2))) == (
        cp("f", 68, 8, 0),      # f[68:76]  -> dst[0:8]    row 0 starts at 64, column 1 at +4
        cp("f", 84, 8, 8),      # f[84:92]  -> dst[8:16]   row 1 starts at 80
        cp("f", 100, 8, 16),    # f[100:108] -> dst[16:24] row 2 starts at 96
    )


@pytest.mark.parametrize("second_offset, expected", [
    # rank 1's rows follow rank 0's in the same file: one 48-byte copy
    (24, (cp("f", 0, 48, 0),)),
    # a 8-byte gap between them: two copies
    (32, (cp("f", 0, 24, 0), cp("f", 32, 24, 24))),
])
def test_plan_copies_coalesces_adjacent_ranges(second_offset, expected):
    w = entry((4, 3), chunk((0, 0), (2, 3), "f", 0), chunk((2, 0), (2, 3), "f", second_offset))
    assert plan_copies(Region.whole(w)) == expected


def test_plan_copies_does_not_coalesce_across_files():
    w = entry((4, 3), chunk((0, 0), (2, 3), "f", 0), chunk((2, 0), (2, 3), "g", 24))
    assert plan_copies(Region.whole(w)) == (cp("f", 0, 24, 0), cp("g", 24, 24, 24))


def test_plan_copies_does_not_coalesce_pieces_adjacent_only_in_the_output():
    # Both column halves of a 2x4 tensor in one file: columns 0-1 at bytes 0-15, columns 2-3 at 16-31.
    # Consecutive output pieces are never consecutive in the file, so nothing merges.
    w = entry((2, 4), chunk((0, 0), (2, 2), "f", 0), chunk((0, 2), (2, 2), "f", 16))
    assert plan_copies(Region.whole(w)) == (
        cp("f", 0, 8, 0),       # f[0:8]   -> dst[0:8]
        cp("f", 16, 8, 8),      # f[16:24] -> dst[8:16]
        cp("f", 8, 8, 16),      # f[8:16]  -> dst[16:24]
        cp("f", 24, 8, 24),     # f[24:32] -> dst[24:32]
    )


def test_plan_copies_transposed_source_reads_element_by_element():
    # torch.save(x.t()) of a row-major 3x2 x: the 2x3 tensor's element (i, j) is at i*1 + j*2 elements.
    w = entry((2, 3), chunk((0, 0), (2, 3), "t", 0, strides=(1, 2)))
    assert plan_copies(Region.whole(w)) == (
        cp("t", 0, 4, 0),       # (0,0) element 0
        cp("t", 8, 4, 4),       # (0,1) element 2
        cp("t", 16, 4, 8),      # (0,2) element 4
        cp("t", 4, 4, 12),      # (1,0) element 1
        cp("t", 12, 4, 16),     # (1,1) element 3
        cp("t", 20, 4, 20),     # (1,2) element 5
    )


def test_plan_copies_padded_row_stride_copies_row_by_row():
    # x[:, :2] of a 3x4 tensor: rows of 2 elements 4 apart, so each row is its own 8-byte run.
    w = entry((3, 2), chunk((0, 0), (3, 2), "p", 0, strides=(4, 1), length=40))
    assert plan_copies(Region.whole(w)) == (cp("p", 0, 8, 0), cp("p", 16, 8, 8), cp("p", 32, 8, 16))


def test_plan_copies_replicas_are_read_once():
    # HSDP without de-duplication: the same box saved by two replicas; the first one serves.
    w = entry((2, 3), chunk((0, 0), (2, 3), "rep0"), chunk((0, 0), (2, 3), "rep1"))
    assert plan_copies(Region.whole(w)) == (cp("rep0", 0, 24, 0),)


def test_plan_copies_scalar_and_empty():
    scalar = entry((), Chunk((), (), Span("s", 8, 4)))
    assert plan_copies(Region.whole(scalar)) == (cp("s", 8, 4, 0),)
    empty = entry((0, 3), Chunk((0, 0), (0, 3), Span("e", 0, 0)))
    assert plan_copies(Region.whole(empty)) == ()


def test_plan_copies_uses_itemsize_of_dtype():
    # bf16, 2 bytes an element: rows of a 3x3 tensor are 6 bytes; rows 1-2 start 6 bytes in.
    w = entry((3, 3), chunk((0, 0), (3, 3), "b", 0, length=18), dtype=BF16)
    assert plan_copies(Region(w, (1, 0), (2, 3))) == (cp("b", 6, 12, 0),)


def test_plan_copies_missing_chunk_raises():
    # Rank 1's rows are missing: only 24 of the 48 bytes can be found.
    w = entry((4, 3), chunk((0, 0), (2, 3), "r0"), key="layers.0.weight")
    with pytest.raises(IncompleteCheckpointError,
                       match=r"'layers\.0\.weight': chunks supply 24 of the 48 bytes .*rank file or chunk is missing"):
        plan_copies(Region.whole(w))


def test_plan_copies_sub_box_inside_present_chunk_needs_no_other_chunk():
    # Rows 0-1 are all there even though rows 2-3 are missing: a box may be planned from what exists.
    w = entry((4, 3), chunk((0, 0), (2, 3), "r0"))
    assert plan_copies(Region(w, (0, 0), (2, 3))) == (cp("r0", 0, 24, 0),)


def test_plan_copies_joins_a_parameter_split_mid_row_across_ranks():
    # A 3x4 parameter whose flat elements 0-5 lie in rank file r0 from byte 100, elements 6-11 in r1 from 0:
    # r0 holds row 0 and half of row 1, r1 the other half and row 2.
    chunks, at = [], {"r0": 100, "r1": 0}
    for file, (a, b) in (("r0", (0, 6)), ("r1", (6, 12))):
        for offsets, sizes in range_boxes((3, 4), a, b):
            n = sizes[0] * sizes[1] * 4
            chunks.append(Chunk(offsets, sizes, Span(file, at[file], n)))
            at[file] += n
    w = TensorEntry("w", ("w",), F32, (3, 4), tuple(chunks))
    w.validate()
    assert plan_copies(Region.whole(w)) == (
        Copy(Span("r0", 100, 24), 0),   # r0[100:124] -> dst[0:24]   row 0 and row 1 columns 0-1
        Copy(Span("r1", 0, 24), 24),    # r1[0:24]    -> dst[24:48]  row 1 columns 2-3 and row 2
    )
    assert plan_copies(Region(w, (1, 0), (1, 4))) == (
        Copy(Span("r0", 116, 8), 0),    # r0[116:124] -> dst[0:8]    row 1 columns 0-1
        Copy(Span("r1", 0, 8), 8),      # r1[0:8]     -> dst[8:16]   row 1 columns 2-3
    )


# ------------------------------------------------------------------------------------------ validate


def test_tensor_entry_validate_accepts_tiling_and_replicas():
    w = entry((4, 3), chunk((0, 0), (2, 3), "r0"), chunk((2, 0), (2, 3), "r1"), chunk((2, 0), (2, 3), "r1b"))
    assert w.validate() is None  # replicas of the same box count once


@pytest.mark.parametrize("chunks, message", [
    # rows 0-2 and rows 2-3 share row 2
    ((chunk((0, 0), (3, 3), "a"), chunk((2, 0), (2, 3), "b")), r"chunks at \[0, 0\] and \[2, 0\] overlap"),
    # a chunk of rows 3-4 in a 4-row tensor
    ((chunk((0, 0), (3, 3), "a"), chunk((3, 0), (2, 3), "b")),
     r"chunk at \[3, 0\] size \[2, 3\] in b exceeds shape \[4, 3\]"),
    # a negative offset
    ((chunk((-1, 0), (1, 3), "a"), chunk((0, 0), (4, 3), "b")), r"exceeds shape"),
    # rows 2-3 are missing
    ((chunk((0, 0), (2, 3), "a"),), r"chunks cover 6 of 12 elements \(a rank file or chunk is missing\)"),
    # the span holds 8 bytes where 24 are needed
    ((chunk((0, 0), (2, 3), "a", length=8), chunk((2, 0), (2, 3), "b")),
     r"chunk at \[0, 0\] in a holds 8 bytes, needs 24"),
    # a 1-D chunk for a 2-D tensor
    ((Chunk((0,), (12,), Span("a", 0, 48)),), r"chunk in a has rank 1, tensor has rank 2"),
])
def test_tensor_entry_validate_names_key_and_problem(chunks, message):
    with pytest.raises(IncompleteCheckpointError, match=r"^tensor 'model\.w': .*" + message):
        entry((4, 3), *chunks, key="model.w").validate()


def test_tensor_entry_validate_strided_chunk_needs_its_extent():
    # A transposed 2x3 view (strides (1, 2)) reaches element 1 + 1*1 + 2*2 = 6 elements = 24 bytes.
    ok = entry((2, 3), chunk((0, 0), (2, 3), "t", strides=(1, 2), length=24))
    assert ok.validate() is None
    short = entry((2, 3), chunk((0, 0), (2, 3), "t", strides=(1, 2), length=20))
    with pytest.raises(IncompleteCheckpointError, match=r"'w': chunk at \[0, 0\] in t holds 20 bytes, needs 24"):
        short.validate()


def test_tensor_entry_validate_lists_every_problem_at_once():
    w = entry((4, 3), chunk((0, 0), (3, 3), "a"), chunk((2, 0), (2, 3), "b"), chunk((5, 0), (1, 3), "c"))
    with pytest.raises(IncompleteCheckpointError, match=r"exceeds shape.*; chunks at \[0, 0\] and \[2, 0\] overlap"):
        w.validate()


# ------------------------------------------------------------------------------------------ row_blocks


def _boxes(blocks):
    return [(b.offsets, b.sizes) for b in blocks]


@pytest.mark.parametrize("shape, region, budget, expected", [
    # 10x3 f32 = 120 bytes, 12 a row; 50 bytes hold 4 rows
    ((10, 3), ((0, 0), (10, 3)), 50, [((0, 0), (4, 3)), ((4, 0), (4, 3)), ((8, 0), (2, 3))]),
    # a budget below one row still moves one row at a time
    ((3, 3), ((0, 0), (3, 3)), 5, [((0, 0), (1, 3)), ((1, 0), (1, 3)), ((2, 0), (1, 3))]),
    # fits: the region itself
    ((10, 3), ((0, 0), (10, 3)), 120, [((0, 0), (10, 3))]),
    # a sub-region keeps its offsets in every dim
    ((10, 4), ((2, 1), (5, 2)), 16, [((2, 1), (2, 2)), ((4, 1), (2, 2)), ((6, 1), (1, 2))]),
    # a 0-d tensor cannot be split
    ((), ((), ()), 1, [((), ())]),
])
def test_row_blocks_split_along_dim0(shape, region, budget, expected):
    w = entry(shape, chunk((0,) * len(shape), shape, "f"))
    blocks = row_blocks(Region(w, *region), budget)
    assert _boxes(blocks) == expected
    assert all(b.nbytes <= budget or (b.sizes and b.sizes[0] == 1) or not b.sizes for b in blocks)


def test_row_blocks_keep_the_cast():
    w = entry((4, 2), chunk((0, 0), (4, 2), "f"))
    blocks = row_blocks(Region.whole(w, cast=BF16), 8)  # bf16 rows are 4 bytes: 2 rows a block
    assert _boxes(blocks) == [((0, 0), (2, 2)), ((2, 0), (2, 2))]
    assert {b.cast for b in blocks} == {BF16}


# ------------------------------------------------------------------------------------------ row gathers


def gathered(shape, rows, *chunks):
    return TensorEntry("w", ("w",), F32, tuple(shape), tuple(chunks), rows=tuple(rows))


def test_plan_copies_row_gather_one_copy_per_run_of_rows():
    # A 4x2 tensor (8 bytes a row) whose rows are source rows 2, 3, 0, 1: two runs of two rows.
    w = gathered((4, 2), (2, 3, 0, 1), chunk((0, 0), (4, 2), "f", 100))
    assert plan_copies(Region.whole(w)) == (
        cp("f", 116, 16, 0),    # f[116:132] -> dst[0:16]   source rows 2-3
        cp("f", 100, 16, 16),   # f[100:116] -> dst[16:32]  source rows 0-1
    )


def test_plan_copies_row_gather_rotary_permutation_of_two_chunks():
    # The rotary q/k order of one head of 4 rows: HF row r is interleaved row (0, 2, 1, 3)[r]. The source is
    # two Shard(0) chunks of 2 rows; each output row is one row of one chunk (4 bytes a row, 1 column).
    w = gathered((4, 1), (0, 2, 1, 3), chunk((0, 0), (2, 1), "r0"), chunk((2, 0), (2, 1), "r1"))
    assert plan_copies(Region.whole(w)) == (
        cp("r0", 0, 4, 0),      # r0[0:4] -> dst[0:4]    source row 0
        cp("r1", 0, 4, 4),      # r1[0:4] -> dst[4:8]    source row 2 (first of r1)
        cp("r0", 4, 4, 8),      # r0[4:8] -> dst[8:12]   source row 1
        cp("r1", 4, 4, 12),     # r1[4:8] -> dst[12:16]  source row 3
    )


def test_plan_copies_row_gather_of_a_sub_box():
    # Rows 1-2, column 1 of a 3x2 gathered tensor (rows = 2, 0, 1): output row 1 is source row 0, row 2 is
    # source row 1, one run; column 1 of a row is 4 bytes at +4.
    w = gathered((3, 2), (2, 0, 1), chunk((0, 0), (3, 2), "f"))
    assert plan_copies(Region(w, (1, 1), (2, 1))) == (
        cp("f", 4, 4, 0),       # f[4:8]   -> dst[0:4]  source row 0, column 1
        cp("f", 12, 4, 4),      # f[12:16] -> dst[4:8]  source row 1, column 1
    )


def test_row_blocks_of_a_gather_keep_it():
    # A cast splits a gathered tensor into row blocks; each block gathers its own rows.
    w = gathered((4, 2), (3, 2, 1, 0), chunk((0, 0), (4, 2), "f"))
    blocks = row_blocks(Region.whole(w, BF16), 2 * 2 * 2)   # two bf16 rows a block
    assert [b.offsets for b in blocks] == [(0, 0), (2, 0)]
    assert [plan_copies(b) for b in blocks] == [
        (cp("f", 24, 8, 0), cp("f", 16, 8, 8)),   # output rows 0-1: source rows 3, 2
        (cp("f", 8, 8, 0), cp("f", 0, 8, 8)),     # output rows 2-3: source rows 1, 0
    ]


def test_row_gather_refuses_what_is_not_a_permutation():
    with pytest.raises(IncompleteCheckpointError, match=r"a row gather must permute the 3 rows of shape \[3, 2\]"):
        gathered((3, 2), (0, 0, 1), chunk((0, 0), (3, 2), "f"))


def test_plan_strided_keeps_its_chunk_index_on_the_entry_and_lets_it_go_with_it():
    # A library process (a training job calling ckptkit.load) must not hold a converted checkpoint's chunks.
    chunks = tuple(Chunk((i, 0), (1, 4), Span("f", 16 * i, 16)) for i in range(64))
    entry = TensorEntry("w", ("w",), by_name("float32"), (64, 4), chunks)
    probe = chunks[0]
    before = sys.getrefcount(probe)
    assert plan_strided(Region(entry, (3, 0), (10, 4))) == (Strided(Span("f", 48, 160), 0),)
    assert entry.by_row is not None
    del entry, chunks
    assert sys.getrefcount(probe) == before - 1  # the tuple's reference went, and nothing else held it

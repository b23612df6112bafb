"""ckptkit.core.reshape and ckptkit.io.compute: tensors made of other tensors' rows (splits, joins, stacks, row
gathers) and computed tensors (transposes, FP8 dequantization), written by the executor and compared with
torch's own slicing, ``torch.stack``/``torch.cat``, ``.T`` and torch's ``QuantizedHuggingFaceStorageReader``
arithmetic."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptkit.codecs.safetensors_header import read_header
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Chunk, TensorEntry
from ckptkit.core.plan import FilePlan, Region
from ckptkit.core.reshape import (
    computed_in,
    dequantized,
    interleaved,
    join_along,
    join_rows,
    materialize_rows,
    reshaped,
    split_along,
    split_rows,
    stack,
    take_rows,
    transposed,
    unstack,
    zeros,
)
from ckptkit.errors import UsageError
from ckptkit.io.storage.local.writer import write_files

G = torch.Generator().manual_seed(0)


def sharded(tmp_path: Path, name: str, t: torch.Tensor, cuts: list[int]) -> TensorEntry:
    """``t`` stored as Shard(0) chunks (rows ``cuts[i]:cuts[i+1]``), one safetensors file each, as one entry."""
    chunks = []
    bounds = [0, *cuts, t.shape[0]]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        path = tmp_path / f"{name}.{i}.safetensors"
        save_file({"x": t[a:b].contiguous()}, path)
        (entry,) = read_header(path)[0]
        chunks.append(Chunk((a, *[0] * (t.dim() - 1)), (b - a, *t.shape[1:]), entry.chunks[0].span))
    return TensorEntry(name, (name,), by_name(str(t.dtype).removeprefix("torch.")), tuple(t.shape), tuple(chunks))


def written(tmp_path: Path, entries: list[TensorEntry], cast: str | None = None, max_memory: int = 64,
            ) -> list[torch.Tensor]:
    """The entries as the executor writes them (one file each, row blocks of ``max_memory``)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    to = by_name(cast) if cast else None
    write_files(tuple(FilePlan(f"{i}.bin", (Region.whole(e, to),)) for i, e in enumerate(entries)), out,
                max_memory=max_memory)
    dtype = getattr(torch, (to or entries[0].dtype).name)
    return [torch.frombuffer(bytearray((out / f"{i}.bin").read_bytes()), dtype=dtype).reshape(e.shape)
            if e.numel else torch.empty(e.shape, dtype=dtype) for i, e in enumerate(entries)]


def test_unstack_splits_stacked_experts_across_chunk_boundaries_with_a_cast(tmp_path):
    w = torch.randn(5, 4, 3, generator=G)
    entry = sharded(tmp_path, "w1_EFD", w, [2, 3])  # expert 2 is a chunk of its own; the others share
    parts = unstack(entry, [f"e{i}" for i in range(5)])
    assert [p.shape for p in parts] == [(4, 3)] * 5
    for got, i in zip(written(tmp_path, parts, cast="bfloat16"), range(5), strict=True):
        assert torch.equal(got, w[i].to(torch.bfloat16))


def test_stack_of_unstacked_is_the_source_bytes(tmp_path):
    w = torch.randn(4, 6, 2, generator=G)
    parts = unstack(sharded(tmp_path, "w", w, [1, 3]), ["a", "b", "c", "d"])
    (got,) = written(tmp_path, [stack("w", parts)], max_memory=1)
    assert torch.equal(got, torch.stack([w[i] for i in range(4)]))


def test_split_rows_into_parts_and_join_them_back(tmp_path):
    w = torch.randn(10, 3, generator=G)
    entry = sharded(tmp_path, "fc1", w, [3, 7])
    gate, up = split_rows(entry, [4, 6], ["gate", "up"])
    joined = join_rows("fc1", [gate, up])
    got = written(tmp_path, [gate, up, joined])
    assert torch.equal(got[0], w[:4]) and torch.equal(got[1], w[4:]) and torch.equal(got[2], w)


def test_split_along_dim_1_under_experts_and_join_back_as_torch_cat(tmp_path):
    # Qwen3.5-MoE's gate_up_proj [experts, 2 x hidden, dim]: gate rows then up rows of each expert
    w = torch.randn(3, 10, 4, generator=G)
    entry = sharded(tmp_path, "gate_up", w, [1, 2])
    gate, up = split_along(entry, [4, 6], ["gate", "up"], 1)
    got = written(tmp_path, [gate, up, join_along("gate_up", [gate, up], 1)])
    assert torch.equal(got[0], w[:, :4]) and torch.equal(got[1], w[:, 4:]) and torch.equal(got[2], w)


def test_reshaped_regroups_whole_rows_and_refuses_a_chunk_holding_part_of_a_row(tmp_path):
    w = torch.randn(6, 12, generator=G)
    conv = reshaped(sharded(tmp_path, "patch", w, [2, 5]), "conv", (3, 2, 2))
    (got,) = written(tmp_path, [conv])
    assert torch.equal(got, w.reshape(6, 3, 2, 2))
    half = dataclasses.replace(conv, chunks=tuple(dataclasses.replace(c, sizes=(c.sizes[0], 1, 2, 2))
                                                  for c in conv.chunks))
    with pytest.raises(UsageError, match="holds part of a row"):
        reshaped(half, "flat", (12,))


def test_zeros_writes_zeros_of_its_dtype(tmp_path):
    (got,) = written(tmp_path, [zeros("expert_bias_E", by_name("float32"), (5,))], max_memory=8)
    assert torch.equal(got, torch.zeros(5))


def test_take_rows_per_query_group_as_a_fused_qkv_holds_them(tmp_path):
    # 2 groups of (q: 4 rows, k: 2, v: 2), as Megatron's linear_qkv lays them out
    w = torch.randn(16, 3, generator=G)
    entry = sharded(tmp_path, "qkv", w, [5, 11])
    q = take_rows("q", [(entry, 0, 4), (entry, 8, 12)])
    k = take_rows("k", [(entry, 4, 6), (entry, 12, 14)])
    back = take_rows("qkv", [(q, 0, 4), (k, 0, 2), (q, 4, 8), (k, 2, 4)])
    got = written(tmp_path, [q, k, back])
    assert torch.equal(got[0], torch.cat([w[0:4], w[8:12]]))
    assert torch.equal(got[1], torch.cat([w[4:6], w[12:14]]))
    assert torch.equal(got[2], torch.cat([w[0:6], w[8:14]]))


def test_a_row_gather_splits_and_joins_as_its_gathered_rows(tmp_path):
    w = torch.randn(6, 2, generator=G)
    entry = dataclasses.replace(sharded(tmp_path, "q", w, [3]), rows=(5, 0, 4, 1, 3, 2))
    assert materialize_rows(entry).rows is None
    a, b = split_rows(entry, [2, 4], ["a", "b"])
    got = written(tmp_path, [a, b, materialize_rows(entry)])
    order = list(entry.rows or ())
    assert torch.equal(torch.cat(got[:2]), w[order]) and torch.equal(got[2], w[order])


@pytest.mark.parametrize("shape", [(7, 5), (3, 4, 6)])
def test_transposed_streams_in_row_blocks(tmp_path, shape):
    w = torch.randn(*shape, generator=G)
    (got,) = written(tmp_path, [transposed(sharded(tmp_path, "w", w, [2]), "wT")], cast="bfloat16", max_memory=40)
    assert torch.equal(got, w.transpose(-1, -2).to(torch.bfloat16))


@pytest.mark.parametrize("inverse", [False, True])
def test_interleaved_streams_in_row_blocks_and_in_part_through_a_transpose(tmp_path, inverse):
    w = torch.randn(5, 6, generator=G)  # halves of 3 columns; the transpose's row blocks of 2 cross them
    gate, up = w.chunk(2, -1)
    expected = torch.cat([w[:, 0::2], w[:, 1::2]], -1) if inverse else torch.stack([gate, up], -1).flatten(-2)
    entry = interleaved(sharded(tmp_path, "w", w, [2]), "i", inverse)
    got, got_t = written(tmp_path, [entry, transposed(entry, "t")], max_memory=40)
    assert torch.equal(got, expected) and torch.equal(got_t, expected.T)
    assert interleaved(entry, "back", not inverse).derived is None  # the inverse of a computed interleave: its input


def torch_reader_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = 128):
    """What torch's QuantizedHuggingFaceStorageReader._dequantize_tensor computes: per block, float32 times its
    scale, then the target dtype."""
    out = torch.empty(weight.shape, dtype=dtype)
    up = weight.to(torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = (up[rows, cols] * scale[i, j]).to(dtype)
    return out


@pytest.mark.parametrize("rows, cols, max_memory", [
    (300, 200, 1 << 20),   # neither dim a multiple of 128: the last blocks are partial
    (256, 130, 3000),      # row blocks of a few rows, cutting through the 128-row blocks
])
def test_dequantized_fp8_equals_torchs_block_arithmetic(tmp_path, rows, cols, max_memory):
    weight = (torch.randn(rows, cols, generator=G) * 4).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=G) + 0.01
    w = sharded(tmp_path, "w", weight, [rows // 3])
    s = sharded(tmp_path, "s", scale, [])
    got_f32, = written(tmp_path, [dequantized(w, s, "w", by_name("float32"))], max_memory=max_memory)
    assert torch.equal(got_f32, torch_reader_dequant(weight, scale, torch.float32))
    (tmp_path / "out" / "0.bin").unlink()
    got_bf16, = written(tmp_path, [dequantized(w, s, "w", by_name("float32"))], cast="bfloat16",
                        max_memory=max_memory)
    assert torch.equal(got_bf16, torch_reader_dequant(weight, scale, torch.bfloat16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequantized_computed_straight_into_a_cast_is_the_float32_result_cast(tmp_path, dtype):
    """A cast of a dequantization (and of a stack of them, as experts are) computes the cast dtype from each tile's
    table of float32 products rounded once: no float32 copy, the same bits as torch's reader then ``.to``."""
    weights = [(torch.randn(300, 200, generator=G) * 4).to(torch.float8_e4m3fn) for _ in range(2)]
    scales = [torch.rand(3, 2, generator=G) * 1e3 + 0.01 for _ in range(2)]  # products beyond float16's range too
    parts = [dequantized(sharded(tmp_path, f"w{i}", w, [100]), sharded(tmp_path, f"s{i}", s, []), f"w{i}",
                         by_name("float32")) for i, (w, s) in enumerate(zip(weights, scales, strict=True))]
    to = by_name(dtype)
    direct = [computed_in(parts[0], to), computed_in(stack("experts", parts), to)]
    assert [e.dtype for e in direct] == [to, to] and direct[1].derived.inputs[0].dtype == to
    got = written(tmp_path, direct, max_memory=5000)
    expected = [torch_reader_dequant(w, s, getattr(torch, dtype)) for w, s in zip(weights, scales, strict=True)]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], torch.stack(expected))


def test_dequantized_refuses_a_scale_grid_that_does_not_cover_the_weight(tmp_path):
    w = sharded(tmp_path, "w", torch.zeros(300, 10).to(torch.float8_e4m3fn), [])
    s = sharded(tmp_path, "w_scale_inv", torch.ones(2, 1), [])
    with pytest.raises(UsageError, match=r"'w_scale_inv': shape \[2, 1\] \(float32\); the 128x128 block grid of "
                                         r"'w' \[300, 10\] is \[3, 1\] floats"):
        dequantized(w, s, "w", by_name("float32"))


@pytest.mark.parametrize("call, message", [
    (lambda e: split_rows(e, [2, 2], ["a", "b"]), r"'w': has 6 rows, not the 2 \+ 2 of its parts \(a, b\)"),
    (lambda e: unstack(e, ["a", "b"]), r"'w': shape \[6, 2\] does not stack 2 tensors along dim 0"),
    (lambda e: take_rows("x", [(e, 4, 7)]), r"'x': rows \[4, 7\) are not within 'w''s 6 rows"),
])
def test_row_operations_refuse_what_does_not_fit(tmp_path, call, message):
    with pytest.raises(UsageError, match=message):
        call(sharded(tmp_path, "w", torch.zeros(6, 2), []))


def test_computed_tensors_split_join_and_stack_as_their_values(tmp_path):
    a, b = torch.randn(3, 5, generator=G), torch.randn(3, 5, generator=G)
    ta = transposed(sharded(tmp_path, "a", a.T.contiguous(), [2]), "a")  # computed: a itself
    tb = transposed(sharded(tmp_path, "b", b.T.contiguous(), []), "b")
    joined = join_rows("ab", [ta, tb])
    first, rest = split_rows(joined, [4, 2], ["first", "rest"])
    stacked = stack("s", [ta, tb])
    got = written(tmp_path, [joined, first, rest, stacked], max_memory=24)
    assert torch.equal(got[0], torch.cat([a, b]))
    assert torch.equal(got[1], torch.cat([a, b])[:4]) and torch.equal(got[2], torch.cat([a, b])[4:])
    assert torch.equal(got[3], torch.stack([a, b]))
    with pytest.raises(UsageError, match=r"'a': a computed tensor \(transpose\) is not unstacked; unstack its input"):
        unstack(ta, ["x", "y", "z"])

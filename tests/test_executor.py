"""ckptkit.io.execute: streaming a write plan into files, kernel-side where it can, in row blocks where it casts."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _checks import (
    assert_same_tree,
    assert_tensor_identical,
    hash_tree,
    leftovers,
    load_dcp,
    load_full,
    random_bits,
    tensor_bits,
)
from ckptkit.codecs.safetensors_header import read_header
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Chunk, Span, TensorEntry
from ckptkit.core.plan import Bytes, FilePlan, Region, WritePlan
from ckptkit.errors import FormatError
from ckptkit.io import moves
from ckptkit.io.execute import execute
from ckptkit.io.options import WriteOptions
from ckptkit.io.storage.local import LOCAL, writer as executor
from ckptkit.io.storage.local.writer import write_files
from ckptkit.ops.convert import convert


def _no_kernel_copy(*args):
    raise OSError(errno.EXDEV, "Invalid cross-device link")


def _seven_bytes_at_a_time(fd_in, fd_out, count, offset_src=None, offset_dst=None):
    return _real_copy_file_range(fd_in, fd_out, min(count, 7), offset_src, offset_dst)


_real_copy_file_range = getattr(os, "copy_file_range", None)


@pytest.mark.skipif(_real_copy_file_range is None, reason="os.copy_file_range is Linux-only")
@pytest.mark.parametrize("kernel_copy", [
    _no_kernel_copy,         # a filesystem pair that cannot: the buffered fallback moves the bytes
    _seven_bytes_at_a_time,  # short kernel copies: the loop resumes where each stopped
])
def test_convert_bit_exact_whatever_copy_file_range_does(tmp_path, monkeypatch, full_ckpt, training_state,
                                                         kernel_copy):
    monkeypatch.setattr(moves, "KERNEL_COPY", 1)  # every copy kernel-side, however small
    monkeypatch.setattr(os, "copy_file_range", kernel_copy)
    convert(full_ckpt, tmp_path / "dcp", to="sharded", world_size=3)
    convert(tmp_path / "dcp", tmp_path / "back.pt", to="full")
    monkeypatch.undo()
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "c.pt"), training_state)
    assert_same_tree(load_full(tmp_path / "back.pt"), training_state)


# ------------------------------------------------------------------------------------------ plans, executed


def source(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, TensorEntry]:
    """``tensors`` in a safetensors file, as entries whose bytes lie there."""
    save_file(tensors, tmp_path / "src.safetensors")
    return {t.key: t for t in read_header(tmp_path / "src.safetensors")[0]}


@pytest.fixture
def blocks(monkeypatch) -> list[int]:
    """The size of each block the executor reads into memory, in order."""
    sizes: list[int] = []
    real = executor.read_region

    def read_region(region, files):
        data = real(region, files)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(executor, "read_region", read_region)
    return sizes


@pytest.mark.parametrize("src, cast, expected", [
    # narrowing: a 3-row block reads 36 bytes and casts them to 18, 54 of the 64 allowed
    (torch.float32, torch.bfloat16, [36, 36, 36, 12]),
    # widening: a 3-row block reads 18 bytes and casts them to 36
    (torch.bfloat16, torch.float32, [18, 18, 18, 6]),
])
def test_write_files_casts_in_row_blocks_within_max_memory(tmp_path, blocks, src, cast, expected):
    w = random_bits((10, 3), src, torch.Generator().manual_seed(0))
    entry = source(tmp_path, {"w": w})["w"]
    (tmp_path / "out").mkdir()
    to = by_name(str(cast).removeprefix("torch."))
    write_files((FilePlan("w.bin", (Region.whole(entry, to),)),), tmp_path / "out", max_memory=64)
    # A block and its cast copy are alive together: both count against the budget.
    assert blocks == expected
    assert all(n + n * to.itemsize // entry.dtype.itemsize <= 64 for n in blocks)
    got = torch.frombuffer(bytearray((tmp_path / "out" / "w.bin").read_bytes()), dtype=cast)
    assert_tensor_identical(got.reshape(10, 3), w.to(cast))


def test_write_files_budget_below_one_row_moves_one_row_at_a_time(tmp_path, blocks):
    entry = source(tmp_path, {"w": torch.arange(12.0).reshape(3, 4)})["w"]
    (tmp_path / "out").mkdir()
    write_files((FilePlan("w.bin", (Region.whole(entry, by_name("float16")),)),), tmp_path / "out", max_memory=1)
    assert blocks == [16, 16, 16]
    got = torch.frombuffer(bytearray((tmp_path / "out" / "w.bin").read_bytes()), dtype=torch.float16)
    assert_tensor_identical(got, torch.arange(12.0, dtype=torch.float16))


def test_write_files_without_a_cast_moves_no_bytes_through_memory(tmp_path, monkeypatch):
    entry = source(tmp_path, {"w": torch.arange(12.0).reshape(3, 4)})["w"]
    monkeypatch.setattr(executor, "read_region", lambda *a: pytest.fail("a plain copy read bytes into memory"))
    (tmp_path / "out").mkdir()
    write_files((FilePlan("w.bin", (Bytes(b"head"), Region(entry, (1, 0), (2, 4)))),), tmp_path / "out")
    assert (tmp_path / "out" / "w.bin").read_bytes() == b"head" + bytes(tensor_bits(torch.arange(4.0, 12.0)).numpy())


@pytest.mark.parametrize("parts", [
    ("empty",),                     # an empty tensor alone: a 0-byte file
    ("bytes", "empty"),             # ends in an empty tensor
    ("empty", "w", "empty"),        # empty on both sides
    ("bytes", "w", "bytes"),        # framing around a tensor
    ("nothing",),                   # no bytes at all
])
def test_write_files_makes_each_file_exactly_its_plan_s_size(tmp_path, parts):
    entries = source(tmp_path, {"w": torch.arange(6.0), "empty": torch.zeros(0, 3)})
    named = {"bytes": Bytes(b"xyz"), "nothing": Bytes(b""), "w": Region.whole(entries["w"]),
             "empty": Region.whole(entries["empty"])}
    plan = FilePlan("f.bin", tuple(named[p] for p in parts))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f.bin").write_bytes(b"!" * 1000)  # a longer file there before: replaced, not patched
    write_files((plan,), tmp_path / "out")
    assert (tmp_path / "out" / "f.bin").stat().st_size == plan.nbytes


def test_copy_file_range_pieces_are_resumed_in_order(tmp_path, monkeypatch):
    # Large copies go in pieces of _COPY_PIECE bytes; 5-byte pieces stand in for 1 GiB ones.
    monkeypatch.setattr(executor, "_COPY_PIECE", 5)
    monkeypatch.setattr(moves, "KERNEL_COPY", 1)
    w = random_bits((7, 3), torch.float32, torch.Generator().manual_seed(2))
    entry = source(tmp_path, {"w": w})["w"]
    (tmp_path / "out").mkdir()
    write_files((FilePlan("w.bin", (Region.whole(entry),)),), tmp_path / "out")
    assert (tmp_path / "out" / "w.bin").read_bytes() == bytes(tensor_bits(w).numpy())


@pytest.fixture
def writes(monkeypatch) -> list[int]:
    """The size of each buffered write the executor makes, in order (kernel copies fail the test)."""
    sizes: list[int] = []
    real = executor._pwrite_all
    monkeypatch.setattr(executor, "_pwrite_all", lambda out, view, pos: sizes.append(len(view)) or real(out, view, pos))
    monkeypatch.setattr(os, "copy_file_range", lambda *a: pytest.fail("a small copy went kernel-side"))
    return sizes


def framed(tmp_path: Path, n: int) -> tuple[FilePlan, bytes]:
    """A file of ``n`` small tensors each after framing bytes (as a DCP of many small chunks is), and its bytes."""
    tensors = {f"t{i}": random_bits((3, i + 1), torch.float32, torch.Generator().manual_seed(i)) for i in range(n)}
    entries = source(tmp_path, tensors)
    parts: list = []
    want = b""
    for i in range(n):
        parts += [Bytes(b"frame%d" % i), Region.whole(entries[f"t{i}"])]
        want += b"frame%d" % i + bytes(tensor_bits(tensors[f"t{i}"]).numpy())
    return FilePlan("f.bin", tuple(parts)), want


def test_write_files_gathers_small_copies_and_framing_into_one_write(tmp_path, writes):
    plan, want = framed(tmp_path, 20)
    (tmp_path / "out").mkdir()
    write_files((plan,), tmp_path / "out")
    assert (tmp_path / "out" / "f.bin").read_bytes() == want
    assert writes == [len(want)]


def test_write_files_buffer_smaller_than_a_tensor_writes_in_blocks(tmp_path, writes):
    # max_memory 256: two buffers of 64 bytes; the 3 x 20 float32 tensor (240 bytes) goes in row blocks.
    plan, want = framed(tmp_path, 20)
    (tmp_path / "out").mkdir()
    write_files((plan,), tmp_path / "out", max_memory=256)
    assert (tmp_path / "out" / "f.bin").read_bytes() == want
    assert sum(writes) == len(want) and max(writes) <= 80  # one 80-byte row of the widest tensor at most


def test_write_files_large_copies_go_kernel_side(tmp_path, monkeypatch):
    monkeypatch.setattr(moves, "KERNEL_COPY", 40)
    monkeypatch.setattr(executor, "_pwrite_all", lambda *a: pytest.fail("a large copy went through the buffer"))
    w = random_bits((4, 3), torch.float32, torch.Generator().manual_seed(5))
    entry = source(tmp_path, {"w": w})["w"]
    (tmp_path / "out").mkdir()
    write_files((FilePlan("w.bin", (Region.whole(entry),)),), tmp_path / "out")
    assert (tmp_path / "out" / "w.bin").read_bytes() == bytes(tensor_bits(w).numpy())


def test_write_files_a_failed_buffered_write_names_the_destination(tmp_path, monkeypatch):
    plan, _ = framed(tmp_path, 3)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError, match=r"No space left on device \(writing /dst/f.bin\)"):
        write_files((plan,), tmp_path / "out", names={"f.bin": Path("/dst/f.bin")})


@pytest.mark.parametrize("existing", [False, True])  # a previous DST survives the failure unchanged
def test_execute_failure_leaves_no_staging_and_dst_as_it_was(tmp_path, existing):
    entries = source(tmp_path, {"w": torch.arange(6.0)})
    gone = TensorEntry("gone", ("gone",), by_name("float32"), (2,),
                       (Chunk((0,), (2,), Span(str(tmp_path / "missing.bin"), 0, 8)),))
    plan = WritePlan((FilePlan("a.bin", (Region.whole(entries["w"]),)), FilePlan("b.bin", (Region.whole(gone),))))
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
        (dst / "old.bin").write_bytes(b"old")
    before = hash_tree(dst) if existing else None
    with pytest.raises(FormatError, match=rf"^{tmp_path / 'missing.bin'}: cannot open \(No such file or directory\)$"):
        execute(plan, dst, LOCAL, WriteOptions(overwrite=True))
    assert (hash_tree(dst) if dst.exists() else None) == before
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("cast", [None, torch.bfloat16])  # kernel copies per run of rows; a cast per row block
def test_write_files_streams_a_row_gather_as_torch_indexes_it(tmp_path, cast):
    import dataclasses

    w = random_bits((6, 5), torch.float32, torch.Generator().manual_seed(3))
    rows = (4, 5, 0, 2, 1, 3)
    entry = dataclasses.replace(source(tmp_path, {"w": w})["w"], rows=rows)
    to = by_name("bfloat16") if cast else None
    (tmp_path / "out").mkdir()
    write_files((FilePlan("w.bin", (Region.whole(entry, to),)),), tmp_path / "out", max_memory=24)
    got = torch.frombuffer(bytearray((tmp_path / "out" / "w.bin").read_bytes()), dtype=cast or torch.float32)
    want = w[list(rows)]
    assert_tensor_identical(got.reshape(6, 5), want.to(cast) if cast else want)


def test_units_write_framing_that_follows_framing_as_one_unit_and_a_whole_file_slice_keeps_its_size(tmp_path):
    # A DCP rank file is framing, a chunk, framing, framing, a chunk...: a chunk's tail and the next chunk's head
    # make one write unit, and the bytes land where the parts say.
    from ckptkit.core.split import Slice

    data = tmp_path / "src.bin"
    data.write_bytes(bytes(range(64)))
    entry = TensorEntry("t", ("t",), by_name("uint8"), (64,), (Chunk((0,), (64,), Span(str(data), 0, 64)),))
    parts = (Bytes(b"head"), Region(entry, (0,), (8,)), Bytes(b"tail"), Bytes(b"HEAD"), Region(entry, (8,), (8,)),
             Bytes(b"end"))
    got = list(moves.units(parts, 0, 1 << 20))
    assert [type(u).__name__ for u in got] == ["Literal", "Read", "Literal", "Read", "Literal"]
    assert (got[2].dst, bytes(got[2].data)) == (12, b"tailHEAD") and (got[4].dst, bytes(got[4].data)) == (28, b"end")
    plan = FilePlan("out.bin", parts)
    assert Slice.whole(plan).nbytes == plan.nbytes == 31
    write_files((plan,), tmp_path)
    assert (tmp_path / "out.bin").read_bytes() == b"head" + bytes(range(8)) + b"tailHEAD" + bytes(range(8, 16)) + b"end"

"""ckptkit.io.sources: a region's bytes read from real chunk files, torch's slicing of the tensor the oracle.

Chunks are written one after another into one file, a few bytes apart (so no read is aligned), each as
``tensor[box].contiguous()`` or, for a padded chunk, inside a wider buffer (row strides larger than its rows).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from _checks import random_bits, tensor_bits
from ckptkit.core.boxes import row_major
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Chunk, Span, TensorEntry
from ckptkit.core.plan import Region
from ckptkit.errors import FormatError
from ckptkit.io.sources import Files, read_region
from ckptkit.io.storage.local import reads

Box = tuple[tuple[int, ...], tuple[int, ...]]


def chunked(path: Path, t: torch.Tensor, boxes: list[Box], pad: int = 0) -> TensorEntry:
    """``t`` as chunks ``boxes`` in ``path``; ``pad`` extra elements at the end of each chunk's last dim."""
    chunks, data = [], bytearray()
    for offsets, sizes in boxes:
        piece = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        stored = torch.zeros((*sizes[:-1], sizes[-1] + pad), dtype=t.dtype)
        stored[..., :sizes[-1]] = piece
        data += b"\xee" * 3  # unaligned
        raw = bytes(tensor_bits(stored).numpy())
        strides = row_major(tuple(stored.shape)) if pad else None
        chunks.append(Chunk(offsets, sizes, Span(str(path), len(data), len(raw)), strides))
        data += raw
    path.write_bytes(bytes(data))
    return TensorEntry("w", ("w",), by_name(str(t.dtype).removeprefix("torch.")), tuple(t.shape), tuple(chunks))


def expected(t: torch.Tensor, region: Region) -> bytes:
    return bytes(tensor_bits(t[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.sizes,
                                                                       strict=True))]).numpy())


def columns(rows: int, widths: tuple[int, ...]) -> list[Box]:
    """Column chunks (``Shard(1)``) of the given widths."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [((0, s), (rows, w)) for s, w in zip(starts, widths, strict=True)]


@pytest.mark.parametrize("shape, boxes, region, pad", [
    # odd column chunks (2 and 3 of 5): the whole tensor, and a sub-box across both
    ((7, 5), columns(7, (2, 3)), None, 0),
    ((7, 5), columns(7, (2, 3)), ((1, 1), (5, 3)), 0),
    # more rows than one preadv takes (1024 buffers): three calls per chunk
    ((2100, 3), columns(2100, (1, 2)), None, 0),
    # padded chunks (rows farther apart than they are long): the gaps read into scratch, 512 rows a call
    ((1500, 4), columns(1500, (3, 1)), None, 5),
    ((6, 4), columns(6, (2, 2)), ((2, 1), (3, 2)), 1),
    # a 3-D tensor sharded along dims 1 and 2
    ((3, 4, 5), [((0, i, j), (3, 2, w)) for i in (0, 2) for j, w in ((0, 2), (2, 3))], None, 0),
    ((3, 4, 5), [((0, i, j), (3, 2, w)) for i in (0, 2) for j, w in ((0, 2), (2, 3))], ((1, 1, 1), (2, 3, 3)), 2),
    # Shard(0) chunks, a region across two
    ((6, 3), [((0, 0), (2, 3)), ((2, 0), (4, 3))], ((1, 0), (3, 3)), 0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_region_scatters_chunk_rows_as_torch_slices(tmp_path, shape, boxes, region, pad, dtype):
    t = random_bits(shape, dtype, torch.Generator().manual_seed(math.prod(shape)))
    entry = chunked(tmp_path / "src.bin", t, boxes, pad)
    r = Region(entry, *region) if region else Region.whole(entry)
    with Files() as files:
        assert bytes(read_region(r, files)) == expected(t, r)


def test_read_region_rows_far_apart_read_one_by_one(tmp_path, monkeypatch):
    monkeypatch.setattr(reads, "_SKIP", 0)  # any gap counts as far: a read per row
    t = random_bits((9, 5), torch.float32, torch.Generator().manual_seed(1))
    entry = chunked(tmp_path / "src.bin", t, columns(9, (2, 3)), pad=2)
    with Files() as files:
        assert bytes(read_region(Region.whole(entry), files)) == expected(t, Region.whole(entry))


def test_read_region_row_gather_of_column_chunks(tmp_path):
    t = random_bits((5, 4), torch.float32, torch.Generator().manual_seed(2))
    rows = (3, 4, 0, 2, 1)
    entry = dataclasses.replace(chunked(tmp_path / "src.bin", t, columns(5, (1, 3))), rows=rows)
    with Files() as files:
        assert bytes(read_region(Region.whole(entry), files)) == bytes(tensor_bits(t[list(rows)]).numpy())


def test_read_region_truncated_source_names_the_file(tmp_path):
    t = random_bits((8, 4), torch.float32, torch.Generator().manual_seed(3))
    path = tmp_path / "src.bin"
    entry = chunked(path, t, columns(8, (2, 2)))
    path.write_bytes(path.read_bytes()[:-10])
    with Files() as files, pytest.raises(FormatError, match=rf"^{path}: 'w' needs bytes up to offset \d+ but the "
                                                           r"file has \d+ \(truncated\?\)$"):
        read_region(Region.whole(entry), files)


def test_read_region_file_cut_short_after_it_was_opened(tmp_path):
    # The size checked when the file was opened no longer holds: the short read names where the file ended.
    t = random_bits((8, 4), torch.float32, torch.Generator().manual_seed(4))
    path = tmp_path / "src.bin"
    entry = chunked(path, t, columns(8, (2, 2)))
    with Files() as files:
        read_region(Region.whole(entry), files)
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(size - 10)
        with pytest.raises(FormatError, match=rf"^{path}: unexpected end of file at offset \d+$"):
            read_region(Region.whole(entry), files)


def test_dcp_read_of_chunks_of_tens_of_kib_makes_one_read_per_chunk(tmp_path, monkeypatch):
    # A chunk's archive is read at its head and at its tail; the read of a tail also takes the next archive's
    # head, so a DCP of 64 KiB chunks costs one pread per chunk, not two. torch's own load is the oracle of
    # what was read.
    import torch.distributed.checkpoint as dcp

    from ckptkit.formats.dcp import DcpIO

    state = {f"w{i}": torch.randn(64, 256) for i in range(40)}  # 64 KiB each
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    calls = []
    pread = reads.os.pread
    monkeypatch.setattr(reads.os, "pread", lambda fd, n, offset: calls.append(n) or pread(fd, n, offset))
    manifest = DcpIO().read(tmp_path / "dcp")
    monkeypatch.undo()
    assert len(calls) <= len(state) + 4, calls
    with Files() as files:
        for key, t in state.items():
            got = read_region(Region.whole(manifest[key]), files)
            assert torch.equal(torch.frombuffer(got, dtype=torch.float32).view(64, 256), t)

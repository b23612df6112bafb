"""ckptkit.codecs.safetensors_header: headers that ``safetensors`` wrote, read as data; files laid out here, read by
``safetensors``. (Headers that lie about their data are refused in test_errors.py.)"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from _checks import assert_same_tree, make_zoo, tensor_bits
from ckptkit.codecs.safetensors_header import file_parts, read_header
from ckptkit.core.dtypes import by_name
from ckptkit.core.plan import FilePlan, Region
from ckptkit.errors import FormatError
from ckptkit.io.storage.local.writer import write_files


def span_bytes(span) -> bytes:
    with open(span.file, "rb") as f:
        f.seek(span.offset)
        return f.read(span.length)


def safetensors_zoo() -> dict[str, torch.Tensor]:
    """The test zoo, every dtype of which safetensors stores, plus the unsigned and complex ones."""
    zoo = make_zoo()
    zoo["u16"] = torch.arange(6, dtype=torch.int32).reshape(2, 3).to(torch.uint16)
    zoo["c64"] = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    return zoo


def test_read_header_of_safetensors_file(tmp_path):
    zoo = safetensors_zoo()
    path = tmp_path / "model.safetensors"
    save_file(zoo, path, metadata={"format": "pt", "step": "7"})
    tensors, meta = read_header(path)
    assert meta == {"format": "pt", "step": "7"}
    assert sorted(t.key for t in tensors) == sorted(zoo)
    for t in tensors:
        want = zoo[t.key]
        assert (t.path, t.dtype.name, t.shape) == ((t.key,), str(want.dtype).removeprefix("torch."), tuple(want.shape))
        (chunk,) = t.chunks
        assert (chunk.offsets, chunk.sizes, chunk.strides) == ((0,) * want.dim(), tuple(want.shape), None)
        assert chunk.span.file == str(path.absolute())
        assert span_bytes(chunk.span) == bytes(tensor_bits(want).numpy()), t.key


def test_read_header_without_metadata(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    tensors, meta = read_header(tmp_path / "m.safetensors")
    assert [t.key for t in tensors] == ["w"] and meta == {}


@pytest.mark.parametrize("raw, message", [
    (b"\x10\x00", r"2 bytes is too short for a safetensors file"),                      # no length
    (struct.pack("<Q", 5) + b"{oops", r"header is not valid JSON"),                     # not JSON
    (struct.pack("<Q", 2) + b"[]", r"header is not a JSON object"),                     # JSON, not an object
    (struct.pack("<Q", 200 << 20) + b"{}", r"header length 209715200 exceeds the file"),  # beyond the 100 MiB limit
])
def test_read_header_refuses_what_is_no_safetensors_header(tmp_path, raw, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw)
    with pytest.raises(FormatError, match=rf"^{path}: {message}"):
        read_header(path)


def _write(tmp_path: Path, regions: list[Region]) -> Path:
    write_files((FilePlan("out.safetensors", file_parts(regions)),), tmp_path)
    return tmp_path / "out.safetensors"


def test_file_parts_read_by_safetensors(tmp_path):
    zoo = safetensors_zoo()
    torch.save(zoo, tmp_path / "src.pt")
    save_file(zoo, tmp_path / "src.safetensors")
    tensors, _ = read_header(tmp_path / "src.safetensors")
    out = _write(tmp_path, [Region.whole(t) for t in tensors])
    assert_same_tree(load_file(out), zoo)
    with safe_open(out, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == sorted(zoo)
    (n,) = struct.unpack("<Q", out.read_bytes()[:8])
    assert n % 8 == 0  # tensor data starts 8-byte aligned, as safetensors' own writer pads it


def test_file_parts_header_names_the_cast_dtype(tmp_path):
    save_file({"w": torch.randn(4, 3), "i": torch.arange(3)}, tmp_path / "src.safetensors")
    tensors, _ = read_header(tmp_path / "src.safetensors")
    bf16 = by_name("bfloat16")
    regions = [Region.whole(t, bf16 if t.dtype.is_floating else None) for t in tensors]
    parts = file_parts(regions)
    assert parts[1:] == tuple(regions)  # the header is the one part ckptkit computes; tensors stream
    out = load_file(_write(tmp_path, regions))
    src = load_file(tmp_path / "src.safetensors")
    assert_same_tree(out, {"w": src["w"].to(torch.bfloat16), "i": src["i"]})


def test_file_parts_of_a_sub_box(tmp_path):
    save_file({"w": torch.arange(12.0).reshape(4, 3)}, tmp_path / "src.safetensors")
    (w,), _ = read_header(tmp_path / "src.safetensors")
    out = load_file(_write(tmp_path, [Region(w, (1, 0), (2, 3))]))
    assert_same_tree(out, {"w": torch.arange(12.0).reshape(4, 3)[1:3]})

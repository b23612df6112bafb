"""The safetensors header as data: an 8-byte little-endian length, a JSON ``{key: {dtype, shape, data_offsets}}``
and the raw row-major bytes after it.

Reading checks the header as untrusted input (size, offsets inside the file, no overlaps, sizes that match
shapes) and moves no tensor bytes; writing lays out a header that ``safetensors.safe_open`` reads.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from ..core import dtypes
from ..core.manifest import Chunk, Span, TensorEntry
from ..core.plan import Bytes, Part, Region
from ..errors import FormatError

__all__ = ["file_parts", "read_header"]

_MAX_HEADER = 100_000_000  # the limit the safetensors library itself enforces
_MAX_DIMS = 64


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(file: Path) -> tuple[list[TensorEntry], dict[str, str]]:
    """The tensors of one safetensors file and its ``__metadata__``.

    The header is held to what ``safetensors`` itself accepts, so that whatever ckptkit reads, the library
    reads the same way: UTF-8 JSON, a ``__metadata__`` of strings, non-negative integer shapes and offsets,
    and tensors that tile the data section from its first byte to the end of the file with no gap.
    """
    where, size = str(file), file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{where}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise FormatError(f"{where}: header length {n} exceeds the file ({size} bytes) or the 100 MB limit")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{where}: header is not valid JSON ({type(e).__name__}: {str(e)[:120]})") from e
    if not isinstance(header, dict):
        raise FormatError(f"{where}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError(f"{where}: __metadata__ must map strings to strings, as safetensors requires; found "
                          f"{json.dumps(meta)[:80]}")
    base, tensors, spans = 8 + n, [], []
    for key, info in header.items():
        try:
            dtype = dtypes.by_safetensors(info["dtype"], where=f"{where}: {key!r}")
            shape, offsets = info["shape"], info["data_offsets"]
        except (KeyError, TypeError) as e:
            raise FormatError(f"{where}: entry {key!r} needs dtype, shape and data_offsets ({e!r})") from e
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(map(_count, shape))
                and isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
            raise FormatError(f"{where}: entry {key!r} has shape {json.dumps(shape)[:60]} and data_offsets "
                              f"{json.dumps(offsets)[:60]}; expected non-negative integers")
        begin, end = offsets
        nbytes = dtype.itemsize * math.prod(shape)
        if end - begin != nbytes or base + end > size:
            raise FormatError(f"{where}: {key!r} data_offsets [{begin}, {end}] do not hold {dtype} {list(shape)} "
                              f"({nbytes} bytes) inside the {size - base} data bytes")
        spans.append((begin, end, key))
        span = Span(str(file.absolute()), base + begin, nbytes)
        tensors.append(TensorEntry(key, (key,), dtype, tuple(shape), (Chunk((0,) * len(shape), tuple(shape), span),)))
    at, before = 0, None
    for begin, end, key in sorted(spans):
        if begin < at:
            raise FormatError(f"{where}: tensors {before!r} and {key!r} overlap in the data section")
        if begin > at:
            raise FormatError(f"{where}: {begin - at} bytes before tensor {key!r} belong to no tensor; safetensors "
                              "requires the tensors to follow one another")
        at, before = end, key
    if base + at != size:
        raise FormatError(f"{where}: the tensors end at byte {base + at} but the file has {size} bytes; "
                          "safetensors refuses a file its header does not cover exactly")
    return tensors, dict(meta)


_WRITER_ORDER = {name: i for i, name in enumerate(
    ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"))}
"""safetensors' ``Dtype`` order (0.8): its writer lays tensors out by dtype, last of this order first, then by
name."""


def file_parts(regions: list[Region]) -> tuple[Part, ...]:
    """A safetensors file of ``regions``: the header as :class:`Bytes`, then the tensors' bytes, in the order
    safetensors' own writer (``save_file``, so transformers' ``save_pretrained``) gives the same tensors, so that
    a file read and written back is the same file byte for byte."""
    header: dict[str, Any]
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    regions = sorted(regions, key=lambda r: (-_WRITER_ORDER.get(r.dtype.safetensors or "", -1), r.entry.key))
    for r in regions:
        header[r.entry.key] = {"dtype": r.dtype.safetensors, "shape": list(r.sizes),
                               "data_offsets": [pos, pos + r.nbytes]}
        pos += r.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # pad so tensor data starts 8-byte aligned, as the safetensors writer does
    return (Bytes(struct.pack("<Q", len(data)) + data), *regions)

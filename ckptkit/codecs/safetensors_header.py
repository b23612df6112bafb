"""The safetensors header as data: an 8-byte little-endian length, a JSON ``{key: {dtype, shape, data_offsets}}``
and the raw row-major bytes after it.

Reading checks the header as untrusted input (size, offsets inside the file, no overlaps, sizes that match
shapes) and moves no tensor bytes; writing lays out a header that ``safetensors.safe_open`` reads.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any

from ..core import dtypes
from ..core.manifest import Chunk, Span, TensorEntry
from ..core.plan import Bytes, Part, Region
from ..errors import FormatError

__all__ = ["file_parts", "read_header"]

_MAX_HEADER = 100 << 20  # the limit the safetensors library itself enforces


def read_header(file: Path) -> tuple[list[TensorEntry], dict[str, str]]:
    """The tensors of one safetensors file and its ``__metadata__``."""
    where, size = str(file), file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{where}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise FormatError(f"{where}: header length {n} exceeds the file ({size} bytes) or the 100 MiB limit")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise FormatError(f"{where}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise FormatError(f"{where}: header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base, tensors, spans = 8 + n, [], []
    for key, info in header.items():
        try:
            dtype = dtypes.by_safetensors(info["dtype"], where=f"{where}: {key!r}")
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"{where}: entry {key!r} needs dtype, shape and data_offsets ({e!r})") from e
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if begin < 0 or end - begin != nbytes or base + end > size:
            raise FormatError(f"{where}: {key!r} data_offsets [{begin}, {end}] do not hold {dtype} {list(shape)} "
                              f"({nbytes} bytes) inside the {size - base} data bytes")
        spans.append((begin, end, key))
        span = Span(str(file.absolute()), base + begin, nbytes)
        tensors.append(TensorEntry(key, (key,), dtype, shape, (Chunk((0,) * len(shape), shape, span),)))
    spans.sort()
    for (_, end, key), (next_begin, _, next_key) in itertools.pairwise(spans):
        if next_begin < end:
            raise FormatError(f"{where}: tensors {key!r} and {next_key!r} overlap in the data section")
    return tensors, {str(k): str(v) for k, v in meta.items()}


def file_parts(regions: list[Region]) -> tuple[Part, ...]:
    """A safetensors file of ``regions``, in order: the header as :class:`Bytes`, then the tensors' bytes."""
    header: dict[str, Any]
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for r in regions:
        header[r.entry.key] = {"dtype": r.dtype.safetensors, "shape": list(r.sizes),
                               "data_offsets": [pos, pos + r.nbytes]}
        pos += r.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # pad so tensor data starts 8-byte aligned, as the safetensors writer does
    return (Bytes(struct.pack("<Q", len(data)) + data), *regions)

"""HF: ``model.safetensors`` or shards with ``model.safetensors.index.json``.

A safetensors file is an 8-byte little-endian header length, a JSON header of ``{key: {dtype, shape,
data_offsets}}`` and the raw row-major bytes. The header is parsed here as data (checked like untrusted
input: size, offsets inside the file, no overlaps, sizes that match shapes), so reading moves no tensor
bytes and imports no torch; ``safetensors.safe_open`` reads what is written here, and the tests check it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..core import dtypes
from ..errors import FormatError, UsageError
from ..core.manifest import Chunk, Format, Manifest, Span, TensorEntry
from ..core.plan import FilePlan, Literal, Region, WritePlan
from .base import FormatIO, WriteOptions, cast_for, index_json, read_index, split_files

__all__ = ["HfIO", "read_header"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
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
    for (b0, e0, k0), (b1, _, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise FormatError(f"{where}: tensors {k0!r} and {k1!r} overlap in the data section")
    return tensors, {str(k): str(v) for k, v in meta.items()}


class HfIO(FormatIO):
    format = Format.HF

    @classmethod
    def detect(cls, path: Path) -> bool:
        if path.is_file():
            return path.suffix == ".safetensors"
        return (path / INDEX).is_file() or any(path.glob("*.safetensors"))

    def read(self, path: Path) -> Manifest:
        if path.is_file():
            files = [path]
        elif (path / INDEX).is_file():
            keys = read_index(path / INDEX, ".safetensors")
            files = list(dict.fromkeys(keys.values()))
        elif (path / SINGLE).is_file():
            files = [path / SINGLE]
        else:
            files = sorted(path.glob("*.safetensors"))
            if len(files) > 1:
                raise FormatError(f"{path}: {len(files)} safetensors files but no {INDEX} to say which key lives where")
        tensors, details = [], []
        for file in files:
            found, meta = read_header(file)
            if (path / INDEX).is_file():
                for t in found:
                    if keys.get(t.key) != file:
                        raise FormatError(f"{file}: holds {t.key!r}, which {INDEX} places in {keys.get(t.key, 'no file')}")
            tensors += found
            details += [(f"metadata.{k}", v) for k, v in meta.items()]
        if (path / INDEX).is_file():
            missing = set(keys) - {t.key for t in tensors}
            if missing:
                raise FormatError(f"{path / INDEX}: lists keys no shard holds: {sorted(missing)[:5]}")
        return Manifest(Format.HF, str(path.absolute()), tuple(tensors), (), None, tuple(dict(details).items()))

    def plan(self, manifest: Manifest, options: WriteOptions) -> WritePlan:
        regions: dict[str, Region] = {}
        for t in manifest.tensors:
            region = Region.whole(t, cast_for(t.dtype, options.cast))
            if region.dtype.safetensors is None:
                raise UsageError(f"tensor {t.key!r} has dtype {region.dtype}, which safetensors cannot store")
            regions[t.key] = region
        files = split_files(regions, "model{suffix}.safetensors", options.max_shard_size)
        plans = [FilePlan(name, _file_parts([regions[k] for k in keys])) for name, keys in files.items()]
        if len(plans) > 1:
            plans.append(FilePlan(INDEX, (Literal(index_json(files, regions)),)))
        return WritePlan(tuple(plans))


def _file_parts(regions: list[Region]) -> tuple:
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for r in regions:
        header[r.entry.key] = {"dtype": r.dtype.safetensors, "shape": list(r.sizes), "data_offsets": [pos, pos + r.nbytes]}
        pos += r.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # pad so tensor data starts 8-byte aligned, as the safetensors writer does
    return (Literal(struct.pack("<Q", len(data)) + data), *regions)

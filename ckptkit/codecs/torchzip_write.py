"""``torch.save`` archives laid out as data: a tree whose tensor leaves are streamed :class:`Region` parts.

The layout mirrors ``torch.save`` with ``compute_crc32=False`` (CRC 0 on tensor records, which torch loads
as its own), so tensor bytes can move kernel-side without passing through Python: the pickle, the zip
headers and the central directory are :class:`Bytes` parts, the tensor records are regions.

Tensors are pickled as ``Tensor._reduce_ex_internal`` does (torch 2.13): ``_rebuild_tensor_v2`` over a
typed storage class (``torch.FloatStorage``, counted in elements) for the dtypes that have one, and
``_rebuild_tensor_v3`` over ``UntypedStorage`` (counted in bytes, dtype passed along) for the newer ones
(unsigned 16-64 bit, float8). Loaders that re-implement torch's unpickler rely on this: Lightning's
``_lazy_load`` builds ``TypedStorage(dtype=cls().dtype)`` from the storage class it is handed.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from ..core.boxes import row_major
from ..core.dtypes import DType
from ..core.manifest import TensorEntry
from ..core.plan import Bytes, Part, Region
from .pickle_read import Call, Record, ref
from .pickle_write import dumps

__all__ = ["PartsTensor", "archive_parts"]

_ALIGN = 64
_U32 = 0xFFFFFFFF


class _StorageKey:
    """A tensor's storage as its persistent id names it: typed storages count elements, untyped ones bytes."""

    __slots__ = ("key", "size", "storage_class")

    def __init__(self, key: str, nbytes: int, dtype: DType) -> None:
        self.key, self.storage_class = key, dtype.storage_class
        self.size = nbytes // dtype.itemsize if dtype.storage_class else nbytes


@dataclass(frozen=True, slots=True)
class PartsTensor:
    """A tensor whose storage is ``parts`` in a row: pieces of other tensors and padding (an FSDP1 flat
    parameter rebuilt from the original parameters), or bytes a writer computed (a scalar it writes)."""

    dtype: DType
    parts: tuple[Part, ...]
    shape: tuple[int, ...] | None = None
    """The tensor's shape; None: 1-D, of all its elements."""

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def numel(self) -> int:
        return self.nbytes // self.dtype.itemsize


def _tensorize(tree: Any, records: list[tuple[str, tuple[Part, ...]]]) -> Any:
    """``tree`` with :class:`Region` / :class:`PartsTensor` leaves turned into tensor-rebuild calls on new
    storage records, looking inside :class:`Call` and :class:`Record` nodes too."""
    if isinstance(tree, (Region, PartsTensor)):
        key = str(len(records))
        shape = tuple(tree.sizes) if isinstance(tree, Region) else tree.shape if tree.shape is not None else (
            tree.numel,)
        records.append((f"data/{key}", (tree,) if isinstance(tree, Region) else tree.parts))
        args = (_StorageKey(key, tree.nbytes, tree.dtype), 0, shape, row_major(shape), False,
                Call(ref("collections", "OrderedDict"), ()))
        if tree.dtype.storage_class:
            return Call(ref("torch._utils", "_rebuild_tensor_v2"), args)
        return Call(ref("torch._utils", "_rebuild_tensor_v3"), (*args, tree.dtype))
    if isinstance(tree, Call):
        return Call(tree.func, tuple(_tensorize(a, records) for a in tree.args))
    if isinstance(tree, Record):
        out = type(tree).__new__(type(tree))
        out.__dict__.update({k: _tensorize(v, records) for k, v in tree.__dict__.items()})
        return out
    if isinstance(tree, dict):
        return type(tree)((k, _tensorize(v, records)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tensorize(v, records) for v in tree)
    return tree


def _persistent_id(obj: Any) -> Any:
    if isinstance(obj, _StorageKey):
        cls = ref("torch", obj.storage_class) if obj.storage_class else ref("torch.storage", "UntypedStorage")
        return ("storage", cls, obj.key, "cpu", obj.size)
    return None


def _local_header(name: bytes, size: int, crc: int, pos: int) -> bytes:
    zip64 = size >= _U32
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    fixed = 30 + len(name) + len(extra)
    pad = (-(pos + fixed + 4)) % _ALIGN  # an "FB" extra field of padding aligns the data, as torch's writer does
    extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    small = _U32 if zip64 else size
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, crc, small, small,
                       len(name), len(extra)) + name + extra


def _central(entries: list[tuple[bytes, int, int, int]], cd_offset: int) -> bytes:
    out = bytearray()
    for name, size, crc, offset in entries:
        fields = [v for v in (size, size) if v >= _U32] if size >= _U32 else []
        fields += [offset] if offset >= _U32 else []
        extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
        small = _U32 if size >= _U32 else size
        out += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if fields else 20, 0, 0, 0, 0x21, crc, small, small,
                           len(name), len(extra), 0, 0, 0, 0, min(offset, _U32)) + name + extra
    cd_size, count = len(out), len(entries)
    if count >= 0xFFFF or cd_size >= _U32 or cd_offset >= _U32:
        eocd64 = cd_offset + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                       min(cd_size, _U32), min(cd_offset, _U32), 0)
    return bytes(out)


def archive_parts(tree: Any, *, name: str = "archive") -> tuple[Part, ...]:
    """The parts of a ``torch.save`` archive of ``tree``, whose :class:`Region` and :class:`PartsTensor`
    leaves become tensors (also inside :class:`Call` and :class:`Record` nodes)."""
    if isinstance(tree, Region):  # a DCP chunk: one of thousands that share a few framings
        head, tail = _framing(tree.dtype, tree.sizes, name)
        return head, tree, tail
    return _archive_parts(tree, name)


@functools.lru_cache(maxsize=4096)
def _framing(dtype: DType, sizes: tuple[int, ...], name: str) -> tuple[Bytes, Bytes]:
    """The bytes before and after the tensor data in the archive of one tensor: a function of its dtype and
    shape alone (records, offsets and the serialization id are relative to the archive)."""
    entry = TensorEntry("", ("",), dtype, sizes, ())
    head, _, tail = _archive_parts(Region(entry, (0,) * len(sizes), sizes), name)
    assert isinstance(head, Bytes) and isinstance(tail, Bytes)
    return head, tail


def _archive_parts(tree: Any, name: str) -> tuple[Part, ...]:
    records: list[tuple[str, tuple[Part, ...]]] = []
    pkl = dumps(_tensorize(tree, records), protocol=2, persistent_id=_persistent_id)
    sizes = [(n, sum(p.nbytes for p in ps)) for n, ps in records]
    digest = hashlib.sha1(pkl + repr(sizes).encode()).digest()
    serial_id = str(int.from_bytes(digest, "big") % 10**40).zfill(40).encode()
    ordered = [("data.pkl", (Bytes(pkl),)), (".format_version", (Bytes(b"1"),)),
               (".storage_alignment", (Bytes(b"64"),)), ("byteorder", (Bytes(b"little"),)), *records,
               ("version", (Bytes(b"3\n"),)), (".data/serialization_id", (Bytes(serial_id),))]
    parts: list[Part] = []
    central: list[tuple[bytes, int, int, int]] = []
    pos = 0
    for rec_name, payload in ordered:
        full = f"{name}/{rec_name}".encode()
        size = sum(p.nbytes for p in payload)
        only = payload[0] if len(payload) == 1 else None
        crc = zlib.crc32(only.data) if isinstance(only, Bytes) else 0  # CRC 0 on streamed records, as torch allows
        header = _local_header(full, size, crc, pos)
        central.append((full, size, crc, pos))
        parts += [Bytes(header), *payload]
        pos += len(header) + size
    parts.append(Bytes(_central(central, pos)))
    return _merge_bytes(parts)


def _merge_bytes(parts: list[Part]) -> tuple[Part, ...]:
    out: list[Part] = []
    for p in parts:
        if isinstance(p, Bytes) and out and isinstance(out[-1], Bytes):
            out[-1] = Bytes(out[-1].data + p.data)
        elif not (isinstance(p, Bytes) and not p.data):
            out.append(p)
    return tuple(out)

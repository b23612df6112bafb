"""DCP's ``.metadata`` pickle written straight from the plan, without building its object graph.

A reshard to N ranks writes a ``.metadata`` with three objects per chunk (``ChunkStorageMetadata``,
``MetadataIndex``, ``_StorageInfo``) and a ``torch.Size`` per offset and size: a million-chunk checkpoint is
millions of objects, and building them as :class:`~.pickle_read.Record` stand-ins to pickle them cost about
40 µs per chunk. :class:`MetadataPickle` writes the protocol-2 opcodes that make torch's own ``Metadata``
when unpickled, from plain tuples.

It memoizes only what repeats: the classes and field names, and each key (named by its entry, by
``planner_data`` and by each of its chunks' indexes). Python's pickler memoizes every object, so that a chunk
costs five memo stores where none is ever read back; leaving them out halves the opcodes a chunk takes, and
the unpickler builds the same objects either way (the oracle in the tests is torch's unpickler). A key's path
in ``planner_data`` is written out in full, as torch's own pickle has it, so that a byte damaged in either
copy of a key fails the reader's check that a key is its path joined.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import NamedTuple

from ..core.dtypes import DType

__all__ = ["EMPTY_MARK", "ChunkRecord", "MetadataPickle", "ObjectRecord", "TensorRecord"]

_DCP = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_PACK_I = struct.Struct("<I").pack
_PACK_i = struct.Struct("<i").pack
_PACK_H = struct.Struct("<H").pack


EMPTY_MARK = dict
"""The type of the last element of a ``planner_data`` path that records an empty dict rather than names an
entry: ``{"optimizer.state": ("optimizer", "state", {})}`` says the state dict held ``optimizer.state = {}``
(AdamW's before its first step). torch's DCP stores no empty dict, and its loaders read ``planner_data`` only
for the keys of ``state_dict_metadata``, which these are not; ckptkit's reader restores them from it."""


class ChunkRecord(NamedTuple):  # tuples, not dataclasses: a reshard makes one per chunk
    """One chunk: its box in the tensor and where its ``torch.save`` archive is."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


class TensorRecord(NamedTuple):
    key: str
    dtype: DType
    shape: tuple[int, ...]
    chunks: Sequence[ChunkRecord]


class ObjectRecord(NamedTuple):
    """A non-tensor entry: a ``torch.save`` blob at ``file``/``offset``."""

    key: str
    file: str
    offset: int
    length: int


class MetadataPickle:
    """The pickle of DCP ``Metadata`` for ``tensors`` and ``objects`` (in ``state_dict_metadata`` order) and
    ``planner_data`` (key to path): what ``pickle.loads`` reads as torch's own objects."""

    def __init__(self) -> None:
        self._slots = 0  # memo slots used
        self._memo: dict[object, bytes] = {}  # a global (module, name), a field name or a key -> its BINGET
        self._ints: dict[tuple[int, ...], bytes] = {}  # offsets and sizes of chunks repeat across tensors
        self._files: dict[str, bytes] = {}  # a file name's BINUNICODE (a few names, a million chunks)
        # The opcodes around a chunk's variable parts, once the first chunk has memoized their names.
        self._chunk_frame: tuple[bytes, bytes, bytes] | None = None
        self._entry_frame: tuple[bytes, bytes, bytes, bytes, bytes, bytes] | None = None

    def dumps(self, tensors: Sequence[TensorRecord], objects: Sequence[ObjectRecord],
              planner_data: dict[str, tuple]) -> bytes:
        const = self._const  # (keys repeat as the field names do)
        out = bytearray(b"\x80\x02")
        out += self._new(_DCP, "Metadata") + b"}(" + const("state_dict_metadata") + b"}("
        for t in tensors:
            out += const(t.key)
            self._tensor(out, t)
        for o in objects:
            out += const(o.key) + self._new(_DCP, "BytesStorageMetadata")  # no state, so no BUILD
        out += b"u" + const("planner_data") + b"}("
        for key, path in planner_data.items():
            out += const(key) + b"("
            for part in path:  # written out, not memoized (see the module's docstring)
                out += _int(part) if type(part) is int else b"}" if type(part) is EMPTY_MARK else _unicode(part)
            out += b"t"
        out += b"u" + const("storage_data") + b"}("
        entry = self._entry
        for t in tensors:
            fqn = const(t.key)
            for index, c in enumerate(t.chunks):
                out += entry(fqn, c, index)
        for o in objects:
            out += self._new(_DCP, "MetadataIndex") + b"}(" + const("fqn") + const(o.key)
            out += const("offset") + b"N" + const("index") + b"Nub"
            out += self._storage(o.file, o.offset, o.length)
        out += b"u" + const("storage_meta") + b"N" + const("version") + const("1.0.0") + b"ub."
        return bytes(out)

    def _tensor(self, out: bytearray, t: TensorRecord) -> None:
        const = self._const
        out += self._new(_DCP, "TensorStorageMetadata") + b"}(" + const("properties")
        # TensorProperties pickles its state as (dtype, layout, requires_grad, memory format, pin_memory).
        out += self._new(_DCP, "TensorProperties") + b"(" + self._global("torch", t.dtype.name)
        out += self._global("torch.serialization", "_get_layout") + const("torch.strided") + b"\x85R\x89"
        out += self._global(_DCP, "_MEM_FORMAT_ENCODING") + _int(0) + b"\x85R\x89tb"
        out += const("size") + self._size(t.shape) + const("chunks") + b"]("
        chunk = self._chunk
        for c in t.chunks:
            out += chunk(c)
        out += b"eub"

    def _chunk(self, c: ChunkRecord) -> bytes:
        """A ``ChunkStorageMetadata``."""
        frame = self._chunk_frame
        if frame is None:  # the first chunk defines the names its frame uses; the next ones refer to them
            frame, self._chunk_frame = self._chunk_pieces(), self._chunk_pieces()
        a, b, z = frame
        ints = self._ints
        return a + (ints.get(c.offsets) or self._int_tuple(c.offsets)) + b + (
            ints.get(c.sizes) or self._int_tuple(c.sizes)) + z

    def _chunk_pieces(self) -> tuple[bytes, bytes, bytes]:
        # (Evaluated in the order written, as the pieces stand in the pickle: a name's definition comes first.)
        const, global_ = self._const, self._global
        return (self._new(_DCP, "ChunkStorageMetadata") + b"}(" + const("offsets") + global_("torch", "Size"),
                b"\x85R" + const("sizes") + global_("torch", "Size"), b"\x85Rub")

    def _entry(self, key: bytes, c: ChunkRecord, index: int) -> bytes:
        """A chunk's ``MetadataIndex: _StorageInfo`` item of ``storage_data``; ``key``: its key's opcodes."""
        frame = self._entry_frame
        if frame is None:  # as in _chunk
            frame, self._entry_frame = self._entry_pieces(), self._entry_pieces()
        a, b, i, s, o, n = frame
        return (a + key + b + (self._ints.get(c.offsets) or self._int_tuple(c.offsets)) + i + _int(index) + s
                + (self._files.get(c.file) or self._file(c.file)) + o + _int(c.offset) + n + _int(c.length) + b"ub")

    def _entry_pieces(self) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes]:
        const = self._const
        return (self._new(_DCP, "MetadataIndex") + b"}(" + const("fqn"),
                const("offset") + self._global("torch", "Size"), b"\x85R" + const("index"),
                b"ub" + self._new(_FS, "_StorageInfo") + b"}(" + const("relative_path"),
                const("offset"), const("length"))

    def _storage(self, file: str, offset: int, length: int) -> bytes:
        const = self._const
        out = self._new(_FS, "_StorageInfo") + b"}(" + const("relative_path") + self._file(file)
        return out + const("offset") + _int(offset) + const("length") + _int(length) + b"ub"

    def _file(self, name: str) -> bytes:
        """A file name's BINUNICODE: a new string per chunk in torch's ``Metadata``, so never memoized."""
        raw = self._files[name] = _unicode(name)
        return raw

    def _int_tuple(self, values: tuple[int, ...]) -> bytes:
        raw = self._ints[values] = _int_tuple(values)
        return raw

    def _new(self, module: str, name: str) -> bytes:
        """``cls.__new__(cls)`` as NEWOBJ; the caller writes its state and BUILD."""
        return self._global(module, name) + b")\x81"

    def _size(self, values: tuple[int, ...]) -> bytes:
        """``torch.Size(values)``."""
        size = self._global("torch", "Size")
        return size + (self._ints.get(values) or self._int_tuple(values)) + b"\x85R"

    def _global(self, module: str, name: str) -> bytes:
        return self._memo.get((module, name)) or self._remember((module, name), f"c{module}\n{name}\n".encode())

    def _const(self, s: str) -> bytes:
        """A string that repeats: a field name, a key."""
        return self._memo.get(s) or self._remember(s, _unicode(s))

    def _remember(self, what: object, written: bytes) -> bytes:
        """``written``, memoized at the next slot; later, its BINGET."""
        slot = self._slots
        self._slots += 1
        self._memo[what] = _binget(slot)
        return written + _binput(slot)


def _binput(slot: int) -> bytes:
    return b"q" + bytes((slot,)) if slot < 256 else b"r" + _PACK_I(slot)


def _binget(slot: int) -> bytes:
    return b"h" + bytes((slot,)) if slot < 256 else b"j" + _PACK_I(slot)


def _unicode(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return b"X" + _PACK_I(len(raw)) + raw


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes((v,))
    if 0 <= v < 65536:
        return b"M" + _PACK_H(v)
    if -(2**31) <= v < 2**31:
        return b"J" + _PACK_i(v)
    raw = pickle.encode_long(v)
    return (b"\x8a" + bytes((len(raw),)) if len(raw) < 256 else b"\x8b" + _PACK_i(len(raw))) + raw


def _int_tuple(values: tuple[int, ...]) -> bytes:
    """The opcodes of a tuple of ints."""
    if not values:
        return b")"
    body = b"".join(map(_int, values))
    return b"(" + body + b"t" if len(values) > 3 else body + b"\x85\x86\x87"[len(values) - 1:len(values)]

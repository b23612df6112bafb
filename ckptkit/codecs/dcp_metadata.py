"""DCP's ``.metadata`` pickle written straight from the plan, without building its object graph.

A reshard to N ranks writes a ``.metadata`` with three objects per chunk (``ChunkStorageMetadata``,
``MetadataIndex``, ``_StorageInfo``) and a ``torch.Size`` per offset and size: a million-chunk checkpoint is
millions of objects, and building them as :class:`~.pickle_read.Record` stand-ins to pickle them cost about
40 µs per chunk. :class:`MetadataPickle` writes the opcodes the C pickler writes for that graph (protocol 2,
its memo and its batches of 1000), byte for byte: what DCP's loader reads as torch's own ``Metadata``.

The graph it stands for: each record and each ``torch.Size`` is a new object (so written in full and
memoized once); strings and tuples the caller passes are the caller's objects, memoized by identity as the
pickler does (a tensor's key appears in ``state_dict_metadata``, ``planner_data`` and its chunks' indexes);
file names are new strings per chunk.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..core.dtypes import DType

__all__ = ["ChunkRecord", "MetadataPickle", "ObjectRecord", "TensorRecord"]

_DCP = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_BATCH = 1000  # the C pickler's batch of SETITEMS / APPENDS
_PACK_I = struct.Struct("<I").pack
_PACK_i = struct.Struct("<i").pack
_PACK_H = struct.Struct("<H").pack
# Opcodes of the fast path, where every memo slot takes 4 bytes (LONG_BINPUT):
_R, _DICT, _MARK, _TUPLE1, _REDUCE_OP = b"r}(\x85R"
_OPEN = struct.Struct("<BIBBIB").pack  # r<slot> } r<slot> (    a new record's state dict, opened
_REDUCE = struct.Struct("<BBIBBI").pack  # \x85 r<slot> R r<slot>    a call's argument tuple, and the call
_PUT = struct.Struct("<BI").pack


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
    ``planner_data`` (key to path), as ``pickle.dumps(metadata, protocol=2)`` writes torch's own objects."""

    def __init__(self) -> None:
        self._out = bytearray(b"\x80\x02")
        self._slots = 0  # memo slots used: every object but ints, None, bools and empty tuples takes one
        self._memo: dict[int, int] = {}  # id of a memoized str or tuple of the caller's -> memo slot
        self._names: dict[str, int] = {}  # a global ("module name") or a constant of this module -> memo slot
        self._keep: list[Any] = []  # what the memo names stays alive, so its id is never reused
        self._files: dict[str, bytes] = {}  # see _file
        self._int_tuples: dict[tuple, bytes] = {}  # offsets and sizes of chunks repeat across tensors
        self._chunk_names: tuple[bytes, ...] | None = None  # see _chunk
        self._entry_names: tuple[bytes, ...] | None = None  # see _entry

    def dumps(self, tensors: Sequence[TensorRecord], objects: Sequence[ObjectRecord],
              planner_data: dict[str, tuple]) -> bytes:
        self._new_record(_DCP, "Metadata")
        self._open_dict(5)
        self._const("state_dict_metadata")
        self._open_dict(len(tensors) + len(objects))
        count = 0
        for t in tensors:
            self._str(t.key)
            self._tensor(t)
            count = self._item(count, len(tensors) + len(objects))
        for o in objects:
            self._str(o.key)
            self._new_record(_DCP, "BytesStorageMetadata")  # no state, so no BUILD
            count = self._item(count, len(tensors) + len(objects))
        self._close(len(tensors) + len(objects))
        self._const("planner_data")
        self._open_dict(len(planner_data))
        count = 0
        for key, path in planner_data.items():
            self._str(key)
            self._tuple(path)
            count = self._item(count, len(planner_data))
        self._close(len(planner_data))
        self._const("storage_data")
        n = sum(len(t.chunks) for t in tensors) + len(objects)
        self._open_dict(n)
        count = 0
        for t in tensors:
            for index, c in enumerate(t.chunks):
                self._entry(t.key, c, index)
                count = self._item(count, n)
        for o in objects:
            self._index(o.key, None, None)
            self._storage(o.file, o.offset, o.length)
            count = self._item(count, n)
        self._close(n)
        self._const("storage_meta")
        self._out += b"N"
        self._const("version")
        self._const("1.0.0")
        self._close(5)
        self._out += b"b."
        return bytes(self._out)

    # --- the records -------------------------------------------------------------------------------------

    def _tensor(self, t: TensorRecord) -> None:
        self._new_record(_DCP, "TensorStorageMetadata")
        self._open_dict(3)
        self._const("properties")
        self._new_record(_DCP, "TensorProperties")
        # TensorProperties pickles its state as (dtype, layout, requires_grad, memory_format, pin_memory).
        self._out += b"("
        self._global("torch", t.dtype.name)
        self._call("torch.serialization", "_get_layout", lambda: self._const("torch.strided"))
        self._out += b"\x89"
        self._call(_DCP, "_MEM_FORMAT_ENCODING", lambda: self._int(0))
        self._out += b"\x89t"
        self._put()
        self._out += b"b"
        self._const("size")
        self._size(t.shape)
        self._const("chunks")
        self._out += b"]"
        self._put()
        n = len(t.chunks)
        if n > 1:
            self._out += b"("
        for i, c in enumerate(t.chunks):
            self._chunk(c)
            if n > 1 and (i + 1) % _BATCH == 0 and i + 1 < n:
                self._out += b"e("
        if n:
            self._out += b"e" if n > 1 else b"a"
        self._out += b"ub"

    def _chunk(self, c: ChunkRecord) -> None:
        names = self._chunk_names
        if names is None:
            self._new_record(_DCP, "ChunkStorageMetadata")
            self._open_dict(2)
            self._const("offsets")
            self._size(c.offsets)
            self._const("sizes")
            self._size(c.sizes)
            self._out += b"ub"
            known = self._known(f"{_DCP} ChunkStorageMetadata", "offsets", "torch Size", "sizes", "torch Size")
            if known and self._slots >= 256:
                self._chunk_names = (known[0] + b")\x81", known[1] + known[2], known[3] + known[4])
            return
        # The same opcodes, once the names are memoized: this runs a million times in a large reshard.
        record, offsets, sizes = names
        out, slot, tuple_ = self._out, self._slots, self._tuple
        out += record + _OPEN(_R, slot, _DICT, _R, slot + 1, _MARK) + offsets
        self._slots = slot + 2
        tuple_(c.offsets)
        slot = self._slots
        out += _REDUCE(_TUPLE1, _R, slot, _REDUCE_OP, _R, slot + 1) + sizes
        self._slots = slot + 2
        tuple_(c.sizes)
        slot = self._slots
        out += _REDUCE(_TUPLE1, _R, slot, _REDUCE_OP, _R, slot + 1) + b"ub"
        self._slots = slot + 2

    def _entry(self, key: str, c: ChunkRecord, index: int) -> None:
        """A chunk's ``MetadataIndex: _StorageInfo`` item of ``storage_data``."""
        names = self._entry_names
        if names is None:
            self._index(key, c.offsets, index)
            self._storage(c.file, c.offset, c.length)
            known = self._known(f"{_DCP} MetadataIndex", f"{_FS} _StorageInfo", "fqn", "offset", "torch Size",
                                "index", "relative_path", "offset", "length")
            if known and self._slots >= 256:
                self._entry_names = (known[0] + b")\x81", known[1] + b")\x81", known[2], known[3] + known[4],
                                     *known[5:])
            return
        record, info, fqn, offset_size, index_, relative_path, offset, length = names
        out, slot = self._out, self._slots
        out += record + _OPEN(_R, slot, _DICT, _R, slot + 1, _MARK) + fqn
        self._slots = slot + 2
        self._str(key)
        out += offset_size
        self._tuple(c.offsets)
        slot = self._slots
        out += _REDUCE(_TUPLE1, _R, slot, _REDUCE_OP, _R, slot + 1) + index_ + _int(index) + b"ub" + info
        out += _OPEN(_R, slot + 2, _DICT, _R, slot + 3, _MARK) + relative_path + self._file(c.file)
        out += _PUT(_R, slot + 4) + offset + _int(c.offset) + length + _int(c.length) + b"ub"
        self._slots = slot + 5

    def _file(self, name: str) -> bytes:
        """A file name's BINUNICODE: a new string per chunk, so never memoized, and a few distinct ones."""
        raw = self._files.get(name)
        if raw is None:
            raw = self._files[name] = _unicode(name)
        return raw

    def _known(self, *names: str) -> tuple[bytes, ...] | None:
        """The BINGETs of ``names`` if every one is memoized."""
        slots = [self._names.get(n) for n in names]
        return None if None in slots else tuple(_binget(s) for s in slots if s is not None)

    def _index(self, key: str, offsets: tuple[int, ...] | None, index: int | None) -> None:
        self._new_record(_DCP, "MetadataIndex")
        self._open_dict(3)
        self._const("fqn")
        self._str(key)
        self._const("offset")
        if offsets is None:
            self._out += b"N"
        else:
            self._size(offsets)
        self._const("index")
        if index is None:
            self._out += b"N"
        else:
            self._int(index)
        self._out += b"ub"

    def _storage(self, file: str, offset: int, length: int) -> None:
        self._new_record(_FS, "_StorageInfo")
        self._open_dict(3)
        self._const("relative_path")
        self._fresh_str(file)
        self._const("offset")
        self._int(offset)
        self._const("length")
        self._int(length)
        self._out += b"ub"

    def _new_record(self, module: str, name: str) -> None:
        """``cls.__new__(cls)`` as NEWOBJ; the caller writes its state and BUILD."""
        self._global(module, name)
        self._out += b")\x81"
        self._put()

    def _size(self, values: tuple[int, ...]) -> None:
        self._call("torch", "Size", lambda: self._tuple(values))

    def _call(self, module: str, name: str, arg: Any) -> None:
        """``module.name(arg)``: a new object each time (REDUCE, then memoized)."""
        self._global(module, name)
        arg()
        self._out += b"\x85"
        self._put()
        self._out += b"R"
        self._put()

    # --- containers: the C pickler's batches ---------------------------------------------------------------

    def _open_dict(self, n: int) -> None:
        self._out += b"}"
        self._put()
        if n > 1:
            self._out += b"("

    def _item(self, count: int, n: int) -> int:
        """After an item of a dict of ``n``: close a full batch and open the next (the C pickler opens one
        more after the last full batch, empty if nothing is left)."""
        count += 1
        if n > 1 and count % _BATCH == 0:
            self._out += b"u("
        return count

    def _close(self, n: int) -> None:
        """The end of a dict of ``n`` items (one item is a SETITEM of its own)."""
        if n == 1:
            self._out += b"s"
        elif n > 1:
            self._out += b"u"

    # --- atoms ----------------------------------------------------------------------------------------------

    def _put(self) -> int:
        """Memoize the object just written (BINPUT): its slot."""
        slot = self._slots
        self._slots += 1
        self._out += _binput(slot)
        return slot

    def _get(self, slot: int) -> None:
        self._out += _binget(slot)

    def _global(self, module: str, name: str) -> None:
        qualified = f"{module} {name}"
        slot = self._names.get(qualified)
        if slot is not None:
            return self._get(slot)
        self._out += f"c{module}\n{name}\n".encode()
        self._names[qualified] = self._put()

    def _const(self, s: str) -> None:
        """A string constant of the pickle's own (a field name): one object, written once."""
        slot = self._names.get(s)
        if slot is not None:
            return self._get(slot)
        self._out += _unicode(s)
        self._names[s] = self._put()

    def _remember(self, obj: Any) -> None:
        self._memo[id(obj)] = self._put()
        self._keep.append(obj)

    def _fresh_str(self, s: str) -> None:
        self._out += _unicode(s)
        self._put()

    def _str(self, s: str) -> None:
        slot = self._memo.get(id(s))
        if slot is not None:
            return self._get(slot)
        self._out += _unicode(s)
        self._remember(s)

    def _int(self, v: int) -> None:
        self._out += _int(v)

    def _tuple(self, values: tuple) -> None:
        """A tuple of ints and strings; the caller's object, memoized by identity."""
        if not values:
            self._out += b")"
            return
        slot = self._memo.get(id(values))
        if slot is not None:
            self._out += _binget(slot)
            return
        body = self._int_tuples.get(values)
        if body is None and all(type(v) is int for v in values):
            body = self._int_tuples[values] = _int_tuple(values)
        if body is not None:
            self._out += body
            self._memo[id(values)] = slot = self._slots
            self._slots = slot + 1
            self._out += _binput(slot)
            self._keep.append(values)
            return
        else:
            self._out += b"(" if len(values) > 3 else b""
            for v in values:
                if type(v) is int:
                    self._int(v)
                else:
                    self._str(v)
            self._out += b"t" if len(values) > 3 else b"\x85\x86\x87"[len(values) - 1:len(values)]
        self._remember(values)


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
    """The opcodes of a tuple of ints, up to its BINPUT."""
    body = b"".join(map(_int, values))
    return b"(" + body + b"t" if len(values) > 3 else body + b"\x85\x86\x87"[len(values) - 1:len(values)]

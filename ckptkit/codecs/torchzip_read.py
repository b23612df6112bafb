"""``torch.save`` archives read as data: their pickles become trees with :class:`TensorRef` leaves.

A ``torch.save`` file is a zip of stored (uncompressed) records: ``data.pkl`` names each tensor's storage by
a persistent id, and ``data/<key>`` holds the storage bytes, 64-byte aligned. Reading needs no torch: the
central directory gives record offsets and :class:`SafeUnpickler` rebuilds tensors as byte spans.
"""

from __future__ import annotations

import collections
import io
import math
import os
import struct
import zipfile
from typing import Any

from ..core import dtypes
from ..core.boxes import extent, row_major
from ..core.dtypes import DType
from ..core.manifest import Span, TensorRef
from ..errors import FormatError
from .pickle_read import SafeUnpickler, check_tree, keep_call

__all__ = ["ARCHIVE_MAGIC", "OBJECT_GLOBALS", "TENSOR", "Tag", "is_archive", "load_blob", "read_archive"]


class _Window(io.RawIOBase):
    """``length`` bytes of an open file from ``start``, as a file of its own (zipfile finds its directory at
    the end). The first and last 4 KiB are read once: for a DCP chunk they hold every header zipfile reads,
    so parsing costs two reads instead of a dozen seeks."""

    _EDGE = 4096

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._start, self._len, self._pos = fd, start, length, 0
        self._head = os.pread(fd, min(length, self._EDGE), start)
        tail_at = max(0, length - self._EDGE)
        self._tail_at, self._tail = tail_at, os.pread(fd, length - tail_at, start + tail_at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._len}[whence] + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._len if n is None or n < 0 else min(self._len, self._pos + n)
        if end <= self._pos:
            return b""
        if end <= len(self._head):
            data = self._head[self._pos:end]
        elif self._pos >= self._tail_at:
            data = self._tail[self._pos - self._tail_at:end - self._tail_at]
        else:
            data = os.pread(self._fd, end - self._pos, self._start + self._pos)
        self._pos += len(data)
        return data


ARCHIVE_MAGIC = b"PK\x03\x04"


def is_archive(path: str, offset: int = 0) -> bool:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(4) == ARCHIVE_MAGIC


class _Storage:
    __slots__ = ("span", "dtype", "key")

    def __init__(self, span: Span, dtype: DType | None, key: str) -> None:
        self.span, self.dtype, self.key = span, dtype, key


_MAX_DIMS = 64


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tensor(storage: _Storage, offset: Any, size: Any, stride: Any, dtype: DType | None) -> TensorRef:
    dtype = dtype or storage.dtype or dtypes.by_name("uint8")
    where = f"{storage.span.file}: the tensor on storage {storage.key!r}"
    if not isinstance(dtype, DType):
        raise FormatError(f"{where} has dtype {dtype!r}, not a torch dtype")
    ok = isinstance(size, (tuple, list)) and isinstance(stride, (tuple, list)) and len(size) <= _MAX_DIMS
    if not (ok and _count(offset) and all(map(_count, size)) and all(map(_count, stride))):
        raise FormatError(f"{where} has offset {offset!r:.40}, shape {size!r:.60} and strides {stride!r:.60}; "
                          "expected non-negative integers")
    shape, stride = tuple(size), tuple(stride)
    if len(stride) != len(shape):
        raise FormatError(f"{where} has shape {list(shape)} and strides {list(stride)}, not one per dimension")
    need = (offset + extent(shape, stride)) * dtype.itemsize if math.prod(shape) else 0
    if need > storage.span.length:
        # torch refuses it too ("out of bounds for storage of size ..."): the tensor would read other records.
        raise FormatError(f"{where}: offset {offset} and {dtype} {list(shape)} with strides {list(stride)} need "
                          f"{need} bytes, the storage holds {storage.span.length}")
    skip = min(offset * dtype.itemsize, storage.span.length)
    span = Span(storage.span.file, storage.span.offset + skip, storage.span.length - skip)
    strides = None if shape == () or stride == row_major(shape) else stride
    return TensorRef(dtype, shape, span, strides)


def _rebuild_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _tensor(_storage_of(storage), offset, size, stride, None)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _tensor(_storage_of(storage), offset, size, stride, dtype)


def _storage_of(storage: Any) -> _Storage:
    if not isinstance(storage, _Storage):
        raise FormatError(f"a tensor is rebuilt from {type(storage).__name__}, not from a storage record")
    return storage


class _StorageTag:
    """A storage class named in a persistent id (``torch.FloatStorage``): only its dtype matters."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: DType | None) -> None:
        self.dtype = dtype


def _storage_class(dtype: DType | None) -> _StorageTag:
    return _StorageTag(dtype)


class Tag:
    """A torch global that a pickle passes as a value and ckptkit never calls (``torch.Tensor`` as the type
    in ``_rebuild_from_type_v2``, a tensor subclass)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


TENSOR = Tag("torch.Tensor")


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    # A plain tensor carrying Python attributes (FSDP1 marks the tensors of its state dicts, e.g.
    # "_has_been_cloned"): the attributes go, the tensor stays. Tensor subclasses are refused.
    if new_type is not TENSOR or func not in (_rebuild_v2, _rebuild_v3):
        raise FormatError(f"a tensor subclass {new_type!r} rebuilt by {getattr(func, '__name__', func)!r}; "
                          "ckptkit reads plain tensors (and, in LOCAL checkpoints, ShardedTensor)")
    return func(*args)


def _bytes_arg(args: tuple, what: str) -> bytes:
    """What protocol 2 pickles ``bytes`` and ``bytearray`` values as: ``(text, "latin1")``, or bytes given as
    they are. Never a size (``bytearray(10**10)`` would allocate it) nor another codec."""
    if not args:
        return b""
    value = args[0]
    if isinstance(value, (bytes, bytearray)) and len(args) == 1:
        return bytes(value)
    if isinstance(value, str) and len(args) == 2 and args[1] in ("latin1", "latin-1"):
        return value.encode("latin-1")
    raise FormatError(f"the pickle calls {what}{tuple(type(a).__name__ for a in args)}; ckptkit allows it only "
                      "to spell bytes (text and 'latin1')")


# Globals a tensor-bearing pickle may name. Everything maps to data; nothing runs code of the checkpoint's.
OBJECT_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): lambda data, requires_grad=False, hooks=None: data,
    ("torch._utils", "_rebuild_parameter_with_state"): lambda data, requires_grad, hooks, state: data,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): TENSOR,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): lambda *args: bytearray(_bytes_arg(args, "bytearray")),
    ("_codecs", "encode"): lambda *args: _bytes_arg(args, "_codecs.encode"),
    ("torch", "Size"): keep_call("torch", "Size"),
    ("torch", "device"): keep_call("torch", "device"),
    ("torch.serialization", "_get_layout"): keep_call("torch.serialization", "_get_layout"),
    ("torch.storage", "UntypedStorage"): _storage_class(None),
    ("torch", "UntypedStorage"): _storage_class(None),
    **{("torch", d.name): d for d in dtypes.DTYPES},
    **{("torch", d.storage_class): _storage_class(d) for d in dtypes.DTYPES if d.storage_class},
}


def _records(window: _Window, path: str) -> dict[str, Span]:
    start, length = window._start, window._len
    try:
        infos = zipfile.ZipFile(window).infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise FormatError(f"{path} @ {start}: not a torch.save archive ({e})") from e
    out = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(f"{path}: record {info.filename} is compressed; torch.save archives store records raw")
        window.seek(info.header_offset)
        head = window.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise FormatError(f"{path}: bad local header for record {info.filename}")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        data = info.header_offset + 30 + name_len + extra_len
        if data + info.file_size > length:
            raise FormatError(f"{path}: record {info.filename} runs past the end of the archive")
        out[info.filename] = Span(path, start + data, info.file_size)
    return out


def read_archive(path: str, start: int = 0, length: int | None = None, *, where: str = "",
                 extra_globals: dict | None = None, fd: int | None = None, tree: bool = True) -> Any:
    """Unpickle the archive's ``data.pkl`` with tensors as :class:`TensorRef` byte spans into ``path``.

    ``fd``, an open descriptor of ``path``, saves an open per call when reading many chunks of one file.
    ``tree`` checks that what the pickle built can be walked as a tree (:func:`check_tree`); a caller that
    only takes one tensor out of it (a DCP chunk) may skip that.
    """
    where = where or path
    own = fd is None
    file_fd = os.open(path, os.O_RDONLY) if fd is None else fd
    try:
        if length is None:
            length = os.fstat(file_fd).st_size - start
        window = _Window(file_fd, start, length)
        records = _records(window, path)
        pkl = [n for n in records if n.endswith("data.pkl") and n.count("/") <= 1]
        if len(pkl) != 1:
            raise FormatError(f"{where}: no data.pkl record; not a torch.save archive "
                              "(legacy pre-1.6 files are not supported)")
        prefix = pkl[0][: -len("data.pkl")]
        window.seek(records[pkl[0]].offset - start)
        data = window.read(records[pkl[0]].length)
    finally:
        if own:
            os.close(file_fd)

    def persistent_load(pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise FormatError(f"{where}: unexpected persistent id {pid!r}")
        _, tag, key, _location, numel = pid
        if not isinstance(tag, _StorageTag):
            raise FormatError(f"{where}: persistent id names {tag!r}, not a storage class")
        span = records.get(f"{prefix}data/{key}")
        if span is None:
            raise FormatError(f"{where}: data.pkl names storage {key!r} but the archive has no record "
                              f"{prefix}data/{key}")
        itemsize = tag.dtype.itemsize if tag.dtype else 1
        if not _count(numel) or numel * itemsize != span.length:
            # torch refuses such a record ("record size ... does not match expected size"), mmap or not aside.
            raise FormatError(f"{where}: record {prefix}data/{key} holds {span.length} bytes, but data.pkl says its "
                              f"storage has {numel!r:.40} elements of {itemsize} bytes")
        return _Storage(span, tag.dtype, f"data/{key}")

    allowed = {**OBJECT_GLOBALS, **(extra_globals or {})}
    value = SafeUnpickler(data, allowed, where=where, persistent_load=persistent_load).load_checked()
    if tree:
        check_tree(value, where, budget=len(data) + 1000)
    return value


def load_blob(span: Span, *, where: str) -> Any:
    return read_archive(span.file, span.offset, span.length, where=where)

"""``torch.save`` archives read as data: their pickles become trees with :class:`TensorRef` leaves.

A ``torch.save`` file is a zip of stored (uncompressed) records: ``data.pkl`` names each tensor's storage by
a persistent id, and ``data/<key>`` holds the storage bytes, 64-byte aligned. Reading needs no torch: the
central directory gives record offsets and :class:`SafeUnpickler` rebuilds tensors as byte spans.
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
import re
import struct
from collections.abc import Callable
from typing import Any

from ..core import dtypes
from ..core.boxes import extent, row_major
from ..core.dtypes import DType
from ..core.manifest import Span, TensorRef
from ..errors import FormatError
from ..io.sources import opened
from .pickle_read import BytesIOData, SafeUnpickler, check_tree, keep_call, strided_layout

__all__ = ["ARCHIVE_MAGIC", "OBJECT_GLOBALS", "TENSOR", "WRAPPER_SUBCLASS", "ArchiveCache", "Tag", "archive_edges",
           "is_archive", "load_blob", "read_archive", "subclass_rebuild"]


class _Window(io.RawIOBase):
    """``length`` bytes of an open file from ``start``, as a file of its own (the zip directory is at the end).
    The first and last 4 KiB are read once: for a DCP chunk they hold every header :func:`_records` reads, so
    parsing costs two reads instead of a dozen seeks."""

    _EDGE = 4096

    def __init__(self, pread: Callable[[int, int], bytes], start: int, length: int) -> None:
        self._pread, self._start, self._len, self._pos = pread, start, length, 0
        self.reads: list[tuple[int, int]] = []
        """Every byte range the parser asked for, so that :class:`ArchiveCache` knows what its checks saw."""
        self.holes: list[tuple[int, int, bool]] = []
        """Byte ranges ``(start, end, text)`` whose values neither torch nor the checks use (CRC-32s), or use
        only as UTF-8 text (``text``: the serialization id): what may differ between archives of one framing."""
        self.descriptors: list[int] = []
        """Where the data descriptors of records written with one (flag bit 3) would begin."""
        self._head = pread(min(length, self._EDGE), start)
        tail_at = max(0, length - self._EDGE)
        self._tail_at, self._tail = tail_at, pread(length - tail_at, start + tail_at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self._len}[whence] + offset
        return self._pos

    def read(self, n: int = -1, *, seen: bool = True) -> bytes:
        """``n`` bytes from the position; ``seen=False`` leaves them out of :attr:`reads` (the caller notes the
        part its result depends on)."""
        end = self._len if n is None or n < 0 else min(self._len, self._pos + n)
        if end <= self._pos:
            return b""
        if seen:
            self.reads.append((self._pos, end))
        if end <= len(self._head):
            data = self._head[self._pos:end]
        elif self._pos >= self._tail_at:
            data = self._tail[self._pos - self._tail_at:end - self._tail_at]
        else:
            data = self._pread(end - self._pos, self._start + self._pos)
        self._pos += len(data)
        return data


def archive_edges(start: int, length: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The byte ranges (start, end) :func:`read_archive` reads first from an archive of ``length`` bytes at
    ``start``: a reader of remote chunks fetches them ahead."""
    tail_at = max(0, length - _Window._EDGE)
    return (start, start + min(length, _Window._EDGE)), (start + tail_at, start + length)


ARCHIVE_MAGIC = b"PK\x03\x04"


def is_archive(path: str, offset: int = 0) -> bool:
    with opened(path) as (pread, _):
        return pread(4, offset) == ARCHIVE_MAGIC


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
    return _flags(_tensor(_storage_of(storage), offset, size, stride, None), requires_grad, metadata)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _flags(_tensor(_storage_of(storage), offset, size, stride, dtype), requires_grad, metadata)


def _flags(t: TensorRef, requires_grad: Any, metadata: Any = None) -> TensorRef:
    """What torch checks as it rebuilds a tensor: a boolean requires_grad, only on a floating tensor, and a dict
    (or nothing) of metadata. ckptkit keeps neither, but a file torch refuses must be refused here too."""
    if not isinstance(requires_grad, bool) or (requires_grad and t.dtype.kind not in ("float", "complex")):
        raise FormatError(f"{t.span.file}: a {t.dtype} tensor says requires_grad={requires_grad!r:.20}, which torch "
                          "refuses")
    if metadata is not None and not isinstance(metadata, dict):
        raise FormatError(f"{t.span.file}: a tensor carries metadata {metadata!r:.40}, where torch expects a dict")
    return t


def _parameter(data: Any, requires_grad: Any, state: Any = None) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise FormatError(f"a Parameter is rebuilt from {type(data).__name__}, not from a tensor")
    return _plain_state(_flags(data, requires_grad), state)


# torch.Tensor's own attributes (its data descriptors, torch 2.13; a Parameter has no others).
_TENSOR_ATTRIBUTES = frozenset({
    "H", "T", "__class__", "__cuda_array_interface__", "__dict__", "__weakref__", "_backward_hooks", "_base",
    "_cdata", "_grad", "_grad_fn", "_has_symbolic_sizes_strides", "_post_accumulate_grad_hooks", "_python_dispatch",
    "_version", "data", "device", "dtype", "grad", "grad_dtype", "grad_fn", "imag", "is_cpu", "is_cuda", "is_ipu",
    "is_leaf", "is_maia", "is_meta", "is_mkldnn", "is_mps", "is_mtia", "is_nested", "is_quantized", "is_sparse",
    "is_sparse_csr", "is_vulkan", "is_xla", "is_xpu", "itemsize", "layout", "mH", "mT", "name", "nbytes", "ndim",
    "output_nr", "real", "requires_grad", "retains_grad", "shape", "volatile"})


def _plain_state(t: TensorRef, state: Any) -> TensorRef:
    """The state a pickled tensor carries, held to what torch's ``_set_obj_state`` sets without changing the
    tensor: a dict of Python attributes, or a ``(dict, slots)`` pair, or nothing. ckptkit drops them; torch
    setattr()s each, and one of the tensor's own (``data``, ``real``) would change what torch loads, or fail."""
    parts = state if isinstance(state, tuple) else (state, None)
    if len(parts) != 2 or any(part and not isinstance(part, dict) for part in parts):
        raise FormatError(f"{t.span.file}: a tensor carries state {state!r:.60}, which torch cannot set on it")
    for name in (name for part in parts if part for name in part):
        if not isinstance(name, str) or name in _TENSOR_ATTRIBUTES:
            raise FormatError(f"{t.span.file}: a tensor's pickled state sets the tensor's own attribute {name!r:.40}; "
                              "torch would set it on the tensor it loads, changing it or failing")
    return t


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
    # "_has_been_cloned"): the attributes go, the tensor stays (unless one is the tensor's own). Tensor
    # subclasses are refused.
    if new_type is not TENSOR or func not in (_rebuild_v2, _rebuild_v3):
        raise FormatError(f"a tensor subclass {new_type!r} rebuilt by {getattr(func, '__name__', func)!r}; "
                          "ckptkit reads plain tensors (and, in LOCAL checkpoints, ShardedTensor)")
    return _plain_state(func(*args), state)


WRAPPER_SUBCLASS = Tag("torch._utils._rebuild_wrapper_subclass")
"""How torch pickles a wrapper tensor subclass (DTensor, ShardedTensor): ``_rebuild_from_type_v2`` of it."""


def subclass_rebuild(where: str, subclass: Tag, build: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """A ``_rebuild_from_type_v2`` for an allow-list: plain tensors as usual, the wrapper subclass ``subclass``
    as ``build(args, state)``; any other subclass, or a malformed one, is refused naming ``where``."""
    name = subclass.name.rsplit(".", 1)[-1]

    def rebuild(func: Any, new_type: Any, args: Any, state: Any) -> Any:
        if new_type is TENSOR:
            return _rebuild_from_type(func, new_type, args, state)
        if func is not WRAPPER_SUBCLASS or new_type is not subclass:
            raise FormatError(f"{where}: a tensor subclass rebuilt by {func!r} as {new_type!r}; ckptkit reads "
                              f"only torch's {name} among tensor subclasses here")
        try:
            return build(args, state)
        except (TypeError, ValueError, AttributeError, IndexError, KeyError) as e:
            raise FormatError(f"{where}: malformed {name} pickle ({type(e).__name__}: {e})") from e

    return rebuild


# The device types torch names (c10's DeviceType); torch.device refuses any other string.
_DEVICE = re.compile(r"(cpu|cuda|meta|mps|xpu|hpu|xla|lazy|ipu|mtia|maia|privateuseone|ve|vulkan|metal|fpga|hip|mkldnn|"
                     r"opengl|opencl|ideep)(:\d+)?")


def _device_args(args: tuple) -> tuple:
    def index(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    ok = (len(args) == 1 and (index(args[0]) or isinstance(args[0], str) and _DEVICE.fullmatch(args[0]))) or (
        len(args) == 2 and isinstance(args[0], str) and _DEVICE.fullmatch(args[0]) and ":" not in args[0]
        and index(args[1]))
    if not ok:
        raise FormatError(f"the pickle names torch.device{args!r:.60}, which torch does not know")
    return args


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
    ("torch._utils", "_rebuild_parameter"): lambda data, requires_grad=False, hooks=None: _parameter(
        data, requires_grad),
    ("torch._utils", "_rebuild_parameter_with_state"): lambda data, requires_grad, hooks, state: _parameter(
        data, requires_grad, state),
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): TENSOR,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_io", "BytesIO"): BytesIOData,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): lambda *args: bytearray(_bytes_arg(args, "bytearray")),
    ("_codecs", "encode"): lambda *args: _bytes_arg(args, "_codecs.encode"),
    ("torch", "Size"): keep_call("torch", "Size"),
    ("torch", "device"): lambda *args: keep_call("torch", "device")(*_device_args(args)),
    ("torch.serialization", "_get_layout"): strided_layout,
    ("torch.storage", "UntypedStorage"): _storage_class(None),
    ("torch", "UntypedStorage"): _storage_class(None),
    **{("torch", d.name): d for d in dtypes.DTYPES},
    **{("torch", d.storage_class): _storage_class(d) for d in dtypes.DTYPES if d.storage_class},
}

# What torch.load(weights_only=True) unpickles, as DCP's reader loads every chunk (torch's
# _weights_only_unpickler, 2.13): OBJECT_GLOBALS less four it refuses, and fewer opcodes than Python's.
_WEIGHTS_ONLY_GLOBALS = {k: v for k, v in OBJECT_GLOBALS.items()
                         if k not in {("builtins", "frozenset"), ("builtins", "slice"), ("torch", "UntypedStorage"),
                                       ("_io", "BytesIO")}}
_WEIGHTS_ONLY_OPCODES = frozenset({
    "PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT",
    "EMPTY_SET", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID",
    "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"})


def _weights_only_opcodes(data: bytes, where: str) -> None:
    """Refuse a pickle (that Python's unpickler read) using an opcode torch's weights-only unpickler lacks."""
    import pickletools

    for op, _, pos in pickletools.genops(data):
        if op.name not in _WEIGHTS_ONLY_OPCODES:
            raise FormatError(f"{where}: the pickle uses opcode {op.name} (byte {pos}), which torch.load refuses "
                              "with weights_only=True, as DCP loads a chunk")


_EOCD = struct.Struct("<4sHHHHIIH")                 # end of central directory, 22 bytes
_EOCD64_LOCATOR = struct.Struct("<4sIQI")           # 20 bytes, just before it in a zip64 archive
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")             # 56 bytes
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")     # central directory entry, 46 bytes
_LOCAL = struct.Struct("<4sHHHHHIIIHH")             # local file header, 30 bytes
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_MAX_VERSION = 10  # torch 2.13 reads archive versions 1 to 10 (kMaxSupportedFileFormatVersion)


def _zip64_values(extra: bytes, wanted: int) -> list[int]:
    """The 8-byte values a zip64 extra field holds (the sizes and offset that did not fit in 32 bits)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            body = extra[pos + 4:pos + 4 + size]
            return list(struct.unpack_from(f"<{wanted}Q", body)) if len(body) >= 8 * wanted else []
        pos += 4 + size
    return []


def _records(window: _Window, path: str, where: str) -> dict[str, Span]:
    """Record name to the span of its bytes, read from the zip's central directory and held to what torch's
    reader (miniz, then PyTorchStreamReader) accepts: one disk, a central directory exactly where the end
    record puts it, stored records whose local headers are where the directory says, every record in one
    ``archive_name/`` directory. What Python's zipfile forgives (data before the archive, say), torch does not."""
    start, length = window._start, window._len

    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: not a torch.save archive torch can read ({what})")

    # The end record is the archive's last 22 bytes unless a comment follows it (up to 64 KiB): look in the
    # window's tail first, which a remote read fetched already, and further back only if it is not there.
    for tail_len in (min(length, _Window._EDGE), min(length, _EOCD.size + 0xFFFF)):
        window.seek(length - tail_len)
        tail = window.read(tail_len, seen=False)
        at = tail.rfind(b"PK\x05\x06")
        if at >= 0 and at + _EOCD.size <= len(tail):
            break
    else:
        raise bad("no end of central directory record; truncated?")
    _, disk, cd_disk, on_disk, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    eocd = length - tail_len + at
    window.reads.append((eocd, length))  # the last signature: what lies before it cannot change where it is
    if eocd + _EOCD.size + comment != length:
        raise bad(f"{length - eocd - _EOCD.size - comment} bytes after the end of the central directory")
    end_of_cd = eocd
    window.seek(max(0, eocd - _EOCD64_LOCATOR.size))
    locator = window.read(_EOCD64_LOCATOR.size) if eocd >= _EOCD64_LOCATOR.size else b""
    if locator[:4] == b"PK\x06\x07":  # torch's writer (miniz) always adds the zip64 records, and its reader uses them
        _, _, where64, disks = _EOCD64_LOCATOR.unpack(locator)
        window.seek(where64)
        record = window.read(_EOCD64.size)
        if len(record) != _EOCD64.size or record[:4] != b"PK\x06\x06" or where64 + _EOCD64.size > eocd:
            raise bad("a damaged zip64 end record")
        _, size64, _, _, disk, cd_disk, on_disk, count, cd_size, cd_offset = _EOCD64.unpack(record)
        if disks != 1 or size64 < _EOCD64.size - 12:  # miniz refuses either; its size leaves out 12 bytes
            raise bad(f"a zip64 end record of {size64} bytes, on {disks} disks; torch's reader takes one disk and "
                      f"at least {_EOCD64.size - 12} bytes")
        end_of_cd = where64
    elif _U16 in (disk, cd_disk, on_disk, count) or _U32 in (cd_size, cd_offset):
        raise bad("zip64 values without a zip64 end record")
    if disk != 0 or cd_disk != 0 or on_disk != count:
        raise bad("parts of it on other disks")
    if cd_size < count * _CENTRAL.size or cd_offset + cd_size != end_of_cd:
        raise bad(f"the central directory at {cd_offset} ({cd_size} bytes) does not end where its end record is")
    window.seek(cd_offset)
    cd = window.read(cd_size)
    out: dict[str, Span] = {}
    prefix = None
    folded: set[bytes] = set()
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(cd):
            raise bad("the central directory is shorter than its entries")
        (sig, _, _, flags, method, _, _, _, comp, size, name_len, extra_len, comment_len, entry_disk, _, attributes,
         offset) = _CENTRAL.unpack_from(cd, pos)
        window.holes.append((cd_offset + pos + 16, cd_offset + pos + 20, False))  # the CRC-32: torch never checks it
        raw = cd[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]
        extra = cd[pos + _CENTRAL.size + name_len:pos + _CENTRAL.size + name_len + extra_len]
        pos += _CENTRAL.size + name_len + extra_len + comment_len
        if sig != b"PK\x01\x02" or pos > len(cd):
            raise bad("a damaged central directory entry")
        try:
            name = raw.decode("utf-8")  # torch hands record names to Python as UTF-8 text
        except UnicodeDecodeError:
            raise bad(f"record name {raw!r:.60} is not UTF-8") from None
        # miniz takes a record for a directory by its DOS attributes or a name ending in "/", and then reads none
        # of its bytes, nor says so. torch looks up no name ending in "/" but a storage's (see _parse): entries
        # that zip -r writes for the folders are never read.
        if attributes & 0x10 and not name.endswith("/"):
            raise bad(f"record {name} is a directory to torch's zip reader, which reads none of its bytes")
        wide = [v for v in (size, comp, offset) if v == _U32]
        if wide:
            values = iter(_zip64_values(extra, len(wide)))
            size, comp, offset = (next(values, -1) if v == _U32 else v for v in (size, comp, offset))
        if method != 0 or flags & 0x2061:  # encrypted, patch data, strong encryption, masked: miniz refuses them
            raise bad(f"record {name} is compressed or encrypted; torch.save archives store records raw")
        if comp != size or entry_disk != 0 or offset < 0 or offset + _LOCAL.size + size > length:
            raise bad(f"record {name} has inconsistent sizes or lies outside the archive")
        window.seek(offset)
        head = window.read(_LOCAL.size)
        if len(head) != _LOCAL.size or head[:4] != b"PK\x03\x04":
            raise bad(f"no local header where the directory puts record {name}")
        local_name, local_extra = struct.unpack_from("<HH", head, 26)
        data = offset + _LOCAL.size + local_name + local_extra
        if data + size > length:
            raise bad(f"record {name} runs past the end of the archive")
        first, slash, _ = name.partition("/")
        prefix = prefix if prefix is not None else first + slash
        if not slash or not name.startswith(prefix):
            raise bad(f"record {name} is not in the directory {prefix or name!r} every record shares")
        if name[len(prefix):].partition("\0")[0] == "constants.pkl":  # torch lists the names as C strings
            raise bad(f"record {name}: torch.load takes an archive with a constants.pkl for TorchScript, and "
                      "loads it with torch.jit.load (or, with weights_only=True, refuses it)")
        if raw.lower() in folded:  # miniz finds a name by binary search, ignoring (ASCII) case: any of them
            raise bad(f"two records named {name} (in any case); torch's zip reader may read either")
        folded.add(raw.lower())
        out[name[len(prefix):]] = Span(path, start + data, size)
        if flags & 0x8:
            window.descriptors.append(data + size)
    _check_small_records(out, window, start, bad)
    return out


def _check_small_records(records: dict[str, Span], window: _Window, start: int, bad) -> None:
    """The records torch reads before the pickle: the format version, the byte order, the alignment."""
    def read(name: str) -> bytes | None:
        span = records.get(name)
        if span is None:
            return None
        if span.length > 256:  # torch parses or decodes all of it: a check of a part would not be torch's
            raise bad(f"record {name} holds {span.length} bytes; ckptkit reads up to 256 (torch.save "
                      "writes a few)")
        window.seek(span.offset - start)
        return window.read(span.length)

    version = read(".data/version") if ".data/version" in records else read("version")
    number = re.match(rb"\s*[-+]?\d+", version or b"")
    if version is None or number is None or not 1 <= int(number.group()) <= _MAX_VERSION:
        raise bad(f"its version record is {version!r:.40}; torch reads versions 1 to {_MAX_VERSION}")
    order = read("byteorder")
    if order not in (None, b"little"):
        raise bad(f"byte order {order!r:.40}; ckptkit reads little-endian archives (torch would byte-swap a "
                  "big-endian one)")
    alignment = read(".storage_alignment")
    if alignment is not None and not re.fullmatch(rb"\s*[-+]?\d+\s*", alignment):
        raise bad(f"storage alignment {alignment!r:.40} is not a number")
    serial = read(".data/serialization_id")
    if serial:  # torch.save writes a new one into every archive; torch.load only decodes it
        at = records[".data/serialization_id"].offset - start
        window.holes.append((at, at + len(serial), True))
    try:
        (serial or b"").decode("utf-8")  # torch hands it to Python as text
    except UnicodeDecodeError:
        raise bad(f"serialization id {serial!r:.60} is not UTF-8 text") from None


def read_archive(path: str, start: int = 0, length: int | None = None, *, where: str = "",
                 extra_globals: dict | None = None, pread: Callable[[int, int], bytes] | None = None,
                 tree: bool = True) -> Any:
    """Unpickle the archive's ``data.pkl`` with tensors as :class:`TensorRef` byte spans into ``path``.

    ``pread``, ``os.pread`` bound to an open ``path`` (:meth:`Files.pread`), saves an open per call when
    reading many chunks of one file; ``path`` may be a URL. ``tree`` checks that what the pickle built can be
    walked as a tree (:func:`check_tree`); a caller that only takes one tensor out of it (a DCP chunk) may skip
    that.
    """
    where = where or path
    with contextlib.ExitStack() as stack:
        if pread is None:
            pread, size = stack.enter_context(opened(path))
            length = size - start if length is None else length
        assert length is not None, "a caller passing pread passes the archive's length"
        value, data, _, _ = _parse(_Window(pread, start, length), path, where, extra_globals)
    if tree:
        check_tree(value, where, budget=len(data) + 1000, refuse=(_Storage, _StorageTag, Tag))
    return value


def _parse(window: _Window, path: str, where: str, extra_globals: dict | None, *,
           weights_only: bool = False) -> tuple[Any, bytes, dict[str, Span], list[_Storage]]:
    """The archive's value, its ``data.pkl``, its records, and the storages the pickle named. ``weights_only``:
    held to what ``torch.load(weights_only=True)`` unpickles."""
    start = window._start
    records = _records(window, path, where)
    if "data.pkl" not in records:
        raise FormatError(f"{where}: no data.pkl record; not a torch.save archive "
                          "(legacy pre-1.6 files are not supported)")
    window.seek(records["data.pkl"].offset - start)
    data = window.read(records["data.pkl"].length)
    storages: list[_Storage] = []

    def persistent_load(pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise FormatError(f"{where}: unexpected persistent id {pid!r}")
        _, tag, key, _location, numel = pid
        if not isinstance(tag, _StorageTag):
            raise FormatError(f"{where}: persistent id names {tag!r}, not a storage class")
        span = records.get(f"data/{key}")
        if span is None:
            raise FormatError(f"{where}: data.pkl names storage {key!r} but the archive has no record data/{key}")
        if f"data/{key}".endswith("/"):
            raise FormatError(f"{where}: not a torch.save archive torch can read (record data/{key} is a directory "
                              "to torch's zip reader, which reads none of its bytes)")
        itemsize = tag.dtype.itemsize if tag.dtype else 1
        if not _count(numel) or numel * itemsize != span.length:
            # torch refuses such a record ("record size ... does not match expected size"), mmap or not aside.
            raise FormatError(f"{where}: record data/{key} holds {span.length} bytes, but data.pkl says its "
                              f"storage has {numel!r:.40} elements of {itemsize} bytes")
        storages.append(_Storage(span, tag.dtype, f"data/{key}"))
        return storages[-1]

    allowed = _WEIGHTS_ONLY_GLOBALS if weights_only else {**OBJECT_GLOBALS, **(extra_globals or {})}
    value = SafeUnpickler(data, allowed, where=where, persistent_load=persistent_load).load_checked()
    if weights_only:
        _weights_only_opcodes(data, where)
    return value, data, records, storages


class _Framing:
    """A checked tensor archive's bytes outside its tensor data (``head`` before it, ``tail`` after it), the
    ranges among them that may differ between archives of this framing (:attr:`_Window.holes`), and the
    tensor it holds (offsets relative to the archive).

    A hole is *active* once an archive differed there (torch.save's serialization id and the CRC-32s of its
    records do, from chunk to chunk); only active holes are skipped when comparing, so archives that are
    all alike (ckptkit's) cost two compares each."""

    __slots__ = ("head", "tail", "length", "holes", "active", "pieces", "texts", "dtype", "shape", "strides",
                 "offset", "nbytes")

    def __init__(self, head: bytes, tail: bytes, holes: list[tuple[int, int, bool]], ref: TensorRef,
                 start: int) -> None:
        self.head, self.tail, self.length = head, tail, len(head) + ref.span.length + len(tail)
        self.dtype, self.shape, self.strides = ref.dtype, ref.shape, ref.strides
        self.offset, self.nbytes = ref.span.offset - start, ref.span.length
        self.holes, self.active = holes, list[tuple[int, int, bool]]()
        self.pieces, self.texts = self._split(self.active)

    def _at(self, a: int, b: int) -> tuple[bool, int, int | None]:
        """Bytes ``[a, b)`` of the archive as a slice ``(in tail, from, to)`` of an archive's head or tail;
        offsets into the tail count from the archive's end, so that a longer tail read does not move them."""
        return (False, a, b) if b <= self.offset else (True, a - self.length, (b - self.length) or None)

    def _split(self, holes: list[tuple[int, int, bool]]) -> tuple[list[tuple[bool, int, bytes]],
                                                                     list[tuple[bool, int, int | None]]]:
        """The pieces to compare (where, as :meth:`_at` says, and the bytes expected there) between ``holes``
        and the data; the text to decode."""
        lo, hi = self.offset, self.offset + self.nbytes
        pieces, at = [], 0
        for a, b in sorted([*((a, b) for a, b, _ in holes), (lo, hi), (self.length, self.length)]):
            if a > at:
                in_tail, start, _ = self._at(at, a)
                pieces.append((in_tail, start, self.head[at:a] if a <= lo else self.tail[at - hi:a - hi]))
            at = max(at, b)
        return pieces, [self._at(a, b) for a, b, text in holes if text]

    def matches(self, head: bytes, tail: bytes, *, loose: bool = False) -> bool:
        """Whether an archive of this length that starts with ``head`` and ends with ``tail`` (each at least
        as long as this framing's; both may be the whole archive) is framed as this one. ``loose``: all holes
        skipped, not only the active ones; the holes where the archive differs become active."""
        if not (loose or self.active):  # archives all alike (ckptkit's)
            return head.startswith(self.head) and tail.endswith(self.tail)
        pieces, texts = self._split(self.holes) if loose else (self.pieces, self.texts)
        for in_tail, a, want in pieces:
            if not (tail if in_tail else head).startswith(want, a):  # compares in place, without a copy
                return False
        for in_tail, a, b in texts:
            try:
                (tail if in_tail else head)[a:b].decode("utf-8")
            except UnicodeDecodeError:  # the full read names the fault
                return False
        if loose:
            self.active = [h for h in self.holes if h in self.active or self._differs(head, tail, h)]
            self.pieces, self.texts = self._split(self.active)
        return True

    def _differs(self, head: bytes, tail: bytes, hole: tuple[int, int, bool]) -> bool:
        """Whether the archive's bytes in ``hole`` differ from this framing's."""
        in_tail, a, b = self._at(hole[0], hole[1])
        hi = self.offset + self.nbytes
        mine = self.tail[hole[0] - hi:hole[1] - hi] if in_tail else self.head[a:b]
        return (tail if in_tail else head)[a:b] != mine

    def ref(self, path: str, start: int) -> TensorRef:
        return TensorRef(self.dtype, self.shape, Span(path, start + self.offset, self.nbytes), self.strides)


class ArchiveCache:
    """The one-tensor archives of a DCP checkpoint (one per chunk), each checked in full once per framing.

    ``torch.save`` writes the same bytes around the tensor data of every chunk of one dtype and shape: local
    headers, ``data.pkl``, the small records, the central directory, all with offsets relative to the archive,
    except for a serialization id of the same length and the records' CRC-32s, which torch never checks.
    :meth:`read` parses and checks an archive as :func:`read_archive` does, and remembers its bytes outside
    the tensor data when the checks read none of the data. :meth:`lookup` then takes any archive of the same
    length whose bytes outside the data are those same bytes, but for those holes (a serialization id must
    still be UTF-8 text, as torch decodes it): the checks, a function of exactly those bytes, would find the
    same tensor at the same place. It costs a read of the head and the tail and a compare, instead of a zip
    and pickle parse (a 1M-chunk checkpoint has 1M archives).
    """

    _KEEP = 8  # framings remembered per archive length; a checkpoint has a handful (one per dtype and shape)
    _WHOLE = 16384  # archives up to this size are read in one piece

    def __init__(self) -> None:
        self._by_length: dict[int, tuple[int, int, list[_Framing]]] = {}  # (longest head, longest tail, framings)

    def lookup(self, pread: Callable[[int, int], bytes], path: str, start: int, length: int) -> TensorRef | None:
        """The tensor of the archive at ``start`` if its framing is one already checked, else None."""
        framing = self.find(pread, start, length)
        return None if framing is None else framing.ref(path, start)

    def find(self, pread: Callable[[int, int], bytes], start: int, length: int) -> _Framing | None:
        """:meth:`lookup`'s framing, which tells the tensor's dtype, shape, strides, and ``offset`` and ``nbytes``
        in the archive, without making a :class:`TensorRef`."""
        known = self._by_length.get(length)
        if known is None:
            return None
        head_len, tail_len, framings = known
        if length <= self._WHOLE:
            head = tail = pread(length, start)  # offsets into the tail count from the end: the whole serves
            if len(head) != length:  # the file ends early; the full read says so
                return None
        else:
            head, tail = pread(head_len, start), pread(tail_len, start + length - tail_len)
            if len(tail) != tail_len or len(head) != head_len:
                return None
        for f in framings:
            if f.matches(head, tail):
                return f
        for f in framings:
            if f.holes and f.matches(head, tail, loose=True):
                return f
        return None

    def read(self, path: str, start: int, length: int, *, pread: Callable[[int, int], bytes], where: str) -> Any:
        """:func:`read_archive` of the archive at ``start`` (``tree=False``), remembering its framing; its pickle
        held to what ``torch.load(weights_only=True)`` reads, as DCP loads a chunk."""
        window = _Window(pread, start, length)
        value, _, _, storages = _parse(window, path, where or path, None, weights_only=True)
        _, _, framings = self._by_length.get(length, (0, 0, []))
        if isinstance(value, TensorRef) and len(storages) == 1 and len(framings) < self._KEEP:
            lo, hi = storages[0].span.offset - start, storages[0].span.offset - start + storages[0].span.length
            if 0 <= lo <= hi <= length and all(end <= lo or begin >= hi for begin, end in window.reads):
                head, tail = pread(lo, start), pread(length - hi, start + hi)
                if len(head) == lo and len(tail) == length - hi:
                    framings.append(_Framing(head, tail, _holes(window, head, tail, lo, hi), value, start))
                    self._by_length[length] = (max(len(f.head) for f in framings),
                                               max(len(f.tail) for f in framings), framings)
        return value


def _holes(window: _Window, head: bytes, tail: bytes, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """The window's holes outside the tensor data ``[lo, hi)``, and the CRC-32 of every data descriptor that
    follows its record with the descriptor's signature (torch reads sizes and CRCs from the central directory
    only), unless the checks read those bytes for something else: a window's hole is read once, by the check
    that found it; a record that overlaps it (a pickle that is also the serialization id, a version on a
    CRC-32) reads it again, and then it must not differ between archives."""
    length = hi + len(tail)

    def at(a: int, b: int) -> bytes:
        return head[a:b] if b <= lo else tail[a - hi:b - hi] if a >= hi else b""

    def readers(a: int, b: int) -> int:
        return sum(start < b and end > a for start, end in window.reads)

    holes = [h for h in window.holes if readers(h[0], h[1]) == 1]
    for d in window.descriptors:
        if d + 8 <= length and at(d, d + 4) == b"PK\x07\x08" and not readers(d + 4, d + 8):
            holes.append((d + 4, d + 8, False))
    return [h for h in holes if h[1] <= lo or h[0] >= hi]


def load_blob(span: Span, *, where: str) -> Any:
    return read_archive(span.file, span.offset, span.length, where=where)

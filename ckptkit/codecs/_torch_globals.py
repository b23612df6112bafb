"""What a ``torch.save`` pickle may name, as data: the allow-list that rebuilds tensors as :class:`TensorRef`
byte spans and refuses what torch would refuse.

Every global maps to data or to a check; nothing runs code of the checkpoint's. :data:`OBJECT_GLOBALS` is what
a tensor-bearing pickle may name, :data:`WEIGHTS_ONLY_GLOBALS` the part ``torch.load(weights_only=True)``
takes; :func:`storage_loader` turns the pickle's persistent ids into the archive's storage records.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable
from typing import Any

from ..core import dtypes
from ..core.boxes import extent, row_major
from ..core.dtypes import DType
from ..core.manifest import Span, TensorRef
from ..errors import FormatError
from .numpy_data import NUMPY_GLOBALS
from .pickle_read import BytesIOData, keep_call, strided_layout

__all__ = ["OBJECT_GLOBALS", "WEIGHTS_ONLY_GLOBALS", "WRAPPER_SUBCLASS", "Storage", "StorageTag", "Tag",
           "check_weights_only_opcodes", "storage_loader", "subclass_rebuild"]


class Storage:
    """A storage record of the archive that the pickle named: its bytes, its dtype (if its class says one)."""

    __slots__ = ("span", "dtype", "key")

    def __init__(self, span: Span, dtype: DType | None, key: str) -> None:
        self.span, self.dtype, self.key = span, dtype, key


_MAX_DIMS = 64


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tensor(storage: Storage, offset: Any, size: Any, stride: Any, dtype: DType | None) -> TensorRef:
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


def _storage_of(storage: Any) -> Storage:
    if not isinstance(storage, Storage):
        raise FormatError(f"a tensor is rebuilt from {type(storage).__name__}, not from a storage record")
    return storage


class StorageTag:
    """A storage class named in a persistent id (``torch.FloatStorage``): only its dtype matters."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: DType | None) -> None:
        self.dtype = dtype


def _storage_class(dtype: DType | None) -> StorageTag:
    return StorageTag(dtype)


class Tag:
    """A torch global that a pickle passes as a value and ckptkit never calls (``torch.Tensor`` as the type
    in ``_rebuild_from_type_v2``, a tensor subclass)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_TENSOR = Tag("torch.Tensor")


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    # A plain tensor carrying Python attributes (FSDP1 marks the tensors of its state dicts, e.g.
    # "_has_been_cloned"): the attributes go, the tensor stays (unless one is the tensor's own). Tensor
    # subclasses are refused.
    if new_type is not _TENSOR or func not in (_rebuild_v2, _rebuild_v3):
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
        if new_type is _TENSOR:
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
    ("torch", "Tensor"): _TENSOR,
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
    **NUMPY_GLOBALS,
}

# What torch.load(weights_only=True) unpickles, as DCP's reader loads every chunk (torch's
# _weights_only_unpickler, 2.13): OBJECT_GLOBALS less four it refuses and numpy's, and fewer opcodes than Python's.
WEIGHTS_ONLY_GLOBALS = {k: v for k, v in OBJECT_GLOBALS.items()
                         if k not in {("builtins", "frozenset"), ("builtins", "slice"), ("torch", "UntypedStorage"),
                                       ("_io", "BytesIO"), *NUMPY_GLOBALS}}
_WEIGHTS_ONLY_OPCODES = frozenset({
    "PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT",
    "EMPTY_SET", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID",
    "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"})


def check_weights_only_opcodes(data: bytes, where: str) -> None:
    """Refuse a pickle (that Python's unpickler read) using an opcode torch's weights-only unpickler lacks."""
    import pickletools

    for op, _, pos in pickletools.genops(data):
        if op.name not in _WEIGHTS_ONLY_OPCODES:
            raise FormatError(f"{where}: the pickle uses opcode {op.name} (byte {pos}), which torch.load refuses "
                              "with weights_only=True, as DCP loads a chunk")


def storage_loader(records: dict[str, Span], where: str, storages: list[Storage]) -> Callable[[Any], Storage]:
    """The ``persistent_load`` of an archive's pickle: each storage id it names, as the archive's record of
    that storage, checked as torch checks it; appended to ``storages`` too."""

    def persistent_load(pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise FormatError(f"{where}: unexpected persistent id {pid!r}")
        _, tag, key, _location, numel = pid
        if not isinstance(tag, StorageTag):
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
        storages.append(Storage(span, tag.dtype, f"data/{key}"))
        return storages[-1]

    return persistent_load

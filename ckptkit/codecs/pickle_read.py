"""Pickles read against an allow-list, into plain-data stand-ins for torch's classes.

DCP's ``.metadata`` and every ``data.pkl`` inside a ``torch.save`` archive are pickles. Unpickling them with
the stock unpickler runs whatever globals they name; :class:`SafeUnpickler` resolves only the names a
context allows and maps each to plain data: :class:`Ref` and :class:`Call` keep a torch global or call as
data, :class:`Record` stands for an allowed class, so that :mod:`.pickle_write` can write back exactly what
torch wrote.
"""

from __future__ import annotations

import _compat_pickle
import functools
import io
import pickle
import re
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.gc_pause import gc_paused
from ..errors import FormatError, UnsafeCheckpointError

__all__ = ["MEMORY_FORMATS", "BytesIOData", "Call", "EnumStandIn", "Record", "Ref", "SafeUnpickler",
           "allow_plain_records", "allow_records", "allow_slotted_records", "check_opcodes", "check_tree", "keep_call",
           "make_record", "record_class", "ref", "refusal", "safe_getattr", "strided_layout"]


@dataclass(frozen=True, slots=True)
class Ref:
    """A global ``module.name`` as it appears in a pickle."""

    module: str
    name: str


@functools.cache
def ref(module: str, name: str) -> Ref:
    # One instance per name, so the pickler's memo writes each global once.
    return Ref(module, name)


@dataclass(frozen=True, slots=True)
class Call:
    """``module.name(*args)``: an allowed callable kept as data, so a later write reproduces it exactly."""

    func: Ref
    args: tuple


class Record:
    """Stand-in for an allowed class built by NEWOBJ + BUILD: its state becomes attributes.

    Unhashable, as torch's (non-frozen) dataclasses are, unless :data:`HASHABLE` names it: a pickle that uses
    one as a dict key fails here where it fails in torch.

    This base has no ``__setstate__``: the unpickler's own BUILD sets a dict state (or a ``(dict, slots)``
    pair) and refuses any other, as for a torch class without one (:func:`allow_plain_records`). The classes
    of :func:`record_class` take any state (:func:`_set_state`)."""

    _pickle_name: Ref
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        # As torch's dataclasses and argparse.Namespace compare: same class, same fields (``verify`` compares
        # the values of two checkpoints read apart).
        if not isinstance(other, Record):
            return NotImplemented
        return self._pickle_name == other._pickle_name and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        return f"{self._pickle_name.name}({self.__dict__})"


class BytesIOData(Record):
    """``io.BytesIO`` as data: DCP's own leaf type for bytes, and Transformer Engine's ``_extra_state``. It keeps
    the state ``BytesIO.__setstate__`` takes (the bytes, the position, the instance dict), so that writing it
    back gives torch the same ``BytesIO``; it never becomes one here."""

    _pickle_name = ref("_io", "BytesIO")

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], (bytes, bytearray))
                and isinstance(state[1], int) and state[1] >= 0 and (state[2] is None or isinstance(state[2], dict))):
            raise FormatError(f"io.BytesIO with state {state!r:.80}, not (bytes, position, dict or None) as "
                              "BytesIO.__setstate__ takes it")
        self.state = state

    def __eq__(self, other: object) -> bool:
        return type(other) is BytesIOData and self.state == other.state

    @property
    def value(self) -> bytes:
        """The bytes it holds, as ``BytesIO.getvalue()`` gives them."""
        return bytes(self.state[0])


def _set_state(self: Any, state: Any) -> None:
    if (isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict))
            and isinstance(state[1], dict)):
        state = {**(state[0] or {}), **state[1]}  # (dict, slots) from dataclasses with __slots__
    if isinstance(state, dict):
        self.__dict__.update(state)
    else:
        self.state = state


def _index_hash(self: Any) -> int:
    # A function of its own rather than a generic one over field names: it runs once per chunk of a .metadata.
    state = self.__dict__
    return hash((state["fqn"], state.get("offset")))  # an offset torch leaves at its class default is None


HASHABLE = {("torch.distributed.checkpoint.metadata", "MetadataIndex"): _index_hash}
"""torch classes among the allowed ones that hash (frozen dataclasses), and their hash: the fields torch hashes,
so that one torch cannot hash (a list for a ``torch.Size``) fails wherever torch's would, as a key of
``storage_data`` or of any other dict or set. (A hash by identity saves about 0.2 us a chunk, and lets such a
``.metadata`` through wherever the reader does not look.)"""


def _slot_state(slots: frozenset[str]) -> Callable[[Any, Any], None]:
    def set_state(self: Any, state: Any) -> None:
        # A torch class with __slots__ and no __dict__: the unpickler's BUILD sets a (None, {slot: value}) state,
        # and fails on any other (there is no __dict__ to update) or on a name that is not one of its slots.
        if not (isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict)
                and set(state[1]) <= slots):
            raise FormatError(f"{type(self).__name__} has state {state!r:.80}, not (None, {{slot: value}}) over its "
                              f"slots {sorted(slots)}: torch's unpickler cannot set it")
        self.__dict__.update(state[1])
    return set_state


@functools.cache
def record_class(module: str, name: str, *, plain: bool = False,
                 slots: frozenset[str] | None = None) -> type[Record]:
    """The stand-in class for ``module.name``; ``plain``: built by the unpickler's own BUILD (see :class:`Record`);
    ``slots``: the class has these ``__slots__`` and no ``__dict__`` (see :func:`allow_slotted_records`); else
    with a ``__setstate__`` that keeps a state of any other form as ``.state``."""
    attrs: dict[str, Any] = {"_pickle_name": ref(module, name)}
    hash_ = HASHABLE.get((module, name))
    if hash_ is not None:
        attrs["__hash__"] = hash_
    if slots is not None:
        attrs["__setstate__"] = _slot_state(slots)
    elif not plain:
        attrs["__setstate__"] = _set_state
    return type(name, (Record,), attrs)


# The members of torch's memory-format enums (DCP's _MEM_FORMAT_ENCODING, ShardedTensor's MEM_FORMAT_ENCODING).
MEMORY_FORMATS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}


class EnumStandIn:
    """An allowed enum. A pickle names a member by value (``Enum(0)``) or, from Python builds that pickle
    enums by name (Debian's 3.11, 3.12+), as ``getattr(Enum, "NAME")``: both give ``make(value)``."""

    def __init__(self, members: Mapping[str, int], make: Callable[[int], Any] = lambda value: value) -> None:
        self.members, self.make = dict(members), make

    def __call__(self, value: int) -> Any:
        if value not in self.members.values() or isinstance(value, bool):
            raise FormatError(f"{value!r:.40} is not a member of the enum (one of {sorted(self.members.values())})")
        return self.make(value)


def strided_layout(name: Any) -> Any:
    """``torch.serialization._get_layout(name)``: ckptkit reads strided tensors; torch itself knows no name but
    its layouts'."""
    if name != "torch.strided":
        raise FormatError(f"a tensor has layout {name!r:.40}; ckptkit reads strided (dense) tensors only")
    return keep_call("torch.serialization", "_get_layout")(name)


def safe_getattr(attrs: Mapping[tuple[int, str], Any] | None = None) -> Callable[[Any, str], Any]:
    """The ``getattr`` a pickle may call: members of an :class:`EnumStandIn`, and ``attrs`` keyed by
    ``(id(obj), name)``; anything else is refused."""
    def getattr_(obj: Any, name: str) -> Any:
        if isinstance(obj, EnumStandIn) and name in obj.members:
            return obj(obj.members[name])
        if attrs and (id(obj), name) in attrs:
            return attrs[(id(obj), name)]
        raise UnsafeCheckpointError(f"the pickle asks for getattr({obj!r}, {name!r}), which is not allowed")
    return getattr_


# --------------------------------------------------------------------------------------------------------
# What a pickle may make the unpickler allocate


_SHORT = 64  # string lengths the regular expression of _plain_run takes itself


@functools.cache
def _plain_run(bits: int) -> re.Pattern[bytes]:
    """A run of opcodes whose arguments have a fixed length, with LONG_BINPUT memo indices below ``2**bits``.

    Built from ``pickletools``' own opcode table. STOP, the memo stores with text or large indices and every
    opcode with a counted or newline-ended argument stop the run; :func:`check_opcodes` takes those one by one.
    """
    import pickletools

    by_length: dict[int, list[int]] = {}
    for op in pickletools.opcodes:
        n = 0 if op.arg is None else op.arg.n
        if n >= 0 and op.name not in ("STOP", "LONG_BINPUT"):
            by_length.setdefault(n, []).append(ord(op.code))

    def one_of(codes: list[int]) -> bytes:
        return b"[" + b"".join(re.escape(bytes([c])) for c in sorted(codes)) + b"]"

    whole, rest = divmod(bits, 8)
    if whole >= 4:
        index = b"...."
    else:  # little-endian: low bytes free, then one byte below 2**rest, then zeros
        top = b"[\x00-" + re.escape(bytes([(1 << rest) - 1])) + b"]" if rest else b"\x00"
        index = b"." * whole + top + b"\x00" * (3 - whole)
    alternatives = [b"r" + index] + [one_of(codes) + b"." * n for n, codes in sorted(by_length.items())]
    # Short strings too (BINUNICODE of under 64 bytes: a .metadata has a few per chunk, its file name and the
    # parts of keys), one alternative per length: the walk would otherwise leave the expression at each.
    alternatives.append(b"X(?:" + b"|".join(re.escape(bytes([n])) + b"\x00\x00\x00" + b"." * n
                                            for n in range(_SHORT)) + b")")
    # Possessive (3.11+): a run never needs to give back what it matched, and saying so halves the time.
    star = b"*+" if sys.version_info >= (3, 11) else b"*"
    return re.compile(b"(?:" + b"|".join(alternatives) + b")" + star, re.DOTALL)


_COUNTED = {  # opcode: (length field format, its size)
    ord("U"): ("<B", 1), ord("C"): ("<B", 1), 0x8C: ("<B", 1), 0x8A: ("<B", 1),
    ord("T"): ("<i", 4), 0x8B: ("<i", 4), ord("B"): ("<I", 4), ord("X"): ("<I", 4),
    0x8E: ("<Q", 8), 0x96: ("<Q", 8), 0x8D: ("<Q", 8),
}
_LINES = {ord(c): 1 for c in "ILSVFgpP"} | {ord("c"): 2, ord("i"): 2}


def check_opcodes(data: bytes, where: str) -> None:
    """Refuse a pickle that would make CPython's C unpickler allocate far more than its own length.

    The C unpickler sizes its memo to twice the largest index a PUT or LONG_BINPUT names, at once: ten bytes
    (``\\x80\\x02Nr\\x00\\x00\\x00\\x10.``) ask for 4 GiB. A real pickle numbers its memo entries 0, 1, 2, ...,
    one per store opcode, so an index is always below the pickle's length; counted strings and bytes must fit
    in what is left of it. This walks the opcodes (a regular expression takes the fixed-length runs, so the
    walk costs about 50 ns an opcode) and stops at the first STOP, as the unpickler does. What it cannot parse
    it leaves to the unpickler, which then fails on it with its own error.
    """
    end = len(data)
    bits = max(16, end.bit_length())
    run = _plain_run(bits)
    pos = 0
    while True:
        pos = run.match(data, pos).end()  # type: ignore[union-attr]  # a run may be empty, never absent
        if pos >= end:
            return
        op = data[pos]
        if op == ord("."):
            return
        if op == ord("r"):
            (index,) = struct.unpack_from("<I", data, pos + 1) if pos + 5 <= end else (0,)
            raise FormatError(f"{where}: cannot read pickle: it stores memo entry {index} at byte {pos}, past "
                              f"anything a {end}-byte pickle can hold (a damaged or hostile file)")
        if op in _COUNTED:
            fmt, size = _COUNTED[op]
            if pos + 1 + size > end:
                return
            (n,) = struct.unpack_from(fmt, data, pos + 1)
            pos += 1 + size
            if n < 0 or n > end - pos:
                raise FormatError(f"{where}: cannot read pickle: it declares {n} bytes at byte {pos}, but only "
                                  f"{end - pos} follow (truncated or damaged)")
            pos += n
        elif op in _LINES:
            start = pos + 1
            for _ in range(_LINES[op]):
                nl = data.find(b"\n", pos + 1)
                if nl < 0:
                    return
                pos = nl
            text = data[start:pos].strip()
            if op == ord("p") and text.isdigit() and int(text) >> bits:
                raise FormatError(f"{where}: cannot read pickle: it stores memo entry {int(text)} at byte {start - 1}, "
                                  f"past anything a {end}-byte pickle can hold (a damaged or hostile file)")
            pos += 1
        else:
            return  # an opcode the unpickler does not know: it refuses the pickle itself


def check_tree(value: Any, where: str, *, budget: int, depth: int = 100, refuse: tuple[type, ...] = ()) -> None:
    """Refuse an unpickled object that is nested deeper than ``depth`` or that reaches more than ``budget``
    containers when walked as a tree (a pickle can share one container many times, so that a walk, or a
    copy, goes exponential, or around a cycle). ckptkit's walks over state dicts are recursive; this one is not.
    ``refuse`` names types that may serve inside a pickle (a storage, a class) but are no value of a state.
    """
    stack = [(value, 0)]
    seen = 0
    while stack:
        node, level = stack.pop()
        if isinstance(node, refuse):
            raise FormatError(f"{where}: the pickle leaves {node!r:.60} where a value belongs; not a state dict "
                              "torch would give back")
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = node
        elif isinstance(node, Call):
            children = node.args
        elif isinstance(node, Record):
            children = node.__dict__.values()
        else:
            continue
        seen += 1
        if level > depth or seen > budget:
            what = f"nested more than {depth} levels deep" if level > depth else \
                f"more than {budget} containers (shared ones counted each time they are reached)"
            raise FormatError(f"{where}: the pickle holds {what}; ckptkit reads state dicts, not such object graphs")
        stack.extend((child, level + 1) for child in children)


_TORCH_DTYPE = re.compile(r"(float|bfloat|int|uint|complex|bits|qint|quint)\d\w*")


def refusal(module: str, name: str) -> str:
    """Why ``module.name`` is not read: the pickle asks for it and it is not on the allow-list. Says whose
    class it is, and so whether ckptkit or the checkpoint's own code is what stands in the way."""
    found = f"the pickle asks for {module}.{name}, which is not on ckptkit's allow-list"
    if module == "torch" and _TORCH_DTYPE.fullmatch(name):
        return (f"{found}: torch.{name} is a torch dtype that ckptkit does not support yet (torch writes it; "
                "ckptkit cannot read it)")
    owner = module.split(".", 1)[0]
    if owner in ("torch", "megatron", "deepspeed", "lightning", "pytorch_lightning", "transformers"):
        return (f"{found}: it belongs to {owner}, and ckptkit does not support it here (a gap in ckptkit, not a "
                "fault of the checkpoint); ckptkit never runs code from a checkpoint")
    return (f"{found}: it comes from {owner!r}, not torch, and ckptkit never runs code from a checkpoint; save that "
            "entry as plain data (dicts, lists, numbers, strings, tensors) to convert it")


class SafeUnpickler(pickle.Unpickler):
    """Resolves globals through ``allowed`` only; any other global is refused, naming it and the file.

    The pickle is checked by :func:`check_opcodes` first, so that the unpickler never allocates much more
    than the pickle's own size."""

    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], *, where: str,
                 persistent_load: Callable[[Any], Any] | None = None) -> None:
        check_opcodes(data, where)
        # A buffered reader lets the C unpickler take the input in large reads (it peeks) rather than through a
        # call to BytesIO.read per opcode: half the time of a large .metadata.
        super().__init__(io.BufferedReader(io.BytesIO(data)))
        self._allowed, self._where, self._persistent = allowed, where, persistent_load

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 pickles name Python 2 modules (__builtin__); the stock find_class maps them, and so must
        # this override.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(f"{self._where}: {refusal(module, name)}") from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise FormatError(f"{self._where}: unexpected persistent id {pid!r} in a pickle that should hold none")
        return self._persistent(pid)

    def load_checked(self) -> Any:
        try:
            with gc_paused():
                return self.load()
        except UnsafeCheckpointError as e:
            if str(e).startswith(self._where):
                raise
            raise UnsafeCheckpointError(f"{self._where}: {e}") from None
        except FormatError as e:
            if str(e).startswith(self._where):
                raise
            # A check inside the pickle names the file alone; ``where`` may name more (a DCP chunk's key).
            text = str(e).removeprefix(f"{self._where.split(': ')[0]}: ")
            raise FormatError(f"{self._where}: {text}") from None
        except Exception as e:  # a truncated or corrupt pickle raises a zoo of types
            raise FormatError(f"{self._where}: cannot read pickle ({type(e).__name__}: {e})") from e


def allow_records(module: str, *names: str) -> dict[tuple[str, str], type[Record]]:
    """Allow-list entries that rebuild ``module.<name>`` objects as :class:`Record` stand-ins."""
    return {(module, n): record_class(module, n) for n in names}


def allow_plain_records(module: str, *names: str) -> dict[tuple[str, str], type[Record]]:
    """:func:`allow_records` for classes that define no ``__setstate__`` in torch: the unpickler's own BUILD
    sets their state, refusing one that is not a dict (or a ``(dict, slots)`` pair) as it does for torch, and
    without a Python call per object (a 1M-chunk ``.metadata`` has 3M of them)."""
    return {(module, n): record_class(module, n, plain=True) for n in names}


def allow_slotted_records(module: str, slots: Mapping[str, tuple[str, ...]]) -> dict[tuple[str, str], type[Record]]:
    """:func:`allow_records` for classes with ``__slots__`` and no ``__dict__`` (class name to its slots): their
    state must be what torch's unpickler can set on them."""
    return {(module, n): record_class(module, n, slots=frozenset(names)) for n, names in slots.items()}


def make_record(module: str, name: str, state: Any) -> Record:
    obj = record_class(module, name).__new__(record_class(module, name))
    _set_state(obj, state)
    return obj


def keep_call(module: str, name: str) -> Callable[..., Call]:
    return lambda *args: Call(ref(module, name), args)

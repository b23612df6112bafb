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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError, UnsafeCheckpointError

__all__ = ["MEMORY_FORMATS", "Call", "EnumStandIn", "Record", "Ref", "SafeUnpickler", "allow_records",
           "keep_call", "make_record", "record_class", "ref", "safe_getattr"]


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
    """Stand-in for an allowed class built by NEWOBJ + BUILD: its state becomes attributes."""

    _pickle_name: Ref

    def __setstate__(self, state: Any) -> None:
        if (isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict))
                and isinstance(state[1], dict)):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) from dataclasses with __slots__
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"{self._pickle_name.name}({self.__dict__})"


@functools.cache
def record_class(module: str, name: str) -> type[Record]:
    return type(name, (Record,), {"_pickle_name": ref(module, name)})


# The members of torch's memory-format enums (DCP's _MEM_FORMAT_ENCODING, ShardedTensor's MEM_FORMAT_ENCODING).
MEMORY_FORMATS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}


class EnumStandIn:
    """An allowed enum. A pickle names a member by value (``Enum(0)``) or, from Python builds that pickle
    enums by name (Debian's 3.11, 3.12+), as ``getattr(Enum, "NAME")``: both give ``make(value)``."""

    def __init__(self, members: Mapping[str, int], make: Callable[[int], Any] = lambda value: value) -> None:
        self.members, self.make = dict(members), make

    def __call__(self, value: int) -> Any:
        return self.make(value)


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


class SafeUnpickler(pickle.Unpickler):
    """Resolves globals through ``allowed`` only; any other global is refused, naming it and the file."""

    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], *, where: str,
                 persistent_load: Callable[[Any], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed, self._where, self._persistent = allowed, where, persistent_load

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 pickles name Python 2 modules (__builtin__); the stock find_class maps them, and so must
        # this override.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._where}: the pickle asks for {module}.{name}, which is not on ckptkit's allow-list; "
                "ckptkit never runs code from a checkpoint (re-save the state without custom classes)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise FormatError(f"{self._where}: unexpected persistent id {pid!r} in a pickle that should hold none")
        return self._persistent(pid)

    def load_checked(self) -> Any:
        try:
            return self.load()
        except UnsafeCheckpointError as e:
            if str(e).startswith(self._where):
                raise
            raise UnsafeCheckpointError(f"{self._where}: {e}") from None
        except FormatError:
            raise
        except Exception as e:  # a truncated or corrupt pickle raises a zoo of types
            raise FormatError(f"{self._where}: cannot read pickle ({type(e).__name__}: {e})") from e


def allow_records(module: str, *names: str) -> dict[tuple[str, str], type[Record]]:
    """Allow-list entries that rebuild ``module.<name>`` objects as :class:`Record` stand-ins."""
    return {(module, n): record_class(module, n) for n in names}


def make_record(module: str, name: str, state: Any) -> Record:
    obj = record_class(module, name).__new__(record_class(module, name))
    obj.__setstate__(state)
    return obj


def keep_call(module: str, name: str) -> Callable[..., Call]:
    return lambda *args: Call(ref(module, name), args)

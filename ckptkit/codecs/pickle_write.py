"""Pickles that name torch's globals without importing torch.

:class:`RefPickler` writes the stand-ins :mod:`.pickle_read` produces (:class:`Ref`, :class:`Call`,
:class:`Record`) and ckptkit's :class:`DType` as the globals and calls they stand for, so the bytes torch
later loads are the ones torch itself would have written.

:func:`dumps` runs the C pickler where it can (a ``.metadata`` of a million chunks is millions of objects):
its ``reducer_override`` reduces each stand-in as :class:`RefPickler` does, writing each name a stand-in needs
as a ``GLOBAL`` of an object registered for it in ckptkit's own modules; those ``GLOBAL`` lines are then
renamed to the names they stand for. Renaming in place is exact for protocols 0-3 only (4 and later frame
and length-prefix globals), which is what torch.save and DCP write.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.dtypes import DType
from .numpy_data import Built
from .pickle_read import Call, Record, Ref, ref

__all__ = ["RefPickler", "dumps"]

if TYPE_CHECKING:

    class _Pickler(pickle._Pickler):
        # typeshed leaves out the members of the pure-Python pickler that a subclass extends it through, and
        # types its dispatch table's handlers as taking an Unpickler.
        proto: int
        dispatch: ClassVar[dict[type, Callable[[Any, Any], None]]]

        def write(self, data: bytes, /) -> object: ...
        def memoize(self, obj: Any) -> None: ...
        def save(self, obj: Any, save_persistent_id: bool = True) -> None: ...

else:
    _Pickler = pickle._Pickler


class RefPickler(_Pickler):  # the pure-Python pickler: its dispatch table can be extended
    dispatch = _Pickler.dispatch.copy()

    def __init__(self, file: io.BytesIO, protocol: int, persistent_id: Callable[[Any], Any] | None = None) -> None:
        super().__init__(file, protocol)
        self._pid = persistent_id

    def persistent_id(self, obj: Any) -> Any:
        return self._pid(obj) if self._pid else None

    def _save_ref(self, obj: Ref) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    def _save_call(self, obj: Call) -> None:
        self.save(obj.func)
        self.save(tuple(obj.args))
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def _save_record(self, obj: Record) -> None:
        self.save(obj._pickle_name)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        state = obj.__dict__["state"] if "state" in obj.__dict__ else dict(obj.__dict__)
        if state:
            self.save(state)
            self.write(pickle.BUILD)

    def _save_built(self, obj: Built) -> None:
        self.save(type(obj)._pickle_name)
        self.save(tuple(obj.args))
        self.write(pickle.REDUCE)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    def _save_dtype(self, obj: DType) -> None:
        self.save(ref("torch", obj.name))  # through save(), so the memo serves repeats

    dispatch[Ref] = _save_ref
    dispatch[Call] = _save_call
    dispatch[DType] = _save_dtype

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # Record subclasses are made on demand (one per allowed class name): register each as it is met.
        if isinstance(obj, Record) and type(obj) not in self.dispatch:
            self.dispatch[type(obj)] = RefPickler._save_built if isinstance(obj, Built) else RefPickler._save_record
        super().save(obj, save_persistent_id)


def dumps(obj: Any, *, protocol: int, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """The pickle :class:`RefPickler` writes, byte for byte."""
    if protocol <= 3:
        try:
            return _c_dumps(obj, protocol, persistent_id)
        except (_Unrenamed, RecursionError):
            pass
    buf = io.BytesIO()
    RefPickler(buf, protocol, persistent_id).dump(obj)
    return buf.getvalue()


class _Unrenamed(Exception):
    """A pickle the renaming cannot make exactly (one name reached as two different objects, or a stand-in's
    name found in the data): the pure-Python pickler writes it instead."""


class _Placeholder:
    """Base of the callables that stand for a :class:`Call`'s function (a reduce needs a callable)."""

    __slots__ = ()


_NEWOBJ = vars(copyreg)["__newobj__"]  # the reduce that pickles as NEWOBJ (typeshed leaves it out)
_PLACEHOLDERS: dict[Ref, type[_Placeholder]] = {}
_NAMES: dict[bytes, tuple[bytes, Ref]] = {}  # registered name -> (module it is registered in, the name it stands for)
_REGISTERED: dict[int, tuple[Any, str]] = {}  # id of a registered object -> (the object, its name)
_GLOBAL_LINE = re.compile(rb"c(ckptkit\.[\w.]+)\n(_pickled_global_\d+)\n")


def _registered(obj: Any, r: Ref) -> str:
    """A name under which ``obj`` is an attribute of its own module, so that the C pickler writes it as a
    ``GLOBAL`` (memoized as any global), to be renamed to ``r`` after."""
    known = _REGISTERED.get(id(obj))
    if known is None:
        name = f"_pickled_global_{len(_REGISTERED)}"
        module = obj.__module__ if isinstance(obj, type) else type(obj).__module__
        setattr(sys.modules[module], name, obj)
        known = _REGISTERED[id(obj)] = (obj, name)
        _NAMES[name.encode()] = (module.encode(), r)
    return known[1]


def _placeholder(r: Ref) -> type[_Placeholder]:
    cls = _PLACEHOLDERS.get(r)
    if cls is None:
        cls = _PLACEHOLDERS[r] = type("Placeholder", (_Placeholder,), {"__slots__": ()})
    return cls


class _CPickler(pickle.Pickler):
    """The C pickler, writing each stand-in as :class:`RefPickler` does up to the names of its globals."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol)
        self.used: dict[Ref, Any] = {}  # name -> the one object written as it (the memo's key for it)

    def _global(self, obj: Any, r: Ref) -> str:
        if self.used.setdefault(r, obj) is not obj:  # RefPickler memoizes a name once; two objects would write it twice
            raise _Unrenamed(r)
        return _registered(obj, r)

    def reducer_override(self, obj: Any) -> Any:
        # Called once per object the memo does not hold, for all but the builtin types.
        t = type(obj)
        if t is Ref:
            return self._global(obj, obj)
        if t is DType:
            return self._global(obj, ref("torch", obj.name))
        if t is Call:
            return _placeholder(obj.func), tuple(obj.args)
        if isinstance(obj, Built):
            return _placeholder(t._pickle_name), tuple(obj.args), obj.state
        if isinstance(obj, Record):
            if type(t._pickle_name) is not Ref:  # a class reached through a call (getattr): not a GLOBAL
                raise _Unrenamed(t._pickle_name)
            state = obj.__dict__["state"] if "state" in obj.__dict__ else dict(obj.__dict__)
            return _NEWOBJ, (t,), state or None
        if isinstance(obj, type):
            if issubclass(obj, Record):
                return self._global(obj, obj._pickle_name)
            if issubclass(obj, _Placeholder):
                return self._global(obj, next(r for r, c in _PLACEHOLDERS.items() if c is obj))
        return NotImplemented


class _CPicklerWithIds(_CPickler):
    def __init__(self, file: io.BytesIO, protocol: int, persistent_id: Callable[[Any], Any]) -> None:
        super().__init__(file, protocol)
        self._pid = persistent_id

    def persistent_id(self, obj: Any) -> Any:
        return self._pid(obj)


def _c_dumps(obj: Any, protocol: int, persistent_id: Callable[[Any], Any] | None) -> bytes:
    buf = io.BytesIO()
    pickler = _CPickler(buf, protocol) if persistent_id is None else _CPicklerWithIds(buf, protocol, persistent_id)
    pickler.dump(obj)
    found: list[bytes] = []

    def rename(m: re.Match[bytes]) -> bytes:
        module, r = _NAMES.get(m.group(2), (b"", None))
        if r is None or module != m.group(1):
            raise _Unrenamed(m.group(0))
        found.append(m.group(2))
        return f"c{r.module}\n{r.name}\n".encode()

    data = _GLOBAL_LINE.sub(rename, buf.getvalue())
    # Each name used is written once (the memo serves repeats); any other match was data, not a GLOBAL.
    if sorted(found) != sorted(_REGISTERED[id(o)][1].encode() for o in pickler.used.values()):
        raise _Unrenamed("a registered name in the data")
    return data

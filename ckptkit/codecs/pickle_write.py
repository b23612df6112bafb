"""Pickles that name torch's globals without importing torch.

:class:`RefPickler` writes the stand-ins :mod:`.pickle_read` produces (:class:`Ref`, :class:`Call`,
:class:`Record`) and ckptkit's :class:`DType` as the globals and calls they stand for, so the bytes torch
later loads are the ones torch itself would have written.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.dtypes import DType
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

    def _save_dtype(self, obj: DType) -> None:
        self.save(ref("torch", obj.name))  # through save(), so the memo serves repeats

    dispatch[Ref] = _save_ref
    dispatch[Call] = _save_call
    dispatch[DType] = _save_dtype

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # Record subclasses are made on demand (one per allowed class name): register each as it is met.
        if isinstance(obj, Record) and type(obj) not in self.dispatch:
            self.dispatch[type(obj)] = RefPickler._save_record
        super().save(obj, save_persistent_id)


def dumps(obj: Any, *, protocol: int, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    buf = io.BytesIO()
    RefPickler(buf, protocol, persistent_id).dump(obj)
    return buf.getvalue()

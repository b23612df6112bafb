"""numpy arrays of plain numbers in a pickle, as data: Megatron-LM's ``rng_state`` holds
``np.random.get_state()`` (a ``uint32`` array), and training loops save numpy scalars and arrays beside their
tensors.

numpy pickles an array as ``_reconstruct(ndarray, (0,), b"b")`` followed by BUILD with ``(version, shape, dtype,
is_fortran, raw bytes)``, and its dtype as ``dtype("u4", False, True)`` followed by BUILD with its byte order and
flags. :class:`Built` keeps each call and state as they are, so that :mod:`.pickle_write` writes back what numpy
wrote; nothing of numpy runs. Arrays of Python objects (dtype ``O``) are refused: their items are pickles of
their own.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import FormatError
from .pickle_read import Record, ref

__all__ = ["NUMPY_GLOBALS", "Built"]


class Built(Record):
    """An object a pickle makes by calling a global with ``args``, then setting ``state`` on it (REDUCE, BUILD)."""

    args: tuple
    state: Any

    @classmethod
    def made(cls, args: tuple) -> Built:
        obj = cls.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __setstate__(self, state: Any) -> None:
        self._check(state)
        self.state = state

    def _check(self, state: Any) -> None:
        raise NotImplementedError


_DTYPE = re.compile(r"[<>=|]?(b1|[iu][1248]|f[248]|f16|c8|c16|c32|[SUV]\d{1,6})")


class _DType(Built):
    _pickle_name = ref("numpy", "dtype")

    @classmethod
    def call(cls, *args: Any) -> Built:
        if not (len(args) == 3 and isinstance(args[0], str) and _DTYPE.fullmatch(args[0])
                and all(isinstance(a, bool) for a in args[1:])):
            raise FormatError(f"numpy.dtype{args!r:.80}: ckptkit reads numpy dtypes of plain numbers and strings only")
        return cls.made(args)

    def _check(self, state: Any) -> None:
        # (version, byte order, subarray, names, fields, element size, alignment, flags): None where unstructured.
        if not (isinstance(state, tuple) and 8 <= len(state) <= 9 and isinstance(state[1], str)
                and state[2] is None and state[3] is None and state[4] is None
                and all(isinstance(v, int) for v in (state[0], *state[5:8]))):
            raise FormatError(f"numpy dtype state {state!r:.80} is not that of an unstructured dtype")


def _is_shape(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) <= 64 and all(type(n) is int and n >= 0 for n in v)


class _Array(Built):
    _pickle_name = ref("numpy._core.multiarray", "_reconstruct")

    @classmethod
    def call(cls, *args: Any) -> Built:
        if not (len(args) == 3 and args[0] == ref("numpy", "ndarray") and _is_shape(args[1])
                and isinstance(args[2], bytes)):
            raise FormatError(f"numpy's _reconstruct{args!r:.80}: ckptkit reads plain numpy arrays only")
        return cls.made(args)

    def _check(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and type(state[0]) is int and _is_shape(state[1])
                and isinstance(state[2], _DType) and isinstance(state[3], bool)
                and isinstance(state[4], (bytes, bytearray))):
            raise FormatError(f"numpy array state {state!r:.80} is not (version, shape, dtype, is_fortran, bytes) "
                              "of numbers (arrays of Python objects are refused)")


def _array_class(module: str) -> type[_Array]:
    return type("_reconstruct", (_Array,), {"_pickle_name": ref(module, "_reconstruct")})


NUMPY_GLOBALS: dict[tuple[str, str], Any] = {
    # numpy 2 pickles its _core module; numpy 1 the same function as numpy.core (numpy 2 reads both).
    ("numpy._core.multiarray", "_reconstruct"): _Array.call,
    ("numpy.core.multiarray", "_reconstruct"): _array_class("numpy.core.multiarray").call,
    ("numpy", "ndarray"): ref("numpy", "ndarray"),
    ("numpy", "dtype"): _DType.call,
}
"""Allow-list entries for numpy arrays and dtypes of plain numbers, rebuilt as :class:`Built` records."""

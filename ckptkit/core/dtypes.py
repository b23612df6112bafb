"""Tensor element types as plain data, so that planning and byte copies never need to import torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import FormatError, UsageError

__all__ = ["DTYPES", "CastName", "DType", "FloatName", "by_name", "by_safetensors", "parse_cast", "parse_floating"]

FloatName = Literal["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]
"""The floating dtypes a conversion casts to, short or as torch names them."""
CastName = Literal["keep", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]
"""``--dtype``: ``keep``, or a :data:`FloatName`."""


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    """Attribute name in the ``torch`` module, e.g. ``"bfloat16"``."""
    itemsize: int
    kind: str
    """One of ``float``, ``int``, ``uint``, ``bool``, ``complex``."""
    safetensors: str | None
    """Code in a safetensors header, or None where that format has no such type."""
    storage_class: str | None
    """Legacy typed-storage class name that ``torch.save`` writes for this dtype, if any."""

    @property
    def is_floating(self) -> bool:
        return self.kind == "float"

    def __str__(self) -> str:
        return self.name


DTYPES = (
    DType("float64", 8, "float", "F64", "DoubleStorage"),
    DType("float32", 4, "float", "F32", "FloatStorage"),
    DType("float16", 2, "float", "F16", "HalfStorage"),
    DType("bfloat16", 2, "float", "BF16", "BFloat16Storage"),
    DType("float8_e4m3fn", 1, "float", "F8_E4M3", None),
    DType("float8_e5m2", 1, "float", "F8_E5M2", None),
    DType("float8_e4m3fnuz", 1, "float", "F8_E4M3FNUZ", None),
    DType("float8_e5m2fnuz", 1, "float", "F8_E5M2FNUZ", None),
    DType("float8_e8m0fnu", 1, "float", "F8_E8M0", None),
    DType("int64", 8, "int", "I64", "LongStorage"),
    DType("int32", 4, "int", "I32", "IntStorage"),
    DType("int16", 2, "int", "I16", "ShortStorage"),
    DType("int8", 1, "int", "I8", "CharStorage"),
    DType("uint64", 8, "uint", "U64", None),
    DType("uint32", 4, "uint", "U32", None),
    DType("uint16", 2, "uint", "U16", None),
    DType("uint8", 1, "uint", "U8", "ByteStorage"),
    DType("bool", 1, "bool", "BOOL", "BoolStorage"),
    DType("complex64", 8, "complex", "C64", "ComplexFloatStorage"),
    DType("complex128", 16, "complex", None, "ComplexDoubleStorage"),
)
_BY_NAME = {d.name: d for d in DTYPES}
_BY_SAFETENSORS = {d.safetensors: d for d in DTYPES if d.safetensors}
# torch's own aliases, as they may appear in pickles (``torch.float`` pickles as ``float32`` but be lenient).
_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32",
            "short": "int16"}
_CASTS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "float32": "float32"}


def by_name(name: str, *, where: str = "") -> DType:
    try:
        return _BY_NAME[_ALIASES.get(name, name)]
    except KeyError:
        raise FormatError(f"{where}: unsupported dtype torch.{name}; supported: {', '.join(_BY_NAME)}") from None


def by_safetensors(code: str, *, where: str = "") -> DType:
    try:
        return _BY_SAFETENSORS[code]
    except KeyError:
        raise FormatError(f"{where}: unsupported safetensors dtype {code!r}; "
                          f"supported: {', '.join(_BY_SAFETENSORS)}") from None



def parse_cast(value: str) -> DType | None:
    """``--dtype`` values: ``keep`` (None) or a floating type to cast floating tensors to."""
    if value == "keep":
        return None
    try:
        return _BY_NAME[_CASTS[value]]
    except KeyError:
        raise UsageError(f"--dtype must be one of keep, bf16, fp16, fp32 (or bfloat16, float16, float32); "
                         f"got {value!r}") from None


def parse_floating(value: str, option: str) -> DType:
    """``bf16``, ``fp16`` or ``fp32``, or as torch names them (``bfloat16``, ``float16``, ``float32``)."""
    if value not in _CASTS:
        raise UsageError(f"{option} must be one of bf16, fp16, fp32 (or bfloat16, float16, float32); got {value!r}")
    return _BY_NAME[_CASTS[value]]

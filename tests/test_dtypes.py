"""ckptkit.core.dtypes: the table of element types, checked entry by entry against torch and safetensors."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from ckptkit.core.dtypes import DTYPES, by_name, by_safetensors, parse_cast
from ckptkit.errors import FormatError, UsageError


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@pytest.mark.parametrize("d", DTYPES, ids=str)
def test_dtypes_itemsize_and_kind_are_torch_s(d):
    t = torch.empty((), dtype=torch_dtype(d.name))
    assert d.itemsize == t.element_size()
    if t.is_floating_point():
        kind = "float"
    elif t.is_complex():
        kind = "complex"
    elif t.dtype == torch.bool:
        kind = "bool"
    else:
        kind = "int" if torch.iinfo(t.dtype).min < 0 else "uint"
    assert d.kind == kind
    assert d.is_floating == t.is_floating_point()


@pytest.mark.parametrize("d", DTYPES, ids=str)
def test_dtypes_safetensors_code_is_what_safetensors_writes(tmp_path, d):
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    if d.safetensors is None:  # complex128: safetensors has no code for it
        with pytest.raises(KeyError, match="complex128"):
            save_file({"t": torch.zeros(2, dtype=torch_dtype(d.name))}, path)
        return
    save_file({"t": torch.zeros(2, dtype=torch_dtype(d.name))}, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8:8 + n])["t"]["dtype"] == d.safetensors
    assert by_safetensors(d.safetensors) is d


@pytest.mark.parametrize("d", [d for d in DTYPES if d.storage_class], ids=str)
def test_dtypes_storage_class_is_torch_s_legacy_storage_of_that_dtype(d):
    assert getattr(torch, d.storage_class)(0).dtype == torch_dtype(d.name)


def test_dtypes_cover_every_torch_dtype_that_has_a_storage_class():
    legacy = {getattr(torch, n)(0).dtype for n in dir(torch) if n.endswith("Storage") and n not in
              ("TypedStorage", "UntypedStorage") and not n.startswith("Q") and not n.startswith("_")}
    assert legacy <= {torch_dtype(d.name) for d in DTYPES}


@pytest.mark.parametrize("alias", ["float", "half", "double", "long", "int", "short"])
def test_by_name_reads_torch_s_aliases(alias):
    # torch.float pickles as torch.float32, but a hand-written pickle may name the alias.
    assert torch_dtype(by_name(alias).name) == getattr(torch, alias)


def test_by_name_unknown_names_the_place_and_lists_the_supported():
    with pytest.raises(FormatError, match=r"^x\.pt: 'w': unsupported dtype torch\.qint8; "
                                          r"supported: float64, float32, "):
        by_name("qint8", where="x.pt: 'w'")


def test_by_safetensors_unknown_names_the_code():
    with pytest.raises(FormatError, match=r"^m\.safetensors: 'w': unsupported safetensors dtype 'F128'; "
                                          r"supported: F64"):
        by_safetensors("F128", where="m.safetensors: 'w'")


@pytest.mark.parametrize("value, name", [
    ("keep", None),            # no cast
    ("bf16", "bfloat16"),      # the CLI's short names
    ("fp16", "float16"),
    ("fp32", "float32"),
    ("bfloat16", "bfloat16"),  # torch's names
    ("float16", "float16"),
    ("float32", "float32"),
])
def test_parse_cast(value, name):
    cast = parse_cast(value)
    assert (cast.name if cast else None) == name


@pytest.mark.parametrize("value", ["int8", "fp8", "float64", ""])
def test_parse_cast_refuses_what_is_not_a_floating_export_type(value):
    with pytest.raises(UsageError, match=rf"^--dtype must be one of keep, bf16, fp16, fp32 \(or bfloat16, float16, "
                                         rf"float32\); got {value!r}$"):
        parse_cast(value)

"""ckptkit.ops.inspect: JSON values of non-tensor entries (typed descriptions, never reprs), counts and sizes as
people read them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ckptkit.codecs.pickle_read import Call, record_class, ref
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Span, TensorRef
from ckptkit.io.progress import human_size
from ckptkit.ops.inspect import human_count, inspect, json_value, render, summary


@pytest.mark.parametrize("value, expected", [
    (7, 7), (0.5, 0.5), ("x", "x"), (None, None), (True, True),
    ((0.9, 0.95), [0.9, 0.95]),                                              # a tuple: a list
    ({"lr": 1e-3}, {"lr": 1e-3}),
    ({0: "a"}, {"type": "dict", "items": [[0, "a"]]}),                      # int keys (torch.optim's state)
    (b"\x80\x04", {"type": "bytes", "length": 2}),                           # a pickled blob
    (math.inf, {"type": "float", "value": "inf"}),                           # no Infinity in JSON
    (1 + 2j, {"type": "complex", "real": 1.0, "imag": 2.0}),
    ({3}, {"type": "set", "items": [3]}),
    (TensorRef(by_name("int64"), (2, 3), Span("f", 0, 48)), {"type": "tensor", "dtype": "int64", "shape": [2, 3]}),
    (by_name("bfloat16"), {"type": "dtype", "name": "bfloat16"}),
    (Call(ref("torch", "Size"), ((2, 3),)), {"type": "call", "function": "torch.Size", "args": [[2, 3]]}),
])
def test_json_value(value, expected):
    assert json_value(value) == expected
    json.dumps(json_value(value), allow_nan=False)  # strict JSON


def test_json_value_of_an_allow_listed_object():
    obj = record_class("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata")()
    obj.__setstate__({"offsets": (0,), "sizes": (4,)})
    assert json_value(obj) == {"type": "object", "class": "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
                               "state": {"offsets": [0], "sizes": [4]}}


@pytest.mark.parametrize("n, text", [(950, "950"), (1_000, "1.0K"), (124_439_808, "124M"), (1_235_814_400, "1.2B"),
                                     (70_553_706_496, "70.6B"), (405_000_000_000, "405B")])
def test_human_count(n, text):
    assert human_count(n) == text


@pytest.mark.parametrize("n, text", [(0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (5_014_272, "5.0 MB"),
                                     (99_949, "99.9 kB"), (999_500, "1.0 MB"), (1_234_567_890, "1.2 GB"),
                                     (123_456_789_012, "123 GB")])
def test_human_size_decimal(n, text):
    assert human_size(n) == text


def test_inspect_objects_with_tensors_and_blobs_render_as_json(tmp_path):
    torch.save({"w": torch.ones(2), "rng": (torch.zeros(3, dtype=torch.uint8), 5), "blob": b"abc",
                "groups": {0: {"lr": 0.1}}}, tmp_path / "a.pt")
    s = summary(inspect(tmp_path / "a.pt"))
    values = {o["key"]: o["value"] for o in s["objects"]}
    assert values["rng"] == [{"type": "tensor", "dtype": "uint8", "shape": [3]}, 5]
    assert values["blob"] == {"type": "bytes", "length": 3}
    assert values["groups.0.lr"] == 0.1
    lines = render(s).splitlines()
    assert '  rng = [{"type": "tensor", "dtype": "uint8", "shape": [3]}, 5]' in lines
    assert s["parameters"] == 2  # the model: the tensors beside what is not a model

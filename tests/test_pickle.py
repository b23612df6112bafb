"""ckptkit.codecs.pickle_read and pickle_write: the allow-list unpickler and the pickler of its stand-ins.

Pickles here are written by Python's own pickler from torch's real classes, and what ckptkit writes back is
read by Python's own unpickler into torch's classes again: the oracles are pickle and torch.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
import subprocess

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from _checks import Evil
from ckptkit.codecs.pickle_read import (
    MEMORY_FORMATS,
    Call,
    EnumStandIn,
    Record,
    SafeUnpickler,
    allow_records,
    keep_call,
    ref,
    safe_getattr,
)
from ckptkit.codecs.pickle_write import RefPickler, dumps
from ckptkit.core import dtypes
from ckptkit.errors import FormatError, UnsafeCheckpointError

META = "torch.distributed.checkpoint.metadata"

# What DCP metadata needs, kept as data: records for the dataclasses, calls for torch.Size and friends.
ALLOWED = {
    **allow_records(META, "ChunkStorageMetadata", "TensorStorageMetadata", "TensorProperties", "MetadataIndex"),
    (META, "_MEM_FORMAT_ENCODING"): EnumStandIn(MEMORY_FORMATS, keep_call(META, "_MEM_FORMAT_ENCODING")),
    ("builtins", "getattr"): safe_getattr(),
    ("torch", "Size"): keep_call("torch", "Size"),
    ("torch.serialization", "_get_layout"): keep_call("torch.serialization", "_get_layout"),
    **{("torch", d.name): d for d in dtypes.DTYPES},
}


def unpickle(data: bytes, allowed=ALLOWED, **kwargs):
    return SafeUnpickler(data, allowed, where="ckpt/.metadata", **kwargs).load_checked()


def dcp_metadata() -> dict:
    chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
              ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3]))]
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 3]), chunks)
    return {"w": tensor, "index": [MetadataIndex("w", torch.Size([2, 0]), 1)]}


# ------------------------------------------------------------------------------------------ refusals


class Reduces:
    """Pickles as ``func(*args)``."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("payload, protocol, named", [
    (Reduces(eval, "1 + 1"), 4, "builtins.eval"),
    (Reduces(eval, "1 + 1"), 2, "builtins.eval"),                   # pickled as __builtin__.eval: mapped back
    (Reduces(subprocess.call, ["true"]), 2, "subprocess.call"),
    (Reduces(torch.load, "x.pt"), 2, "torch.serialization.load"),    # torch, but not on the list
    ({"ok": torch.Size([1]), "bad": Reduces(os.getcwd)}, 4, "posix.getcwd"),  # deep inside allowed data
])
def test_safe_unpickler_refuses_a_global_off_the_list_naming_it_and_the_file(payload, protocol, named):
    data = pickle.dumps(payload, protocol=protocol)
    with pytest.raises(UnsafeCheckpointError, match=rf"^ckpt/\.metadata: the pickle asks for {named}, which is not on "
                                                    r"ckptkit's allow-list: .*never runs code from a checkpoint"):
        unpickle(data)


def test_safe_unpickler_never_runs_the_payload(tmp_path):
    marker = tmp_path / "hacked"
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
        unpickle(pickle.dumps(Evil(marker), protocol=2))
    assert not marker.exists()


def test_safe_getattr_allows_enum_members_only():
    # getattr(torch.Size, "__new__") would hand the pickle a callable of its choosing.
    data = pickle.dumps(Reduces(getattr, torch.Size, "__new__"), protocol=2)
    with pytest.raises(UnsafeCheckpointError, match=r"^ckpt/\.metadata: the pickle asks for getattr\(.*, '__new__'\), "
                                                    r"which is not allowed$"):
        unpickle(data)


@pytest.mark.parametrize("data, message", [
    (pickle.dumps({"w": torch.Size([2])}, protocol=2)[:-5], r"cannot read pickle \("),  # truncated
    (b"\x80\x02garbage", r"cannot read pickle \("),                                     # not a pickle
])
def test_safe_unpickler_damaged_pickle_is_a_format_error(data, message):
    with pytest.raises(FormatError, match=rf"^ckpt/\.metadata: {message}"):
        unpickle(data)


@pytest.mark.parametrize("size", [0, 1, 46, 63, 64, 300])  # the walk takes strings under 64 bytes itself
def test_safe_unpickler_walks_strings_to_the_memo_bomb_behind_them(size):
    # A string of each length, then a memo index of 2**28: the guard must still reach it (the C unpickler would
    # size its memo to 4 GiB at once); and a string declaring more bytes than follow is refused by the guard.
    text = b"X" + struct.pack("<I", size) + b"." * size
    with pytest.raises(FormatError, match=rf"^ckpt/\.metadata: cannot read pickle: it stores memo entry 268435456 "
                                          rf"at byte {9 + size}"):
        unpickle(b"\x80\x02" + text + b"0Nr\x00\x00\x00\x10.")
    with pytest.raises(FormatError, match=rf"^ckpt/\.metadata: cannot read pickle: it declares {size + 1} bytes "
                                          rf"at byte 7, but only {size} follow"):
        unpickle(b"\x80\x02X" + struct.pack("<I", size + 1) + b"." * size)


def test_safe_unpickler_refuses_persistent_ids_where_none_belong():
    class WithPid(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", "x") if obj == "tensor" else None

    import io

    buf = io.BytesIO()
    WithPid(buf, protocol=2).dump({"t": "tensor"})
    with pytest.raises(FormatError, match=r"^ckpt/\.metadata: unexpected persistent id \('storage', 'x'\) in a pickle "
                                          r"that should hold none$"):
        unpickle(buf.getvalue())


# ------------------------------------------------------------------------------------------ enum spellings


@pytest.mark.parametrize("spelling", [
    Reduces(_MEM_FORMAT_ENCODING, 0),                                   # Enum(value): CPython up to 3.11
    Reduces(getattr, _MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT"),  # getattr(Enum, NAME): Debian 3.11, 3.12+
], ids=["by-value", "by-name"])
def test_enum_spellings_read_alike(spelling):
    data = pickle.dumps(spelling, protocol=2)
    assert pickle.loads(data) is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT  # Python reads both as the member
    got = unpickle(data)
    assert got == Call(ref(META, "_MEM_FORMAT_ENCODING"), (0,))
    assert pickle.loads(dumps(got, protocol=2)) is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


def test_enum_stand_in_refuses_unknown_member_names():
    data = pickle.dumps(Reduces(getattr, _MEM_FORMAT_ENCODING, "mro"), protocol=2)
    with pytest.raises(UnsafeCheckpointError, match=r"asks for getattr\(.*, 'mro'\), which is not allowed"):
        unpickle(data)


# ------------------------------------------------------------------------------------------ round trips


def test_records_and_calls_round_trip_byte_for_byte_at_protocol_2():
    # Protocol 2 is what torch.save and DCP write: ckptkit's pickle is Python's, byte for byte.
    original = pickle.dumps(dcp_metadata(), protocol=2)
    data = unpickle(original)
    assert isinstance(data["w"], Record) and type(data["w"]).__name__ == "TensorStorageMetadata"
    assert data["w"].size == Call(ref("torch", "Size"), ((4, 3),))
    assert data["w"].properties.state[0] is dtypes.by_name("bfloat16")
    assert dumps(data, protocol=2) == original


@pytest.mark.parametrize("tree", [
    pytest.param(lambda: {"size": ref("torch", "Size"), "s": Call(ref("torch", "Size"), ((2,),))},
                 id="bare-and-called"),
    pytest.param(lambda: [dtypes.by_name("float32"), ref("torch", "float32")], id="dtype-and-its-name"),
    pytest.param(lambda: {"size": ref("torch", "Size"), "data": [
        f"c{module}\n_pickled_global_{i}\n".encode() for module in ("ckptkit.codecs.pickle_read", "ckptkit.core.dtypes")
        for i in range(50)]}, id="global-lines-in-data"),
    pytest.param(lambda: {"w": unpickle(pickle.dumps(dcp_metadata(), protocol=2)), "s": [1.5, 2**70, "x", None]},
                 id="metadata"),
])
def test_dumps_is_the_pure_python_picklers_pickle(tree):
    # dumps runs the C pickler and renames its globals; where it cannot be exact it falls back. Either way the
    # bytes are those of the pure-Python RefPickler (itself checked against Python's pickle above).
    buf = io.BytesIO()
    RefPickler(buf, 2).dump(tree())
    assert dumps(tree(), protocol=2) == buf.getvalue()


def test_records_and_calls_round_trip_at_protocol_4():
    # Python's C pickler memoises strings it has met (a module name repeats as a BINGET); ckptkit's pure-Python
    # pickler memoises the globals themselves. The opcodes differ by those memo references only, and Python
    # reads both into equal objects.
    original = pickle.dumps(dcp_metadata(), protocol=4)
    written = dumps(unpickle(original), protocol=4)
    assert pickle.loads(written) == pickle.loads(original) == dcp_metadata()

    def ops(data: bytes) -> list[str]:
        memo_ops = ("MEMOIZE", "BINGET", "LONG_BINGET", "FRAME", "SHORT_BINUNICODE")
        return [op.name for op, _, _ in pickletools.genops(data) if op.name not in memo_ops]

    assert ops(written) == ops(original)


class Slotted:
    """A class with ``__slots__``: protocol 2 pickles its state as ``(None, {slot: value})``."""

    __slots__ = ("a", "b")

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b


def test_record_of_a_slotted_class_has_its_slots_as_attributes():
    # How ShardedTensor's ShardMetadata reads. (Written back, such a record would carry a dict state: the
    # ShardedTensor writer builds its slotted records with their (None, slots) state explicitly.)
    record = unpickle(pickle.dumps(Slotted(1, [2]), protocol=2), allow_records(__name__, "Slotted"))
    assert (record.a, record.b) == (1, [2])


@pytest.mark.parametrize("protocol", [2, 4])
def test_numpy_rng_state_reads_as_data_and_writes_back_byte_for_byte(protocol):
    import random

    import numpy as np

    from ckptkit.codecs._torch_globals import OBJECT_GLOBALS

    np.random.seed(3)
    value = {"np_rng_state": np.random.get_state(), "random_rng_state": random.getstate(),
             "array": np.arange(6, dtype=np.float32).reshape(2, 3)}
    data = pickle.dumps(value, protocol=protocol)
    read = SafeUnpickler(data, OBJECT_GLOBALS, where="rng.pkl").load_checked()
    assert dumps(read, protocol=protocol) == data
    back = pickle.loads(dumps(read, protocol=protocol))
    assert back["np_rng_state"][0] == "MT19937" and np.array_equal(back["np_rng_state"][1], value["np_rng_state"][1])
    assert back["array"].dtype == np.float32 and np.array_equal(back["array"], value["array"])


def test_numpy_arrays_of_python_objects_are_refused(tmp_path):
    import numpy as np

    from ckptkit.codecs._torch_globals import OBJECT_GLOBALS, WEIGHTS_ONLY_GLOBALS

    data = pickle.dumps(np.array([Evil(tmp_path / "hacked")], dtype=object), protocol=2)
    with pytest.raises(FormatError, match="numpy.dtype.*plain numbers"):
        SafeUnpickler(data, OBJECT_GLOBALS, where="obj.pkl").load_checked()
    assert not (tmp_path / "hacked").exists()
    # torch.load(weights_only=True) refuses numpy arrays; so does its stand-in here.
    with pytest.raises(UnsafeCheckpointError, match="numpy"):
        SafeUnpickler(pickle.dumps(np.zeros(2), protocol=2), WEIGHTS_ONLY_GLOBALS, where="w.pkl").load_checked()

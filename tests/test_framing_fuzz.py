"""Chunk archives of a torch-written DCP, damaged one way at a time, read by torch and by ckptkit.

``DcpIO`` reads the first chunk archive of each length in full and takes later ones from ``ArchiveCache``
when their bytes outside the tensor data equal the first's, but for the holes: the serialization id (which
must still be UTF-8 text) and the records' CRC-32s. Each case damages one archive, the first of its length
(``t0``, read in full) or a later one (``t2``, met by the cache), and reads the checkpoint twice:

- torch reads each chunk as DCP's ``FileSystemReader.read_data`` does (:func:`torch_reads`;
  ``test_torch_reads_as_dcp_load`` holds that to ``dcp.load`` itself);
- ckptkit reads it with ``DcpIO().read`` and each tensor's bytes through ``read_region``.

Where torch reads every chunk, ckptkit gives exactly torch's bytes or refuses, naming the file and a damaged
key; where torch refuses one, ckptkit refuses. The same damage gets the same verdict in the first archive as
in a later one.
"""

from __future__ import annotations

import dataclasses
import io
import random
import re
import shutil
import struct
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from ckptkit.core.plan import Region
from ckptkit.errors import CheckpointError, FormatError
from ckptkit.formats.dcp import DcpIO
from ckptkit.io.sources import Files, read_region

SEED = 20261123
FIRST, LATER = "t0", "t2"  # .metadata names t0 first: read in full; t2 is taken from the cache of t0's framing


@dataclasses.dataclass(frozen=True)
class Source:
    """A one-process ``dcp.save`` and where each chunk's archive lies in its ``__0_0.distcp``."""

    root: Path
    state: dict[str, torch.Tensor]
    chunks: dict[str, tuple[int, int]]
    data: bytes

    def archive(self, key: str) -> bytes:
        start, length = self.chunks[key]
        return self.data[start:start + length]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Source:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    root = tmp_path_factory.mktemp("fuzz") / "dcp"
    gen = torch.Generator().manual_seed(0)
    # Three chunks of one framing, one of another length, one whose data can hold a 300-byte record, and bytes.
    state = {**{f"t{i}": torch.randn(4, 8, generator=gen) for i in range(3)},
             "u": torch.randn(3, 8, generator=gen), "big": torch.randn(16, 8, generator=gen),
             "bytes": torch.arange(32, dtype=torch.uint8).reshape(4, 8)}
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    storage = FileSystemReader(str(root)).read_metadata().storage_data
    chunks = {index.fqn: (info.offset, info.length) for index, info in storage.items()}
    return Source(root, state, chunks, (root / "__0_0.distcp").read_bytes())


def torch_reads(archive: bytes, like: torch.Tensor) -> torch.Tensor | Exception:
    """What DCP's ``FileSystemReader.read_data`` (torch 2.13) makes of a chunk's archive: ``torch.load`` with
    ``weights_only=True``, narrowed to the chunk's box, copied into the state dict's tensor; or its error."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    try:
        tensor = torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, [0] * like.dim(), like.shape)
        if tensor.size() != like.size():
            raise AssertionError(f"mismatch sizes {like.size()} vs {tensor.size()}")
        return torch.zeros_like(like).copy_(tensor.detach())
    except Exception as e:  # torch refuses with many types
        return e


def ckptkit_reads(root: Path) -> dict[str, bytes] | CheckpointError:
    """Each tensor's bytes as ckptkit reads the DCP at ``root``, or its refusal."""
    try:
        manifest = DcpIO().read(root)
    except CheckpointError as e:
        return e
    with Files() as files:
        return {t.key: bytes(read_region(Region.whole(t), files)) for t in manifest.tensors}


class Verdict(NamedTuple):
    torch: str    # "read" or "refused"
    ckptkit: str  # "read" or "refused"
    fault: str | None  # how ckptkit departs from torch; None where it does not


class Trial:
    """A copy of the source in which a case replaces chunk archives, and what torch and ckptkit read of it."""

    def __init__(self, source: Source, root: Path) -> None:
        shutil.copytree(source.root, root)
        self.source, self.root = source, root
        self.intact = {key: torch_reads(source.archive(key), like) for key, like in source.state.items()}

    def judge(self, damaged: dict[str, bytes]) -> Verdict:
        """What torch and ckptkit make of the source with the ``damaged`` archives in place."""
        data = bytearray(self.source.data)
        for key, archive in damaged.items():
            start, length = self.source.chunks[key]
            assert len(archive) == length, "a case keeps the archive's length, so that the cache may take it"
            data[start:start + length] = archive
        file = self.root / "__0_0.distcp"
        file.write_bytes(data)
        theirs = {key: torch_reads(damaged[key], like) if key in damaged else self.intact[key]
                  for key, like in self.source.state.items()}
        refused = {key: e for key, e in theirs.items() if isinstance(e, Exception)}
        torch_says = "refused" if refused else "read"
        ours = ckptkit_reads(self.root)
        if isinstance(ours, CheckpointError):
            if not (str(file) in str(ours) and any(repr(key) in str(ours) for key in damaged)):
                return Verdict(torch_says, "refused", f"refused without naming {file} and a damaged key: {ours}")
            return Verdict(torch_says, "refused", None)
        if refused:
            return Verdict(torch_says, "read", f"torch refuses {', '.join(refused)} "
                                               f"({next(iter(refused.values()))!r:.150}); ckptkit reads")
        differ = [key for key, t in theirs.items() if t.numpy().tobytes() != ours[key]]  # type: ignore[union-attr]
        return Verdict("read", "read", f"ckptkit reads other bytes than torch for {differ}" if differ else None)

    def faults(self, label: str, damage: Callable[[bytearray], None]) -> list[str]:
        """:meth:`judge` of ``damage`` done to the first archive of its length and, apart, to a later one: how
        ckptkit departs from torch in either, and where it reads one and refuses the other that torch takes
        alike (the two archives differ in their holes, which may hold what one damage makes torch refuse)."""
        verdicts, found = [], []
        for key in (FIRST, LATER):
            archive = bytearray(self.source.archive(key))
            damage(archive)
            verdicts.append(self.judge({key: bytes(archive)}))
            if verdicts[-1].fault:
                found.append(f"{label} in {key}: {verdicts[-1].fault}")
        first, later = verdicts
        if first.torch == later.torch and first.ckptkit != later.ckptkit:
            found.append(f"{label}: {first.ckptkit} in the first archive, {later.ckptkit} in a later one")
        return found


@pytest.fixture
def trial(source, tmp_path) -> Trial:
    return Trial(source, tmp_path / "dcp")


# ------------------------------------------------------------------------------ the archive's parts


def layout(archive: bytes) -> dict[str, range]:
    """Named byte ranges of a ``torch.save`` archive: each record's local header (name and padding included),
    bytes, data descriptor and central directory entry; the zip64 end record and locator; the end record."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        infos = z.infolist()
    parts = {}
    for info in infos:
        name, at = info.filename.partition("/")[2], info.header_offset
        name_len, extra_len = struct.unpack_from("<HH", archive, at + 26)
        data = at + 30 + name_len + extra_len
        parts[f"local header of {name}"] = range(at, data)
        parts[name] = range(data, data + info.file_size)
        parts[f"data descriptor of {name}"] = range(data + info.file_size, data + info.file_size + 16)
    end = archive.rindex(b"PK\x05\x06")
    (at,) = struct.unpack_from("<I", archive, end + 16)
    for info in infos:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", archive, at + 28)
        parts[f"directory entry of {info.filename.partition('/')[2]}"] = range(at, at + 46 + name_len + extra_len
                                                                               + comment_len)
        at += 46 + name_len + extra_len + comment_len
    parts["zip64 end record"] = range(at, at + 56)
    parts["zip64 locator"] = range(at + 56, at + 76)
    parts["end record"] = range(end, end + 22)
    return parts


def named(parts: dict[str, range], pos: int) -> str:
    return next(f"{name} +{pos - r.start}" for name, r in parts.items() if pos in r)


def entry(archive: bytes | bytearray, record: str) -> int:
    """Where the central directory entry of ``record`` (named without the ``archive/`` folder) starts."""
    return layout(bytes(archive))[f"directory entry of {record}"].start


def point(archive: bytearray, record: str, name: str, at: str, size: int) -> None:
    """Turn the directory entry of ``record`` into one for ``name`` (no longer than ``record``'s name; the
    rest becomes its extra field) whose bytes are the ``size`` bytes of record ``at``, from its start."""
    parts, raw = layout(bytes(archive)), f"archive/{name}".encode()
    pos = parts[f"directory entry of {record}"].start
    name_len, extra_len = struct.unpack_from("<HH", archive, pos + 28)
    assert len(raw) <= name_len
    archive[pos + 46:pos + 46 + len(raw)] = raw
    struct.pack_into("<HH", archive, pos + 28, len(raw), extra_len + name_len - len(raw))
    struct.pack_into("<II", archive, pos + 20, size, size)
    struct.pack_into("<I", archive, pos + 42, parts[f"local header of {at}"].start)


def assert_refused(trial: Trial, damage: Callable[[bytearray], None], key: str, match: str) -> None:
    """``damage`` to ``key``'s archive makes ckptkit refuse the checkpoint, naming the file, the key and
    ``match``, where torch refuses it too or reads what ckptkit cannot (:meth:`Trial.judge` says which)."""
    archive = bytearray(trial.source.archive(key))
    damage(archive)
    assert trial.judge({key: bytes(archive)})[1:] == ("refused", None)
    with pytest.raises(CheckpointError, match=rf"^{trial.root / '__0_0.distcp'}: '{key}' chunk \[0, 0\]: .*{match}"):
        DcpIO().read(trial.root)


def damaged_pair(trial: Trial, first: Callable[[bytearray], None],
                 later: Callable[[bytearray], None]) -> dict[str, bytes]:
    """The first archive of its length damaged by ``first``, a later one by ``later``."""
    out = {}
    for key, damage in ((FIRST, first), (LATER, later)):
        archive = bytearray(trial.source.archive(key))
        damage(archive)
        out[key] = bytes(archive)
    return out


# ------------------------------------------------------------------------------------ the oracle


def test_torch_reads_as_dcp_load(trial):
    # torch_reads against dcp.load itself: a chunk torch reads as saved, one with other strides, one with a
    # changed CRC-32, and two it refuses (a version above 10, a shape .metadata does not have).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    def replace(old: bytes, new: bytes) -> Callable[[bytearray], None]:
        return lambda a: a.__setitem__(slice(None), bytes(a).replace(old, new))

    cases = {"intact": lambda a: None,
             "strides (7, 1)": replace(b"K\x08K\x01\x86", b"K\x07K\x01\x86"),
             "CRC-32": lambda a: struct.pack_into("<I", a, entry(a, "data/0") + 16, 0x12345678),
             "version 99": replace(b"3\nPK", b"99PK"),
             "shape (4, 7)": replace(b"K\x04K\x08\x86", b"K\x04K\x07\x86")}
    for name, damage in cases.items():
        archive = bytearray(trial.source.archive(LATER))
        damage(archive)
        trial.judge({LATER: bytes(archive)})  # writes it in place
        target = {key: torch.zeros_like(like) for key, like in trial.source.state.items()}
        try:
            dcp.load(target, checkpoint_id=str(trial.root), no_dist=True)
        except CheckpointException as e:
            assert isinstance(torch_reads(bytes(archive), trial.source.state[LATER]), Exception), (name, e)
        else:
            assert torch.equal(torch_reads(bytes(archive), trial.source.state[LATER]), target[LATER]), name
            assert name in ("intact", "strides (7, 1)", "CRC-32")


# ------------------------------------------------------------------------ faults found, one by one


def directory(record: str) -> Callable[[bytearray], None]:
    return lambda a: struct.pack_into("<I", a, entry(a, record) + 38, 0x10)  # external attributes: DOS directory


def slash_name(a: bytearray) -> None:
    # data/0 named data// in the central directory, and the pickle's storage key "0" made "/" to match.
    a[entry(a, "data/0") + 46 + len("archive/data/")] = ord("/")
    a[bytes(a).index(b"X\x01\x00\x00\x000") + 5] = ord("/")


@pytest.mark.parametrize("key", [FIRST, LATER])
@pytest.mark.parametrize("damage, record", [
    (directory("data/0"), "data/0"),       # torch loads a tensor of whatever its buffer held
    (directory("version"), "version"),     # torch fails on whatever the buffer held
    (directory("data.pkl"), "data.pkl"),
    (slash_name, "data//"),                # a name ending in "/" is a directory too
], ids=["data/0", "version", "data.pkl", "name ending in /"])
def test_dcp_read_refuses_a_record_torch_takes_for_a_directory(trial, key, damage, record):
    # miniz takes a record for a directory if its name ends in "/" or its DOS attributes say so, and then
    # reads none of its bytes, and says nothing: what torch loads from it is not what the file holds.
    assert_refused(trial, damage, key, rf"{re.escape(record)} is a directory to torch's zip reader")


def zip64(field: str, value: int) -> Callable[[bytearray], None]:
    def damage(a: bytearray) -> None:
        parts = layout(bytes(a))
        if field == "disks":
            struct.pack_into("<I", a, parts["zip64 locator"].start + 16, value)
        else:
            struct.pack_into("<Q", a, parts["zip64 end record"].start + 4, value)
    return damage


@pytest.mark.parametrize("key", [FIRST, LATER])
@pytest.mark.parametrize("field, value", [
    ("disks", 0),          # the locator's count of disks: miniz takes exactly 1
    ("disks", 2),
    ("record size", 43),   # the zip64 end record's size, less its first 12 bytes: miniz takes 44 or more
])
def test_dcp_read_refuses_zip64_end_records_torch_refuses(trial, key, field, value):
    assert_refused(trial, zip64(field, value), key, r"zip64 end record")


def test_dcp_read_takes_zip64_end_records_torch_takes(trial):
    assert trial.faults("a zip64 end record of 44 bytes", zip64("record size", 44)) == []
    assert trial.judge({LATER: trial.source.archive(LATER)}) == ("read", "read", None)


@pytest.mark.parametrize("key", [FIRST, LATER])
@pytest.mark.parametrize("record, name", [
    (".format_version", "data/0"),       # before data/0 in the directory: torch reads this one
    (".format_version", "DATA/0"),       # miniz compares names without case: the same
    (".storage_alignment", "data/0"),    # torch reads the real one, which ckptkit, taking the first, did not
])
def test_dcp_read_refuses_two_records_of_one_name(trial, key, record, name):
    # A second entry of data/0's name whose bytes are the pickle's: miniz finds a record by binary search over
    # the names sorted without case, so which of the two torch reads depends on the names around them.
    assert_refused(trial, lambda a: point(a, record, name, "data.pkl", 128), key,
                   r"two records named archive/data/0 \(in any case\)")


def serial_over_pickle(stride: int) -> Callable[[bytearray], None]:
    """data.pkl written in ASCII up to requires_grad (no PROTO; MARK ... TUPLE for TUPLE2), with strides
    ``(stride, 1)``, and the serialization id's entry pointing at those ASCII bytes: valid UTF-8 text. The
    id's own bytes and the CRC-32 in its data descriptor, no record's now, are made alike in every archive."""
    def damage(a: bytearray) -> None:
        pkl, serial = layout(bytes(a))["data.pkl"], layout(bytes(a))[".data/serialization_id"]
        a[serial.start:serial.stop + 8] = b"0" * len(serial) + b"PK\x07\x08" + bytes(4)
        text = bytes(a[pkl.start + 2:pkl.stop]).replace(b"K\x04K\x08\x86", b"(K\x04K\x08t").replace(
            b"K\x08K\x01\x86", b"(K" + bytes([stride]) + b"K\x01t")
        a[pkl.start:pkl.stop] = text
        point(a, ".data/serialization_id", ".data/serialization_id", "data.pkl", text.index(b"\x89"))
    return damage


@pytest.mark.parametrize("first, later", [(8, 7), (7, 8)])
def test_dcp_read_compares_a_serialization_id_that_is_also_the_pickle(trial, first, later):
    # Both archives hold what torch reads as strided tensors; the bytes that differ are both the serialization
    # id (a hole the cache skips) and the pickle's strides. The cache must not take one for the other.
    damaged = damaged_pair(trial, serial_over_pickle(first), serial_over_pickle(later))
    assert trial.judge(damaged) == ("read", "read", None)


def version_on_crc(text: bytes) -> Callable[[bytearray], None]:
    """The version record's bytes moved onto the CRC-32 in data/0's directory entry, which holds ``text``."""
    def damage(a: bytearray) -> None:
        crc, header = entry(a, "data/0") + 16, layout(bytes(a))["local header of version"].start
        struct.pack_into("<H", a, header + 28, crc - (header + 30 + len("archive/version")))
        a[crc:crc + 2] = text
    return damage


@pytest.mark.parametrize("later, outcome", [
    (b"99", "refused"),   # torch reads versions 1 to 10
    (b"x\n", "refused"),
    (b"7\n", "read"),
])
def test_dcp_read_compares_a_crc_that_is_also_a_record(trial, later, outcome):
    assert trial.judge(damaged_pair(trial, version_on_crc(b"3\n"), version_on_crc(later))) == (outcome, outcome, None)


@pytest.mark.parametrize("record, text", [
    (".data/serialization_id", b"1" * 256 + b"\xff" * 44),  # torch decodes all of it as UTF-8
    (".storage_alignment", b"64" + b" " * 254 + b"x" * 44),  # int() of all of it
    ("version", b" " * 255 + b"34" + b"\n" * 43),           # std::stoull of all of it: 34
])
def test_dcp_read_refuses_small_records_longer_than_it_reads(trial, record, text):
    def damage(a: bytearray) -> None:
        data = layout(bytes(a))["data/0"].start
        a[data:data + len(text)] = text
        point(a, record, record, "data/0", len(text))

    assert_refused(trial, damage, "big", rf"record {re.escape(record)} holds 300 bytes; ckptkit reads up to 256")


@pytest.mark.parametrize("key", [FIRST, LATER])
@pytest.mark.parametrize("name", ["constants.pkl", "constants.pkl\0x"])  # torch lists names up to a NUL
def test_dcp_read_refuses_an_archive_torch_takes_for_torchscript(trial, key, name):
    # torch.load takes an archive with a constants.pkl record for TorchScript, which weights_only=True refuses.
    assert_refused(trial, lambda a: point(a, ".format_version", name, ".format_version", 1), key,
                   r"torch\.load takes an archive with a constants\.pkl for TorchScript")


def pickle_edit(old: bytes, new: bytes) -> Callable[[bytearray], None]:
    """data.pkl with ``old`` replaced by ``new``, its record's sizes to match (a longer one runs into the data
    descriptor after it, which neither reader reads)."""
    def damage(a: bytearray) -> None:
        pkl = layout(bytes(a))["data.pkl"]
        text = bytes(a[pkl.start:pkl.stop]).replace(old, new)
        a[pkl.start:pkl.start + len(text)] = text
        struct.pack_into("<II", a, entry(a, "data.pkl") + 20, len(text), len(text))
    return damage


@pytest.mark.parametrize("key", [FIRST, LATER])
@pytest.mark.parametrize("damage, match", [
    (pickle_edit(b"X\x07\x00\x00\x00storage", b"T\x07\x00\x00\x00storage"), "BINSTRING"),
    (pickle_edit(b"X\x03\x00\x00\x00cpu", b"B\x03\x00\x00\x00cpu"), "BINBYTES"),
    (pickle_edit(b"X\x03\x00\x00\x00cpu", b"\x8b\x03\x00\x00\x00cpu"), "LONG4"),
    (pickle_edit(b")R", b")0"), "POP"),
    (pickle_edit(b"ccollections\nOrderedDict\n", b"cbuiltins\nfrozenset\n"), "builtins.frozenset"),
    (pickle_edit(b"ccollections\nOrderedDict\nq\x08)R", b"cbuiltins\nslice\nq\x08N\x85R"), "builtins.slice"),
], ids=["BINSTRING", "BINBYTES", "LONG4", "POP", "frozenset", "slice"])
def test_dcp_read_refuses_pickles_torch_weights_only_refuses(trial, key, damage, match):
    # DCP loads every chunk with torch.load(weights_only=True), whose unpickler knows fewer opcodes and globals
    # than Python's; these chunks would be the tensors torch saved, had it read them.
    assert_refused(trial, damage, key, re.escape(match))


def test_dcp_read_refuses_a_storage_class_torch_weights_only_refuses(trial):
    # torch.save names torch.storage.UntypedStorage; torch.UntypedStorage, the same class, is not on the
    # weights-only allow-list. A uint8 chunk so named would be the tensor torch saved, had it read it.
    assert_refused(trial, pickle_edit(b"ctorch\nByteStorage\n", b"ctorch\nUntypedStorage\n"), "bytes",
                   r"torch\.UntypedStorage")


@pytest.mark.parametrize("key", [FIRST, LATER])
def test_dcp_read_names_the_key_of_a_chunk_whose_tensor_overruns_its_storage(trial, key):
    # Storage offset 2 in the pickle: torch refuses it (out of bounds). ckptkit's check, made as the pickle
    # is read, knows the file alone; the refusal names the chunk too.
    assert_refused(trial, pickle_edit(b"QK\x00", b"QK\x02"), key,
                   r"the tensor on storage 'data/0': offset 2 and float32 \[4, 8\] with strides \[8, 1\] need 136")


def with_archive(trial: Trial, key: str, archive: bytes) -> None:
    """The trial's checkpoint with ``key``'s chunk archive replaced by ``archive``, of any length: the chunks
    after it move, and ``.metadata`` (torch's own, pickled as DCP pickles it) says where. For a case that
    :meth:`Trial.judge` does not read."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(trial.root)).read_metadata()
    out = bytearray()
    for index, info in sorted(md.storage_data.items(), key=lambda item: item[1].offset):
        chunk = archive if index.fqn == key else trial.source.data[info.offset:info.offset + info.length]
        md.storage_data[index] = dataclasses.replace(info, offset=len(out), length=len(chunk))
        out += chunk
    (trial.root / "__0_0.distcp").write_bytes(out)
    (trial.root / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("parameter", [False, True], ids=["tensor", "Parameter"])
@pytest.mark.parametrize("attribute, value", [
    ("data", lambda t: t.reshape(8, 4).t()),  # torch sets the loaded tensor's data to this view
    ("real", lambda t: t.flip(0)),            # torch copies this view in
    ("shape", lambda t: (8, 4)),              # torch cannot set it, and refuses the chunk
    ("_has_been_cloned", lambda t: True),     # a plain attribute (FSDP1's): torch keeps it, the tensor is the same
])
def test_dcp_read_refuses_a_tensor_state_that_sets_the_tensor_s_own_attribute(trial, attribute, value, parameter):
    # torch.save pickles a tensor (or Parameter) that carries Python attributes with _rebuild_from_type_v2
    # (_rebuild_parameter_with_state), and torch.load setattr()s each on the tensor it rebuilt.
    t = trial.source.state[LATER].clone()
    t = torch.nn.Parameter(t) if parameter else t
    t.__dict__[attribute] = value(t.detach())
    buf = io.BytesIO()
    torch.save(t, buf)
    with_archive(trial, LATER, buf.getvalue())
    theirs, ours = torch_reads(buf.getvalue(), trial.source.state[LATER]), ckptkit_reads(trial.root)
    if attribute == "_has_been_cloned":
        assert not isinstance(ours, Exception) and ours[LATER] == theirs.numpy().tobytes()  # type: ignore[union-attr]
        return
    assert isinstance(ours, FormatError)
    assert re.match(rf"^{trial.root / '__0_0.distcp'}: '{LATER}' chunk \[0, 0\]: .*sets the tensor's own attribute "
                    rf"'{attribute}'", str(ours)), ours
    assert isinstance(theirs, Exception) or not torch.equal(theirs, trial.source.state[LATER])


# ------------------------------------------------------------------------------------------ sweeps

Damage = tuple[str, Callable[[bytearray], None]]


def set_byte(parts: dict[str, range], pos: int, value: int) -> Damage:
    def damage(a: bytearray) -> None:
        a[pos] = value
    return f"{named(parts, pos)} = {value:#04x}", damage


def set_bytes(parts: dict[str, range], pos: int, value: bytes) -> Damage:
    def damage(a: bytearray) -> None:
        a[pos:pos + len(value)] = value
    return f"{named(parts, pos)} = {value!r}", damage


def headers(parts: dict[str, range]) -> Iterator[int]:
    """The fixed fields of the zip structures: local headers, directory entries, the end records."""
    for name, r in parts.items():
        if name.startswith("local header"):
            yield from r[:30]
        elif name.startswith("directory entry"):
            yield from r[:46]
        elif name.endswith(("end record", "locator")):
            yield from r


def names_and_padding(parts: dict[str, range]) -> Iterator[int]:
    for name, r in parts.items():
        if name.startswith("local header"):
            yield from r[30:]
        elif name.startswith("directory entry"):
            yield from r[46:]


def sweep_header_bits(parts: dict[str, range], archive: bytes, rng: random.Random) -> Iterator[Damage]:
    # One bit of every header byte, the bit drawn: offsets, sizes, lengths, signatures, attributes, disks.
    for pos in headers(parts):
        yield set_byte(parts, pos, archive[pos] ^ 1 << rng.randrange(8))


def sweep_header_bytes(parts: dict[str, range], archive: bytes, rng: random.Random) -> Iterator[Damage]:
    for pos in headers(parts):
        yield set_byte(parts, pos, rng.choice([v for v in range(256) if v != archive[pos]]))


def sweep_names(parts: dict[str, range], archive: bytes, rng: random.Random) -> Iterator[Damage]:
    # Record names (case included: miniz ignores it) and the "FB" padding fields, a bit of every other byte.
    for pos in names_and_padding(parts):
        if rng.random() < 0.5:
            yield set_byte(parts, pos, archive[pos] ^ 1 << rng.randrange(8))


def sweep_pickle(parts: dict[str, range], archive: bytes, rng: random.Random) -> Iterator[Damage]:
    # Opcodes, the storage key and location, numel, offset, shape, strides, requires_grad, the hooks.
    for pos in parts["data.pkl"]:
        yield set_byte(parts, pos, archive[pos] ^ 1 << rng.randrange(8))
        yield set_byte(parts, pos, rng.choice([v for v in range(256) if v != archive[pos]]))


def sweep_small_records(parts: dict[str, range], archive: bytes, rng: random.Random) -> Iterator[Damage]:
    # Every bit and eight drawn values of version, byteorder, .storage_alignment and .format_version.
    for record in ("version", "byteorder", ".storage_alignment", ".format_version"):
        for pos in parts[record]:
            for bit in range(8):
                yield set_byte(parts, pos, archive[pos] ^ 1 << bit)
            for value in rng.sample([v for v in range(256) if v != archive[pos]], 8):
                yield set_byte(parts, pos, value)


def sweep_descriptors(parts: dict[str, range], archive: bytes, rng: random.Random) -> Iterator[Damage]:
    # Data descriptors (signature, CRC-32, sizes), which torch never reads.
    for name, r in parts.items():
        if name.startswith("data descriptor"):
            for pos in r:
                yield set_byte(parts, pos, rng.choice([v for v in range(256) if v != archive[pos]]))


def sweep_holes(parts: dict[str, range], archive: bytes, rng: random.Random) -> Iterator[Damage]:
    # Any CRC-32 (torch checks none); serialization ids of other text, or of bytes that are not UTF-8.
    for name, r in parts.items():
        if name.startswith("directory entry"):
            crcs = [r.start + 16]
        elif name.startswith("data descriptor"):
            crcs = [r.start + 4]
        else:
            continue
        for at in crcs:
            for _ in range(3):
                yield set_bytes(parts, at, rng.randbytes(4))
    serial = parts[".data/serialization_id"].start
    texts = [b"0" * 40, "é".encode() * 20, "\u20ac".encode() * 13 + b"x", "\U0001f600".encode() * 10, bytes(40),
             bytes(rng.randrange(0x20, 0x7F) for _ in range(40))]
    for bad in (b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xff"):
        for at in (0, 17, 40 - len(bad)):
            texts.append(texts[0][:at] + bad + texts[0][at + len(bad):])
    for text in texts:
        yield set_bytes(parts, serial, text)


SWEEPS = {
    "header bits": sweep_header_bits, "header bytes": sweep_header_bytes, "names and padding": sweep_names,
    "data.pkl": sweep_pickle, "small records": sweep_small_records, "data descriptors": sweep_descriptors,
    "holes": sweep_holes,
}


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_dcp_read_agrees_with_torch_on_damaged_chunk_archives(trial, sweep):
    first = trial.source.archive(FIRST)
    parts = layout(first)
    assert layout(trial.source.archive(LATER)) == parts  # one framing: the cache takes t2 for t0's
    damages = list(SWEEPS[sweep](parts, first, random.Random(f"{SEED} {sweep}")))
    found = [fault for label, damage in damages for fault in trial.faults(label, damage)]
    assert not found, f"{len(found)} faults in {len(damages)} damaged archives:\n" + "\n".join(found)

"""ckptkit.codecs.torchzip_read and torchzip_write: ``torch.save`` archives read as data and laid out as parts.

torch is the oracle both ways: archives torch writes are read back byte for byte, archives ckptkit lays out
are loaded by ``torch.load`` and parsed by torch's own zip reader, and their pickles are compared with the ones
``torch.save`` writes.
"""

from __future__ import annotations

import bisect
import io
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from _checks import assert_same_tree, load_full, make_zoo, random_bits, record_start
from ckptkit.codecs.torchzip_read import ArchiveCache, is_archive, read_archive
from ckptkit.codecs.torchzip_write import PartsTensor, _central, archive_parts
from ckptkit.core.dtypes import DTYPES, by_name
from ckptkit.core.manifest import Chunk, Span, TensorEntry, TensorRef, map_tensor_refs
from ckptkit.core.plan import Bytes, FilePlan, Part, Region
from ckptkit.errors import FormatError
from ckptkit.io.sources import Files, read_region
from ckptkit.io.storage.local.writer import write_files

F32 = by_name("float32")


def as_torch(ref: TensorRef, files: Files) -> torch.Tensor:
    """The tensor a :class:`TensorRef` describes, read through its byte span (row-major)."""
    data = read_region(Region.whole(ref.as_entry(("t",))), files)
    t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return t.view(getattr(torch, ref.dtype.name)).reshape(ref.shape)


def read_as_torch(path: Path, **kwargs):
    with Files() as files:
        return map_tensor_refs(read_archive(str(path), **kwargs), lambda ref: as_torch(ref, files))


def as_regions(tree, cast=None):
    return map_tensor_refs(tree, lambda ref: Region.whole(ref.as_entry(("t",)), cast))


def write_archive(tmp_path: Path, tree, name: str = "out.pt") -> Path:
    write_files((FilePlan(name, archive_parts(tree, name=Path(name).stem)),), tmp_path)
    return tmp_path / name


def contiguous(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().contiguous()
    if isinstance(tree, dict):
        return type(tree)((k, contiguous(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(contiguous(v) for v in tree)
    return tree


# ------------------------------------------------------------------------------------------ reading


def _views() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    embed = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    return {"transposed": base.t(), "rows": base[1:3], "columns": base[:, 2:5], "strided": base[::2, ::3],
            "expanded": torch.arange(3.0).expand(4, 3), "embed": embed, "tied": embed}


TREES = {
    "zoo": make_zoo(),                                                  # every case of the byte planner
    "every-dtype": {str(d): random_bits((2, 3), getattr(torch, d.name), torch.Generator().manual_seed(0))
                    for d in DTYPES},
    "views": _views(),                                                  # offsets, strides, shared storage
    "nested": {"model": {"w": torch.ones(2)}, "opt": {"state": {0: {"step": torch.tensor(3.0)}},
                                                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]},
               "rng": (torch.arange(3), 5), "name": "run", "none": None, "set": {1, 2}},
    "bare-tensor": torch.arange(6.0).reshape(2, 3),
    "list": [torch.ones(1), 2, "three"],
}


@pytest.mark.parametrize("protocol", [2, 4])  # torch.save's default, and what some trainers pass
@pytest.mark.parametrize("name", TREES)
def test_read_archive_of_torch_save_holds_torch_s_tensors(tmp_path, name, protocol):
    tree = TREES[name]
    torch.save(tree, tmp_path / "t.pt", pickle_protocol=protocol)
    assert_same_tree(read_as_torch(tmp_path / "t.pt"), contiguous(tree))


def test_read_archive_keeps_strides_offsets_and_shared_storage(tmp_path):
    torch.save(_views(), tmp_path / "v.pt")
    refs = read_archive(str(tmp_path / "v.pt"))
    views = _views()
    for key in ("transposed", "columns", "strided", "expanded"):
        assert refs[key].strides == views[key].stride(), key
    assert refs["rows"].strides is None  # row-major, one row into its storage
    assert refs["rows"].span.offset == refs["transposed"].span.offset + 6 * 4
    assert refs["embed"].span == refs["tied"].span  # one storage in the file, as torch saved it


def test_read_archive_inside_a_larger_file(tmp_path):
    # A DCP chunk: an archive at some offset of a .distcp file, between other bytes.
    buf = io.BytesIO()
    torch.save({"w": torch.arange(5)}, buf)
    head, archive = b"x" * 100, buf.getvalue()
    (tmp_path / "f").write_bytes(head + archive + b"y" * 50)
    assert is_archive(str(tmp_path / "f"), len(head)) and not is_archive(str(tmp_path / "f"))
    got = read_as_torch(tmp_path / "f", start=len(head), length=len(archive))
    assert_same_tree(got, {"w": torch.arange(5)})


def test_archive_cache_takes_only_archives_framed_as_one_it_checked(tmp_path):
    # DCP chunks as ckptkit's writer lays them out: archives of one shape, back to back in a .distcp file.
    archives = []
    for seed in range(3):
        t = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        archives.append(bytearray(write_archive(tmp_path, as_regions(read_as_torch_tree(tmp_path, t))).read_bytes()))
    pkl = archives[2].find(b"data.pkl") + 40  # inside data.pkl's record: a changed pickle byte
    archives[2][pkl] ^= 0xFF
    path = tmp_path / "f.distcp"
    path.write_bytes(b"".join(archives))
    n, cache = len(archives[0]), ArchiveCache()
    with open(path, "rb") as f:
        def pread(size: int, offset: int) -> bytes:
            return os.pread(f.fileno(), size, offset)

        assert cache.lookup(pread, str(path), 0, n) is None  # nothing checked yet
        assert cache.read(str(path), 0, n, pread=pread, where="chunk 0") == read_archive(str(path), 0, n, tree=False)
        # Same framing, other tensor bytes: the cache gives what a full read gives, and torch agrees.
        ref = cache.lookup(pread, str(path), n, n)
        assert ref == read_archive(str(path), n, n, tree=False)
        with Files() as files:
            assert torch.equal(as_torch(ref, files), torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))
        # A changed byte outside the tensor data: the cache refuses it, so the full read and its checks run.
        assert cache.lookup(pread, str(path), 2 * n, n) is None


def read_as_torch_tree(tmp_path: Path, t: torch.Tensor):
    """``t`` saved by torch and read back as :class:`TensorRef` (what :func:`as_regions` takes)."""
    torch.save(t, tmp_path / "t.pt")
    return read_archive(str(tmp_path / "t.pt"))


def test_read_archive_refuses_compressed_records(tmp_path):
    with zipfile.ZipFile(tmp_path / "c.pt", "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("c/data.pkl", pickle.dumps({}, protocol=2))
    with pytest.raises(FormatError, match=rf"^{tmp_path / 'c.pt'}: not a torch\.save archive torch can read \(record "
                                          r"c/data\.pkl is compressed or encrypted; torch\.save archives store records "
                                          r"raw\)$"):
        read_archive(str(tmp_path / "c.pt"))


def test_read_archive_refuses_a_zip_without_data_pkl(tmp_path):
    with zipfile.ZipFile(tmp_path / "z.pt", "w") as z:
        # One directory and a version record, as torch.save writes them, but no data.pkl.
        z.writestr("z/version", "3\n")
        z.writestr("z/notes.txt", "hello")
    with pytest.raises(FormatError, match=r"z\.pt: no data\.pkl record; not a torch\.save archive"):
        read_archive(str(tmp_path / "z.pt"))


def test_read_archive_reads_an_archive_repacked_with_directory_entries(tmp_path):
    # zip -r, and zipfile's mkdir, write an entry per directory ("m/", "m/data/"): miniz takes them for
    # directories, but torch looks up no name ending in "/", and loads the archive as the one torch.save wrote.
    tree = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    torch.save(tree, tmp_path / "m.pt")
    with zipfile.ZipFile(tmp_path / "m.pt") as src, zipfile.ZipFile(tmp_path / "r.pt", "w") as out:
        for folder in ("m", "m/data", "m/.data"):
            out.mkdir(folder)
        for info in src.infolist():
            out.writestr(info.filename, src.read(info))
    assert_same_tree(torch.load(tmp_path / "r.pt", weights_only=True), tree)
    assert_same_tree(read_as_torch(tmp_path / "r.pt"), tree)


def test_read_archive_refuses_a_tensor_whose_state_sets_its_data(tmp_path):
    # torch.save pickles a tensor's Python attributes as the state of _rebuild_from_type_v2, and torch.load
    # setattr()s them: a "data" attribute that is another view of the storage is what torch.load gives back.
    w = torch.arange(12.0).reshape(3, 4)
    w.__dict__["data"] = w.reshape(4, 3).t()
    torch.save({"w": w}, tmp_path / "m.pt")
    assert torch.equal(torch.load(tmp_path / "m.pt", weights_only=True)["w"], w.reshape(4, 3).t())
    with pytest.raises(FormatError, match=rf"^{tmp_path / 'm.pt'}: a tensor's pickled state sets the tensor's own "
                                          r"attribute 'data'; torch would set it on the tensor it loads"):
        read_archive(str(tmp_path / "m.pt"))


def test_tensor_attributes_are_torch_s_own():
    # The attributes ckptkit refuses in a tensor's pickled state: all that torch.Tensor (and Parameter)
    # defines as data descriptors, so that a torch that adds one fails here first.
    import inspect

    from ckptkit.codecs._torch_globals import _TENSOR_ATTRIBUTES

    for cls in (torch.Tensor, torch.nn.Parameter):
        own = {name for c in cls.__mro__ for name, v in vars(c).items() if inspect.isdatadescriptor(v)}
        assert own <= _TENSOR_ATTRIBUTES, own - _TENSOR_ATTRIBUTES


# ------------------------------------------------------------------------------------------ writing


@pytest.mark.parametrize("name", TREES)
def test_archive_parts_loaded_by_torch(tmp_path, name):
    tree = TREES[name]
    torch.save(tree, tmp_path / "src.pt")
    out = write_archive(tmp_path, as_regions(read_archive(str(tmp_path / "src.pt"))))
    assert_same_tree(load_full(out), contiguous(tree))


def test_archive_parts_cast_regions(tmp_path):
    tree = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "i": torch.arange(3)}
    torch.save(tree, tmp_path / "src.pt")
    refs = read_archive(str(tmp_path / "src.pt"))
    bf16 = by_name("bfloat16")
    out = write_archive(tmp_path, {"w": Region.whole(refs["w"].as_entry(("w",)), bf16),
                                   "i": Region.whole(refs["i"].as_entry(("i",)))})
    assert_same_tree(load_full(out), {"w": tree["w"].to(torch.bfloat16), "i": tree["i"]})


def test_archive_parts_of_a_parts_tensor(tmp_path):
    # An FSDP1 flat parameter rebuilt from its original parameters: pieces of two tensors and padding.
    torch.save({"a": torch.arange(6.0).reshape(2, 3), "b": torch.arange(10.0, 14.0)}, tmp_path / "src.pt")
    refs = read_archive(str(tmp_path / "src.pt"))
    a, b = refs["a"].as_entry(("a",)), refs["b"].as_entry(("b",))
    flat = PartsTensor(F32, (Region(a, (1, 0), (1, 3)), Bytes(bytes(8)), Region(b, (0,), (2,))))
    out = write_archive(tmp_path, {"flat": flat})
    assert_same_tree(load_full(out), {"flat": torch.tensor([3.0, 4.0, 5.0, 0.0, 0.0, 10.0, 11.0])})


def _records(path: Path) -> list[tuple[str, int]]:
    """(name, offset of the data) of each record, from the local headers."""
    out = []
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            out.append((info.filename.split("/", 1)[1], record_start(raw, info)))
    return out


def test_archive_parts_lays_out_records_as_torch_save(tmp_path):
    tree = make_zoo()
    torch.save(tree, tmp_path / "torch.pt")
    ours = write_archive(tmp_path, as_regions(read_archive(str(tmp_path / "torch.pt"))), "ours.pt")
    theirs, mine = _records(tmp_path / "torch.pt"), _records(ours)
    # The same records in the same order (storage keys are numbered alike), and every record's data on a
    # 64-byte boundary in both, torch's rule. The offsets themselves differ: the pickles differ in length (see
    # below) and each writer pads its own way to the next boundary.
    assert [n for n, _ in mine] == [n for n, _ in theirs]
    assert all(offset % 64 == 0 for _, offset in mine + theirs)


# ------------------------------------------------------------------------------------------ pickles


@dataclass(frozen=True)
class Global:
    """A global named in a pickle, kept as its name; calling it records the call."""

    name: str

    def __call__(self, *args):
        return ("call", self.name, args)


class Symbolic(pickle.Unpickler):
    """Unpickles anything into names and calls, so that two pickles compare by what they say."""

    def find_class(self, module: str, name: str) -> Global:
        return Global(f"{module}.{name}")

    def persistent_load(self, pid):
        return ("persistent", *pid)


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def symbolic(data: bytes):
    return Symbolic(io.BytesIO(data)).load()


def test_archive_pickle_is_torch_save_s_byte_for_byte(tmp_path):
    # Every dtype, the typed-storage ones (_rebuild_tensor_v2 over torch.FloatStorage, counted in elements) and the
    # newer ones (float8, uint16/32/64: _rebuild_tensor_v3 over an untyped storage), plus the containers around them.
    tree = {d.name: torch.zeros(2, 3).to(getattr(torch, d.name)) for d in DTYPES}
    tree["nested"] = {"state": {0: {"step": torch.tensor(3.0)}}, "betas": (0.9, 0.95), "groups": [{"lr": 0.1}]}
    torch.save(tree, tmp_path / "torch.pt")
    ours = write_archive(tmp_path, as_regions(read_archive(str(tmp_path / "torch.pt"))), "ours.pt")
    assert data_pkl(ours) == data_pkl(tmp_path / "torch.pt")


def test_archive_pickle_of_the_zoo_says_what_torch_save_s_says(tmp_path):
    # Views and shared storages aside (ckptkit writes each tensor as its own contiguous storage), the pickle of
    # odd shapes, 0-d and empty tensors has the same calls, containers, values, storage keys and order.
    tree = {**make_zoo(), "nested": {"state": {0: {"step": torch.tensor(3.0)}}, "lr": [0.1, (0.9, 0.95)]}}
    torch.save(tree, tmp_path / "torch.pt")
    ours = write_archive(tmp_path, as_regions(read_archive(str(tmp_path / "torch.pt"))), "ours.pt")
    assert symbolic(data_pkl(ours)) == symbolic(data_pkl(tmp_path / "torch.pt"))


# ------------------------------------------------------------------------------------------ zip64, purely


class PlannedFile(io.RawIOBase):
    """The file a list of parts describes, readable without writing it: :class:`Bytes` parts as they are,
    tensor regions as zeros (never read from their sources)."""

    def __init__(self, parts: tuple[Part, ...]) -> None:
        self.starts, pos = [], 0
        for p in parts:
            self.starts.append(pos)
            pos += p.nbytes
        self.parts, self.size, self.pos = parts, pos, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def readinto(self, buf) -> int:
        end = min(self.size, self.pos + len(buf))
        out = bytearray()
        while self.pos < end:
            i = bisect.bisect_right(self.starts, self.pos) - 1
            part, start = self.parts[i], self.starts[i]
            stop = min(end, start + part.nbytes)
            out += part.data[self.pos - start:stop - start] if isinstance(part, Bytes) else bytes(stop - self.pos)
            self.pos = stop
        buf[:len(out)] = out
        return len(out)


def fake_tensor(key: str, nbytes: int) -> Region:
    """A float32 tensor whose bytes would lie in a file that does not exist: planning never opens it."""
    n = nbytes // 4
    chunk = Chunk((0,), (n,), Span(f"/nonexistent/{key}", 0, nbytes))
    return Region.whole(TensorEntry(key, (key,), F32, (n,), (chunk,)))


def test_archive_parts_of_a_5_gib_tensor_are_zip64_and_aligned():
    big = 5 << 30
    parts = archive_parts({"big": fake_tensor("big", big), "small": fake_tensor("small", 12)}, name="archive")
    planned = PlannedFile(parts)
    assert planned.size > big

    # Python's zipfile reads the zip64 sizes and offsets from the central directory...
    with zipfile.ZipFile(planned) as z:
        sizes = {i.filename: (i.file_size, i.compress_type) for i in z.infolist()}
        offsets = {i.filename: i.header_offset for i in z.infolist()}
        pkl = z.read("archive/data.pkl")
    assert sizes["archive/data/0"] == (big, zipfile.ZIP_STORED)
    assert offsets["archive/data/1"] > 1 << 32  # past 4 GiB: only zip64 can say where

    # ...and torch's own reader finds every record 64-byte aligned, where torch.load would map it.
    planned.seek(0)
    reader = torch._C.PyTorchFileReader(planned)
    records = reader.get_all_records()
    assert set(records) == {"data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0", "data/1",
                            "version", ".data/serialization_id"}
    assert all(reader.get_record_offset(r) % 64 == 0 for r in records)
    assert reader.get_record("data.pkl") is not None
    tree = symbolic(pkl)
    assert tree["big"][1] == "torch._utils._rebuild_tensor_v2"
    storage, _, shape, _, _, _ = tree["big"][2]  # a typed storage counts elements, as torch.save's does
    assert (storage[2], storage[-1], shape) == (Global("torch.FloatStorage"), big // 4, (big // 4,))


def test_central_directory_of_more_than_65535_records_is_zip64():
    # The count alone calls for zip64: 70,000 one-byte records (their headers are not needed to list them).
    entries = [(f"a/data/{i}".encode(), 1, 0, 100 * i) for i in range(70_000)]
    directory = _central(entries, cd_offset=100 * 70_000)
    planned = PlannedFile((Bytes(bytes(100 * 70_000)), Bytes(directory)))
    with zipfile.ZipFile(planned) as z:
        infos = z.infolist()
    assert len(infos) == 70_000 and infos[-1].header_offset == 100 * 69_999


@pytest.mark.parametrize("reads", [
    [(100, 0), (100, 100), (50, 200), (300, 250)],                  # in order: the second reads ahead
    [(100, 0), (100, 100), (100, 150_000), (100, 150_100)],         # a jump past the block: read as asked
    [(100, 0), (100, 100), (100, 50), (100, 0)],                    # backwards, inside the block read ahead
    [(1000, 199_500), (1000, 200_500), (1000, 200_900), (10, 210_000)],  # up to and past the end of the file
    [(100, 0), (40_000, 100), (100, 40_100)],                       # a large read does not read ahead
])
def test_files_pread_gives_what_os_pread_gives_whatever_the_order(tmp_path, reads):
    data = os.urandom(201_000)
    (tmp_path / "f").write_bytes(data)
    with Files() as files, open(tmp_path / "f", "rb") as f:
        pread = files.pread(str(tmp_path / "f"), 100)
        for n, offset in reads:
            assert pread(n, offset) == os.pread(f.fileno(), n, offset) == data[offset:offset + n]

"""Bad input and refused requests: every error names the file or key at fault, and nothing is left half-written."""

from __future__ import annotations

import collections
import datetime
import errno
import json
import pickle
import struct
from pathlib import Path

import pytest
import torch

from _checks import Evil, hash_tree, leftovers
from ckptkit.errors import FormatError, IncompleteCheckpointError, UnsafeCheckpointError, UsageError
from ckptkit.io.storage.local import writer as executor
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.export import export_hf
from ckptkit.ops.inspect import inspect
from ckptkit.ops.verify import verify


class ForgedStrides:
    """Pickles as a tensor whose strides do not match its shape, which only a damaged or forged file holds."""

    def __init__(self, t: torch.Tensor, strides: tuple[int, ...]) -> None:
        self.t, self.strides = t, strides

    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_tensor_v2,
                (self.t.untyped_storage(), 0, tuple(self.t.shape), self.strides, False, collections.OrderedDict()))


# ------------------------------------------------------------------------------------ damaged DCP


@pytest.mark.parametrize("keep", [
    10,     # only the first bytes of the archive remain
    200,    # the archive's local headers but no data or directory
    -5,     # all but the last 5 bytes (the end of the zip directory)
])
def test_convert_truncated_distcp_names_the_file(tmp_path, dcp_ckpt, keep):
    rank1 = dcp_ckpt / "__1_0.distcp"
    data = rank1.read_bytes()[:keep]
    rank1.write_bytes(data)
    # .metadata's spans are checked against the file's size before any byte of it is parsed.
    with pytest.raises(FormatError, match=rf"^{rank1}: '[\w.]+' needs bytes up to offset \d+ but the file has "
                                          rf"{len(data)} \(truncated\?\)$"):
        convert(dcp_ckpt, tmp_path / "out.pt", to="full")
    assert not (tmp_path / "out.pt").exists() and not leftovers(tmp_path)


def test_convert_missing_rank_file_names_it(tmp_path, dcp_ckpt):
    (dcp_ckpt / "__1_0.distcp").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"dcp2: __1_0\.distcp \(holding 'model\.\w+'\) is missing"):
        convert(dcp_ckpt, tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf").exists()


def test_inspect_corrupt_metadata_names_it(dcp_ckpt):
    meta = dcp_ckpt / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    with pytest.raises(FormatError, match=rf"{meta}: cannot read pickle"):
        inspect(dcp_ckpt)


def test_inspect_metadata_pointing_outside_the_checkpoint(tmp_path, dcp_ckpt):
    meta = dcp_ckpt / ".metadata"
    md = pickle.loads(meta.read_bytes())  # written by ckptkit in this test: trusted
    (tmp_path / "outside.distcp").write_bytes((dcp_ckpt / "__0_0.distcp").read_bytes())
    index, info = next(iter(md.storage_data.items()))
    info.relative_path = "../outside.distcp"
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(FormatError, match=rf"{index.fqn!r} points outside the checkpoint \('\.\./outside\.distcp'\)"):
        inspect(dcp_ckpt)


# ------------------------------------------------------------------------------------ hostile pickles


def test_inspect_refuses_metadata_naming_os_system(tmp_path, dcp_ckpt):
    marker = tmp_path / "hacked"
    (dcp_ckpt / ".metadata").write_bytes(pickle.dumps(Evil(marker), protocol=2))
    for run in (lambda: inspect(dcp_ckpt), lambda: convert(dcp_ckpt, tmp_path / "out.pt", to="full"),
                lambda: verify(dcp_ckpt, dcp_ckpt)):
        with pytest.raises(UnsafeCheckpointError, match=rf"{dcp_ckpt / '.metadata'}: the pickle asks for "
                                                        r"posix\.system, which is not on ckptkit's allow-list"):
            run()
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(("value", "found", "says"), [
    # a dtype torch writes that ckptkit lacks: ckptkit's gap, said so
    (torch.zeros(2, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2), r"torch\.float4_e2m1fn_x2",
     r"torch\.float4_e2m1fn_x2 is a torch dtype that ckptkit does not support yet \(torch writes it; ckptkit "
     r"cannot read it\)"),
    # one of torch's own classes
    (torch.nn.Linear(2, 2), r"torch\.nn\.modules\.linear\.Linear",
     r"it belongs to torch, and ckptkit does not support it here \(a gap in ckptkit, not a fault of the "
     r"checkpoint\)"),
    # the user's own code
    (datetime.timedelta(seconds=1), r"datetime\.timedelta",
     r"it comes from 'datetime', not torch, and ckptkit never runs code from a checkpoint; save that entry as plain "
     r"data"),
])
def test_convert_refusal_names_what_it_found_and_whose_support_is_missing(tmp_path, value, found, says):
    torch.save({"w": torch.ones(2), "x": value}, tmp_path / "a.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"a\.pt: the pickle asks for {found}, which is not on "
                                                    rf"ckptkit's allow-list: {says}") as e:
        convert(tmp_path / "a.pt", tmp_path / "out", to="sharded")
    assert "custom classes" not in str(e.value)


def test_convert_refuses_torch_save_file_with_code(tmp_path):
    marker = tmp_path / "hacked"
    torch.save({"w": torch.ones(2), "payload": Evil(marker)}, tmp_path / "evil.pt")
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=rf"{tmp_path / 'evil.pt'}: the pickle asks for posix\.system"):
        convert(tmp_path / "evil.pt", tmp_path / "out", to="sharded")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("strides", [
    (1,),       # fewer strides than dimensions: planning the copies would index past them
    (3, 1, 1),  # more: the extra one would be ignored
])
def test_convert_torch_save_tensor_with_strides_not_one_per_dimension(tmp_path, strides):
    torch.save({"w": ForgedStrides(torch.ones(2, 3), strides)}, tmp_path / "forged.pt")
    with pytest.raises(FormatError, match=rf"forged\.pt: the tensor on storage 'data/0' has shape \[2, 3\] and "
                                          rf"strides \[{', '.join(map(str, strides))}\], not one per dimension"):
        convert(tmp_path / "forged.pt", tmp_path / "out", to="sharded")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_dcp_object_with_code(tmp_path):
    # torch's own DCP writer pickles a non-tensor entry into the .distcp file; ckptkit decodes it only
    # through the allow-list, when the target format needs the value.
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "hacked"
    dcp.save({"w": torch.ones(2), "payload": Evil(marker)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"object 'payload': the pickle asks for posix\.system"):
        convert(tmp_path / "dcp", tmp_path / "out.pt", to="full")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


# ------------------------------------------------------------------------------------ lying safetensors


def write_safetensors(path: Path, header: dict, data: bytes, header_len: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


@pytest.mark.parametrize("header, data, header_len, message", [
    # the tensor's bytes would run 16 bytes past the end of the file
    ({"w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, bytes(16), None,
     r"'w' data_offsets \[0, 32\] do not hold float32 \[8\] \(32 bytes\) inside the 16 data bytes"),
    # offsets span 12 bytes for a 16-byte tensor
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, bytes(16), None,
     r"'w' data_offsets \[0, 12\] do not hold float32 \[4\] \(16 bytes\)"),
    # two tensors share bytes 8-15
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24), None,
     r"tensors 'a' and 'b' overlap in the data section"),
    # the header claims more bytes than the file has
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), 10_000,
     r"header length 10000 exceeds the file"),
    # a dtype code safetensors does not define
    ({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16), None,
     r"'w': unsupported safetensors dtype 'F128'"),
    # an entry without data_offsets
    ({"w": {"dtype": "F32", "shape": [1]}}, bytes(4), None, r"entry 'w' needs dtype, shape and data_offsets"),
])
def test_convert_safetensors_header_that_lies(tmp_path, header, data, header_len, message):
    src = write_safetensors(tmp_path / "model.safetensors", header, data, header_len)
    with pytest.raises(FormatError, match=rf"{src}: {message}"):
        convert(src, tmp_path / "out.pt", to="full")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("name, error, message", [
    # path traversal out of the checkpoint directory
    ("../evil.safetensors", FormatError,
     r"weight_map\['w'\] = '\.\./evil\.safetensors' is not a plain '\*\.safetensors' file name"),
    # a file that is not a safetensors shard
    ("weights.bin", FormatError, r"is not a plain '\*\.safetensors' file name"),
    # a shard that does not exist
    ("model-00002-of-00002.safetensors", IncompleteCheckpointError,
     r"shard model-00002-of-00002\.safetensors \(holding 'w'\) does not exist"),
])
def test_convert_hf_index_checked_as_untrusted(tmp_path, name, error, message):
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"v": torch.ones(1)}, tmp_path / "hf" / "model-00001-of-00002.safetensors")
    (tmp_path / "evil.safetensors").write_bytes(b"")
    index = {"weight_map": {"v": "model-00001-of-00002.safetensors", "w": name}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(error, match=message):
        convert(tmp_path / "hf", tmp_path / "out.pt", to="full")


# ------------------------------------------------------------------------------------ unknown input


@pytest.mark.parametrize("make, message", [
    # a directory of other files: they are listed
    (lambda p: [p.mkdir(), (p / "notes.txt").write_text("x"), (p / "w.npy").write_bytes(b"x")],
     r"not a checkpoint ckptkit knows \(found: notes\.txt, w\.npy\); expected a DCP directory with \.metadata"),
    # an empty directory
    (lambda p: p.mkdir(), r"not a checkpoint ckptkit knows \(found: an empty directory\)"),
    # a file that is neither a zip archive nor safetensors
    (lambda p: p.write_text("hello"), r"not a checkpoint ckptkit knows \(found: a file of unknown type\)"),
    # nothing there
    (lambda p: None, r"no such file or directory"),
])
def test_inspect_unknown_input_says_what_it_found(tmp_path, make, message):
    path = tmp_path / "thing"
    make(path)
    with pytest.raises(FormatError, match=rf"^{path}: {message}"):
        inspect(path)


# ------------------------------------------------------------------------------------ destinations


@pytest.mark.parametrize("target, dst_name", [
    ("full", "out.pt"),    # a file
    ("sharded", "out"),    # a directory
])
def test_convert_existing_destination_needs_overwrite(tmp_path, flat_full_ckpt, hf_ckpt, zoo, target, dst_name):
    dst = tmp_path / dst_name
    convert(hf_ckpt, dst, to=target, world_size=2 if target == "sharded" else None)
    before = hash_tree(dst)
    with pytest.raises(UsageError, match=rf"{dst} already exists; pass --overwrite \(overwrite=True\) to replace it"):
        convert(flat_full_ckpt, dst, to=target)
    assert hash_tree(dst) == before

    torch.save({"other": torch.ones(1)}, tmp_path / "other.pt")
    convert(tmp_path / "other.pt", dst, to=target, overwrite=True)
    assert hash_tree(dst) != before
    assert verify(tmp_path / "other.pt", dst).ok
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("where", [
    "inside",   # DST inside the SRC directory
    "parent",   # DST is the directory that holds SRC
    "same",     # DST is SRC
])
def test_convert_refuses_destination_overlapping_source(tmp_path, dcp_ckpt, where):
    dst = {"inside": dcp_ckpt / "out", "parent": tmp_path, "same": dcp_ckpt}[where]
    before = hash_tree(dcp_ckpt)
    with pytest.raises(UsageError, match=r"overlaps the input .*dcp2; ckptkit never writes into its input"):
        convert(dcp_ckpt, dst, to="sharded", world_size=3, overwrite=True)
    assert hash_tree(dcp_ckpt) == before
    assert not (dcp_ckpt / "out").exists()


def _truncate_source_midway(monkeypatch, victim: Path):
    """The source file shrinks after ckptkit read its manifest and before the bytes move."""
    original = executor._Writer._copy

    def copy(self, *args):
        victim.write_bytes(b"")
        return original(self, *args)

    monkeypatch.setattr(executor._Writer, "_copy", copy)


def _disk_full_on_second_file(monkeypatch, victim: Path):
    original, calls = executor._Writer.write_file, []

    def write_file(self, out, parts, *at):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, out, parts, *at)

    monkeypatch.setattr(executor._Writer, "write_file", write_file)


@pytest.mark.parametrize("fault, error, message", [
    (_truncate_source_midway, FormatError, r"needs bytes up to offset \d+ but the file has 0 \(truncated\?\)"),
    (_disk_full_on_second_file, OSError, r"No space left on device"),
])
@pytest.mark.parametrize("existing", [False, True])  # a previous DST to be replaced survives the failure
def test_convert_failure_leaves_no_partial_output(tmp_path, monkeypatch, zoo, fault, error, message, existing):
    src = tmp_path / "src.pt"
    torch.save(zoo, src)
    dst = tmp_path / "dcp"
    if existing:
        convert(src, dst, to="sharded", world_size=1)
    before = hash_tree(dst) if existing else None
    fault(monkeypatch, src)
    with pytest.raises(error, match=message):
        convert(src, dst, to="sharded", world_size=3, overwrite=True)
    assert (hash_tree(dst) if dst.exists() else None) == before
    assert not leftovers(tmp_path), leftovers(tmp_path)


def test_every_operation_leaves_inputs_unchanged(tmp_path, full_ckpt, dcp_ckpt, hf_ckpt):
    inputs = (full_ckpt, dcp_ckpt, hf_ckpt)
    before = [hash_tree(p) for p in inputs]
    out = tmp_path / "outputs"
    for i, src in enumerate(inputs):
        convert(src, out / f"{i}.pt", to="full")
        convert(src, out / f"{i}-dcp", to="sharded", world_size=3)
        convert(src, out / f"{i}-hf", to="hf", max_shard_size=300)
        export_hf(src, out / f"{i}-export", dtype="bf16", max_memory=16)
        inspect(src)
        verify(src, out / f"{i}.pt")
    reshard(dcp_ckpt, out / "resharded", world_size=1)
    assert [hash_tree(p) for p in inputs] == before


# ------------------------------------------------------------------------------------ bad requests


def test_convert_bad_shard_size(tmp_path, flat_full_ckpt):
    with pytest.raises(UsageError, match=r"--max-shard-size: expected a size like 5GB, 512MiB or 1000000, got 'lots'"):
        convert(flat_full_ckpt, tmp_path / "hf", to="hf", max_shard_size="lots")


@pytest.mark.parametrize("kwargs, message", [
    # not a format
    ({"to": "parquet"}, r"unknown format 'parquet'; expected one of full, sharded, local, hf, deepspeed-universal"),
    ({"to": "sharded", "world_size": 0}, r"world_size must be >= 1, got 0"),  # no ranks
])
def test_convert_bad_request_is_a_usage_error(tmp_path, flat_full_ckpt, kwargs, message):
    with pytest.raises(UsageError, match=rf"^{message}$"):
        convert(flat_full_ckpt, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_inspect_refuses_getattr_beyond_dcp_enum_members(tmp_path, dcp_ckpt):
    # torch may pickle DCP's memory-format enum as getattr(enum, "TORCH_CONTIGUOUS_FORMAT"); getattr on
    # anything else, even an allowed global such as torch.Size, must stay refused.
    import shutil

    class Evil:
        def __reduce__(self):
            return (getattr, (torch.Size, "__new__"))

    bad = tmp_path / "bad"
    shutil.copytree(dcp_ckpt, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(Evil(), protocol=4))
    with pytest.raises(UnsafeCheckpointError, match=rf"^{bad / '.metadata'}: the pickle asks for getattr\(.*, "
                                                    r"'__new__'\), which is not allowed$"):
        inspect(bad)

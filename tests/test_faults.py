"""Faults, each its own test: kills at any point of a conversion and of
``ckptkit.save``, Ctrl-C and SIGTERM, a full disk, a read-only output, a concurrent destination, outputs that
would land in their input, and checkpoints whose bytes no longer match the checksums saved with them."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, hash_tree, leftovers, load_full
from ckptkit.errors import ChecksumError, FormatError, IncompleteCheckpointError, UsageError
from ckptkit.formats import run_directory
from ckptkit.harness.model import TinyConfig, TinyTransformer
from ckptkit.io.storage.local import staging
from ckptkit.ops.convert import convert

CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "ckptkit")
TESTS = os.path.dirname(__file__)
SKIP_NO_RENAMEAT2 = pytest.mark.skipif(staging._renameat2 is None, reason="this system has no renameat2")


def script(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([CONSOLE_SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, **kw)


def python(code: str, *, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the tests on its path (and ckptkit's console entry as ``main``)."""
    code = f"import sys; sys.path.insert(0, {TESTS!r})\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def assert_one_line_error(proc: subprocess.CompletedProcess, *messages: str, code: int = 2) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("ckptkit: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for m in messages:
        assert m in proc.stderr, proc.stderr


def plain_model(fill: float | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(layers=1))
    if fill is not None:
        with torch.no_grad():
            model.model.norm.weight.fill_(fill)
    return model


def norm_of(model: torch.nn.Module) -> float:
    return float(model.model.norm.weight[0])


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x55]))


# ------------------------------------------------------------------------------------ 1, 2: rotation, re-saves


def test_save_rotation_keeps_the_save_just_made_when_resuming_from_an_earlier_step(tmp_path):
    # keep_last keeps the most recent saves by save number, not the highest steps: a save at step 100 after
    # one at step 300 stays, and latest names a directory that exists.
    ckptkit.save(tmp_path, plain_model(3.0), form="full", step=300)
    ckptkit.save(tmp_path, plain_model(1.0), form="full", step=100, keep_last=1)
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [100]
    assert (tmp_path / "latest").read_text().strip() == "step-00000100"
    fresh = plain_model()
    assert ckptkit.load(tmp_path, fresh).step == 100 and norm_of(fresh) == 1.0
    info = json.loads((tmp_path / "step-00000100" / "ckptkit.json").read_text())
    assert info["save"] == 2


_RESAVE_KILLED = """
import os, signal, sys, torch
import ckptkit
from ckptkit.io.storage.local import staging as publish
from test_faults import plain_model
mode = {mode!r}
if mode == "fallback":
    publish._renameat2 = None
    real_rename = os.rename
    def rename(src, dst, *a, **k):
        real_rename(src, dst, *a, **k)
        if ".ckptkit-old-" in str(dst):
            os.kill(os.getpid(), signal.SIGKILL)  # DST is now missing; its old copy is under a hidden name
    os.rename = rename
else:
    real_swap = publish._swap_in
    def swap(src, dst):
        real_swap(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)  # new copy in place, old copy still under the staging name
    publish._swap_in = swap
ckptkit.save({root!r}, plain_model(2.0), form="full", step=5)
"""


@pytest.mark.parametrize("mode", [pytest.param("renameat2", marks=SKIP_NO_RENAMEAT2), "fallback"])
def test_resaving_the_latest_step_killed_midway_keeps_a_loadable_checkpoint(tmp_path, capfd, mode):
    # Re-saving the step latest names swaps the new directory in before the old one is removed.
    ckptkit.save(tmp_path, plain_model(1.0), form="full", step=5)
    proc = python(_RESAVE_KILLED.format(mode=mode, root=str(tmp_path)))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    fresh = plain_model()
    assert ckptkit.load(tmp_path, fresh).step == 5
    # renameat2 swapped the new copy in, in one step; the fallback's first rename was undone.
    assert norm_of(fresh) == (2.0 if mode == "renameat2" else 1.0)
    assert "cleaned up after runs that are gone" in capfd.readouterr().err
    assert leftovers(tmp_path) == [] and [s.step for s in run_directory.complete_steps(tmp_path)] == [5]


# ------------------------------------------------------------------------------------ 3: checksums


def _tensor_span(ckpt: Path, key: str):
    ckpt = run_directory.resolve(ckpt)
    entry = ckptkit.inspect(ckpt)[key]
    return entry.chunks[0].span


@pytest.mark.parametrize("form", ["full", "sharded", "hf"])
def test_load_checks_checksums_and_names_the_file_and_key(tmp_path, form):
    # One flipped data byte makes ckptkit.load raise rather than load a wrong weight without a word.
    model = plain_model(1.5)
    ckptkit.save(tmp_path / "run", model, form=form, step=1)
    key = "model.model.norm.weight" if form != "hf" else "model.norm.weight"
    span = _tensor_span(tmp_path / "run", key)
    flip(Path(span.file), span.offset + 1)
    with pytest.raises(ChecksumError, match=rf"{key}: the tensor in {span.file} fails its CRC-32 check"):
        ckptkit.load(tmp_path / "run", plain_model())
    fresh = plain_model()
    ckptkit.load(tmp_path / "run", fresh, verify_checksums=False)  # the opt-out loads what is there
    assert norm_of(fresh) != 1.5
    proc = script("verify", tmp_path / "run")
    assert proc.returncode == 1, proc.stderr
    assert f"  {key}: the tensor in {span.file} fails its CRC-32 check" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("edit, code, message", [
    # not JSON at all
    (lambda d: "garbage{", 2, "not a valid ckptkit.json"),
    # a CRC that is not 8 hex digits
    (lambda d: {**d, "tensors": {**d["tensors"], "model.model.norm.weight": {
        **d["tensors"]["model.model.norm.weight"], "chunks": [{"offsets": [0], "sizes": [16], "crc32": 7}]}}},
     2, "crc32 should be 8 lowercase hex digits"),
    # a tensor's checksum removed
    (lambda d: {**d, "tensors": {k: v for k, v in d["tensors"].items() if k != "model.model.norm.weight"}},
     1, "model.model.norm.weight: has no checksum in ckptkit.json"),
    # a key the checkpoint does not hold
    (lambda d: {**d, "tensors": {**d["tensors"], "model.ghost": d["tensors"]["model.model.norm.weight"]}},
     1, "model.ghost: is in ckptkit.json but not in the checkpoint"),
    # the step changed
    (lambda d: {**d, "step": 9}, 1, "step: is 1 in the checkpoint, 9 in ckptkit.json"),
    # the format changed
    (lambda d: {**d, "format": "hf"}, 1, "says format hf, the checkpoint is full"),
    # a CRC changed
    (lambda d: {**d, "tensors": {**d["tensors"], "model.model.norm.weight": {
        **d["tensors"]["model.model.norm.weight"],
        "chunks": [{**d["tensors"]["model.model.norm.weight"]["chunks"][0], "crc32": "00000000"}]}}},
     1, "fails its CRC-32 check (ckptkit.json says 00000000"),
])
def test_verify_one_checkpoint_against_a_tampered_ckptkit_json(tmp_path, edit, code, message):
    ckptkit.save(tmp_path, plain_model(), form="full", step=1)
    record = tmp_path / "step-00000001" / "ckptkit.json"
    doc = edit(json.loads(record.read_text()))
    record.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    proc = script("verify", tmp_path, "-q")
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert message in (proc.stdout if code == 1 else proc.stderr)
    with pytest.raises(FormatError, match=r"ckptkit\.json|CRC-32|checks against"):
        ckptkit.load(tmp_path, plain_model())


def test_verify_one_checkpoint_without_ckptkit_json_reads_every_chunk(tmp_path, dcp_ckpt):
    proc = script("verify", dcp_ckpt)
    assert proc.returncode == 0 and "read through (no ckptkit.json)" in proc.stdout, proc.stderr
    rank1 = dcp_ckpt / "__1_0.distcp"
    rank1.write_bytes(rank1.read_bytes()[:-40])
    assert_one_line_error(script("verify", dcp_ckpt), f"{rank1}")


def _save_local(rank: int, world: int, root: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(plain_model(1.5), device_id=torch.device("cpu"), use_orig_params=True)
    ckptkit.save(root, model, form="local", step=1)


def test_local_checkpoint_checksums_catch_a_flipped_byte(tmp_path):
    from ckptkit.harness.launch import run_ranks

    run_ranks(_save_local, 2, str(tmp_path))
    assert script("verify", tmp_path, "-q").returncode == 0
    span = _tensor_span(tmp_path, "model.model.norm.weight")
    flip(Path(span.file), span.offset)
    proc = script("verify", tmp_path)
    assert proc.returncode == 1 and f"in {span.file} fails its CRC-32 check" in proc.stdout, proc.stdout
    # export-hf and reshard check what they read against the same checksums: one line, exit 2, no output
    out = tmp_path.with_name(f"{tmp_path.name}-out")  # beside the run directory, not in it
    for args in (("export-hf",), ("reshard", "--world-size", "3")):
        assert_one_line_error(script(args[0], tmp_path, out, *args[1:]), str(span.file),
                              "'model.model.norm.weight', bytes ", "fails its CRC-32 check")
        assert not out.exists()


# ------------------------------------------------------------------------------------ 4-7: readers


def _central_directory_entry(data: bytes, name: bytes) -> int:
    pos = 0
    while (pos := data.find(b"PK\x01\x02", pos)) >= 0:
        (n,) = struct.unpack_from("<H", data, pos + 28)
        if data[pos + 46:pos + 46 + n] == name:
            return pos
        pos += 4
    raise AssertionError(name)


def test_storage_record_longer_than_its_storage_is_refused_as_torch_does(tmp_path):
    # A record longer than its tensor's storage is refused, as torch refuses it, never read shifted.
    torch.save({"w": torch.arange(4.0), "x": torch.ones(3)}, tmp_path / "a.pt")
    data = bytearray((tmp_path / "a.pt").read_bytes())
    entry = _central_directory_entry(bytes(data), b"a/data/0")
    struct.pack_into("<II", data, entry + 20, 20, 20)  # 16 bytes of storage, the directory now says 20
    (tmp_path / "a.pt").write_bytes(data)
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(tmp_path / "a.pt", weights_only=True)
    with pytest.raises(FormatError, match=r"a\.pt: record data/0 holds 20 bytes, but data\.pkl says its storage "
                                          r"has 4 elements of 4 bytes"):
        convert(tmp_path / "a.pt", tmp_path / "out", to="hf")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_dcp_to_dcp_refuses_a_damaged_serialized_entry(tmp_path, dcp_ckpt, command):
    # DCP -> DCP decodes each non-tensor blob before copying it: a corrupt one is refused, not copied verbatim.
    blob = next(o.blob for o in ckptkit.inspect(dcp_ckpt).objects if o.key == "name")
    with open(blob.file, "r+b") as f:
        f.seek(blob.offset)
        archive = bytearray(f.read(blob.length))
        pkl = archive.index(b"\x80\x02")  # data.pkl's first bytes
        archive[pkl + 2:pkl + 6] = b"\xff\xff\xff\xff"
        f.seek(blob.offset)
        f.write(archive)
    with pytest.raises(Exception):  # noqa: B017  (whatever torch says: it cannot read the blob)
        import io
        torch.load(io.BytesIO(bytes(archive)), weights_only=True)
    args = ["--to", "sharded"] if command == "convert" else []
    proc = script(command, dcp_ckpt, tmp_path / "out", *args, "--world-size", "3")
    assert_one_line_error(proc, "object 'name': cannot read pickle")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# Runs a command under an address-space limit and prints its exit code, peak RSS (KiB) and stderr. A process
# starts with the RSS high-water mark of whoever exec'd it, so this bare interpreter, not pytest, spawns it.
MEASURED = """
import os, resource, sys
limit = int(sys.argv[1])
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def measured(*cmd, limit: int = 1 << 30, timeout: float = 60) -> tuple[int, int, str]:
    """Exit code, peak RSS in KiB and stderr of ``cmd`` run with at most ``limit`` bytes of address space."""
    proc = subprocess.run([sys.executable, "-S", "-c", MEASURED, str(limit), *map(str, cmd)], capture_output=True,
                          text=True, timeout=timeout)
    code, rss = proc.stdout.split()
    return int(code), int(rss), proc.stderr


def test_ten_byte_metadata_is_refused_at_once_in_little_memory(tmp_path):
    # Unguarded, these ten bytes make the C unpickler's memo allocate about 4 GiB for 15-20 s.
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x02Nr\x00\x00\x00\x10.")
    code, rss, err = measured(CONSOLE_SCRIPT, "inspect", tmp_path / "dcp", timeout=30)
    assert code == 2 and "stores memo entry 268435456 at byte 3, past anything a 9-byte pickle can hold" in err, err
    assert rss < 100_000  # KiB: what ckptkit's start-up takes, and no more


def _forged_offset(t: torch.Tensor, offset: int):
    class Forged:
        def __reduce_ex__(self, protocol):
            return (torch._utils._rebuild_tensor_v2,
                    (t.untyped_storage(), offset, tuple(t.shape), t.stride(), False, {}))
    return Forged()


def _safetensors(path: Path, header: dict | bytes, data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _dcp_edit(dcp: Path, change) -> None:
    import pickle

    md = pickle.loads((dcp / ".metadata").read_bytes())  # written by ckptkit in this test: trusted
    change(md)
    (dcp / ".metadata").write_bytes(pickle.dumps(md, protocol=2))


def _first_tensor(md):
    key = next(k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "TensorStorageMetadata")
    return key, md.state_dict_metadata[key]


@pytest.mark.parametrize("make, message", [
    # a safetensors __metadata__ that is not a str -> str dict
    (lambda d: _safetensors(d / "m.safetensors", {"__metadata__": {"x": [1]},
                                                  "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                            bytes(4)), "m.safetensors: __metadata__ must map strings to strings"),
    # header JSON nested 1,000 deep
    (lambda d: _safetensors(d / "m.safetensors", b'{"__metadata__": ' + b"[" * 1000 + b"]" * 1000 + b"}",
                            b""), "m.safetensors: header is not valid JSON (RecursionError"),
    # a negative shape
    (lambda d: _safetensors(d / "m.safetensors", {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
                            bytes(4)), "m.safetensors: entry 'w' has shape [-1]"),
    # a negative storage offset in a torch.save file
    (lambda d: torch.save({"w": _forged_offset(torch.ones(4), -2)}, d / "m.pt"),
     "m.pt: the tensor on storage 'data/0' has offset -2"),
])
def test_bad_headers_are_one_line_errors_naming_the_file(tmp_path, make, message):
    # Each is one line, never a traceback.
    make(tmp_path)
    src = next(p for p in tmp_path.iterdir())
    assert_one_line_error(script("convert", src, tmp_path / "out", "--to", "sharded"), message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, message", [
    # a negative storage offset
    (lambda md: setattr(next(iter(md.storage_data.values())), "offset", -8), "offset is -8, not a non-negative"),
    # an offset past the end of the file
    (lambda md: setattr(next(iter(md.storage_data.values())), "offset", 10**15), "needs bytes up to offset 1000000"),
    # a negative chunk offset
    (lambda md: setattr(_first_tensor(md)[1].chunks[0], "offsets", (-1, 0)), "chunk offsets is -1"),
    # a record missing an attribute
    (lambda md: delattr(_first_tensor(md)[1], "properties"), "malformed DCP metadata at 'model."),
    # a size that is not a list of sizes
    (lambda md: setattr(_first_tensor(md)[1], "size", "big"), "size is 'big', not a list of sizes"),
])
def test_bad_dcp_metadata_is_a_one_line_error_naming_file_and_key(tmp_path, dcp_ckpt, change, message):
    _dcp_edit(dcp_ckpt, change)
    proc = script("convert", dcp_ckpt, tmp_path / "out.pt", "--to", "full")
    assert_one_line_error(proc, message)
    assert "ckptkit: error: " in proc.stderr and ("'model." in proc.stderr or "distcp" in proc.stderr)


@pytest.mark.parametrize("copy", [0, 1])  # the key as .metadata names its entry, or in its planner path
def test_a_damaged_key_in_a_metadata_ckptkit_wrote_is_refused(tmp_path, copy):
    # ckptkit writes a key once where it repeats (memoized) and its path in full, as torch's pickle has them:
    # a byte damaged in either copy renames one of them, and the reader's check that a key is its path joined
    # refuses the checkpoint rather than exporting a renamed tensor.
    src = tmp_path / "model.pt"
    torch.save({"model.layers.0.mlp.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2)}, src)
    dcp = tmp_path / "dcp"
    convert(src, dcp, to="sharded", world_size=2)
    meta = dcp / ".metadata"
    data = bytearray(meta.read_bytes())
    at = [i for i in range(len(data)) if data.startswith(b"layers.0.mlp", i)][copy]
    data[at + len("layers.0.m")] ^= 0x40  # mlp -> m,p
    meta.write_bytes(data)
    proc = script("export-hf", dcp, tmp_path / "hf")
    assert_one_line_error(proc, "is stored under the path")
    assert not (tmp_path / "hf").exists()


def test_convert_to_hf_refuses_a_damaged_entry_it_leaves_out(tmp_path):
    # An HF output holds the model only, but convert reads (and refuses) everything, as torch's loader would
    # read the whole checkpoint: a damaged non-tensor entry is not waved through because it is not written.
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckptkit.formats.dcp import DcpIO

    src = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.ones(4, 2)}, "name": "run-1"}, src)
    dcp = tmp_path / "dcp"
    convert(src, dcp, to="sharded", world_size=1)
    blob = next(o.blob for o in DcpIO().read(dcp).objects if o.key == "name")
    data = bytearray(Path(blob.file).read_bytes())
    pkl = data.index(b"data.pkl", blob.offset) + len(b"data.pkl")  # the local header's name, then the pickle
    data[pkl + data[pkl:].index(b"\x80\x02") + 1] = 0xFF  # protocol 255
    Path(blob.file).write_bytes(data)
    with pytest.raises(CheckpointException, match="unsupported pickle protocol: 255"):
        dcp_to_torch_save(dcp, tmp_path / "torch.pt")
    proc = script("convert", dcp, tmp_path / "hf", "--to", "hf")
    assert_one_line_error(proc, "object 'name': cannot read pickle")
    assert not (tmp_path / "hf").exists()


def _unhashable_index(md, where: str) -> None:
    """A MetadataIndex whose offset is a list, as a key of ``storage_data`` or of ``planner_data``."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if where == "storage_data":
        index = next(iter(md.storage_data))
    else:  # a dict torch unpickles as it does storage_data, which ckptkit only looks keys up in
        index = MetadataIndex("model.extra", (0,))
        md.planner_data[index] = ("model", "extra")
    object.__setattr__(index, "offset", [0, 0])  # after it went into its dict: the pickle holds it so


@pytest.mark.parametrize("where", ["storage_data", "planner_data"])
def test_dcp_metadata_index_with_an_unhashable_offset_is_refused_as_torch_refuses_it(tmp_path, dcp_ckpt, where):
    # torch hashes each MetadataIndex (a frozen dataclass) by its fqn and offset wherever it is a dict key, as
    # it unpickles; so must ckptkit's stand-ins, whatever dict holds them.
    _dcp_edit(dcp_ckpt, lambda md: _unhashable_index(md, where))
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        torch.load(dcp_ckpt / ".metadata", weights_only=False)
    proc = script("convert", dcp_ckpt, tmp_path / "out.pt", "--to", "full")
    assert_one_line_error(proc, ".metadata: cannot read pickle (TypeError: unhashable type: 'list')")
    assert not (tmp_path / "out.pt").exists()


def test_ctrl_c_while_the_console_script_starts_is_one_line():
    # Ctrl-C during start-up is one line, not a traceback. (The signal arrives while the package imports.)
    proc = python("""
        import os, signal
        sys.argv[0] = "/usr/bin/ckptkit"
        import ckptkit._startup
        os.kill(os.getpid(), signal.SIGINT)
        import ckptkit.cli
        """)
    assert (proc.returncode, proc.stderr) == (130, "ckptkit: interrupted\n")


@pytest.mark.parametrize("module", ["ckptkit", "ckptkit.cli"])
def test_ctrl_c_while_python_m_ckptkit_starts_is_one_line(tmp_path, module):
    # The signal arrives while the command's modules import (click, first imported by ckptkit.cli, after the
    # package's own start-up module has run): sitecustomize sends it from an import hook.
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, signal, sys

        class InterruptOnClick:
            def find_spec(self, name, path=None, target=None):
                if name == "click":
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, InterruptOnClick())
        """))
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert (proc.returncode, proc.stderr) == (130, "ckptkit: interrupted\n")


def test_ctrl_c_while_a_program_imports_ckptkit_is_the_program_s_own():
    proc = python("""
        import os, signal
        import ckptkit._startup
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        """)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("how, line, code", [("SIGINT", "interrupted", 130), ("SIGTERM", "terminated", 143)])
def test_a_signal_that_lands_in_a_callback_still_stops_the_run(how, line, code):
    # A signal's exception raised inside a weakref callback (a thread pool's clean-up runs one) is only printed
    # by Python, traceback and all, and the run went on; the kills at random points met it about once in six.
    proc = python(f"""
        import signal, time, weakref
        from ckptkit import cli

        class Pool:
            pass

        def stopped_here(ref):  # what the signal's handler does, had it run in this callback
            signal.getsignal(signal.{how})(signal.{how}, None)

        pool = Pool()
        watch = weakref.ref(pool, stopped_here)

        def run(*args, **kwargs):
            global pool
            del pool  # the callback runs, and raises
            time.sleep(30)  # the run's next step, where the signal must stop it
            print("not stopped", file=sys.stderr)
            return 0

        cli.cli.main = run
        cli.main(["--version"])
        """)
    assert (proc.returncode, proc.stderr) == (code, f"ckptkit: {line}\n")


# ------------------------------------------------------------------------------------ 8-11: destinations, signals


_KILLED_CONVERSION = """
import os, signal
from ckptkit import cli
from ckptkit.io.storage.local import staging as publish, writer as execute
when, how = {when!r}, {how!r}
if when == "between renames":
    publish._renameat2 = None
    real_rename = os.rename
    def rename(src, dst, *a, **k):
        real_rename(src, dst, *a, **k)
        if ".ckptkit-old-" in str(dst):
            os.kill(os.getpid(), signal.SIGKILL)
    os.rename = rename
elif when == "after the swap":
    real_swap = publish._swap_in
    def swap(src, dst):
        real_swap(src, dst)
        os.kill(os.getpid(), signal.SIGKILL)
    publish._swap_in = swap
else:  # while writing the second file
    real_write, calls = execute._Writer.write_file, []
    def write_file(self, out, parts, *at):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), getattr(signal, how))
        return real_write(self, out, parts, *at)
    execute._Writer.write_file = write_file
cli.main(["convert", {src!r}, {dst!r}, "--to", "sharded", "--world-size", "3", "--overwrite", "-q"])
"""


def _killed_conversion(src: Path, dst: Path, when: str, how: str = "SIGKILL") -> subprocess.CompletedProcess:
    return python(_KILLED_CONVERSION.format(when=when, how=how, src=str(src), dst=str(dst)))


@pytest.mark.parametrize("when", [pytest.param("after the swap", marks=SKIP_NO_RENAMEAT2), "between renames"])
def test_overwrite_killed_midway_never_leaves_dst_missing_after_the_next_run(tmp_path, full_ckpt, zoo, when, capfd):
    # --overwrite killed between its two renames must not leave DST missing, the old output under a hidden name.
    dst = tmp_path / "out"
    torch.save(zoo, tmp_path / "old.pt")
    convert(tmp_path / "old.pt", dst, to="sharded")
    old = hash_tree(dst)
    proc = _killed_conversion(full_ckpt, dst, when)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert leftovers(tmp_path)  # the dead run's staging directory or hidden old copy
    convert(tmp_path / "old.pt", tmp_path / "other", to="hf")  # the next run into the same directory
    assert "cleaned up after runs that are gone" in capfd.readouterr().err
    assert leftovers(tmp_path) == []
    if when == "between renames":
        assert hash_tree(dst) == old  # the swap undone
    else:
        assert_same_tree(ckptkit_full(dst, tmp_path), load_full(full_ckpt))  # the swap finished


def ckptkit_full(path: Path, tmp_path: Path):
    out = tmp_path / f"check-{path.name}.pt"
    convert(path, out, to="full", overwrite=True)
    return load_full(out)


def test_leftovers_of_a_killed_conversion_are_removed_by_the_next_run(tmp_path, full_ckpt, capfd):
    # Leftovers of a kill -9 do not pile up: the next run removes them.
    proc = _killed_conversion(full_ckpt, tmp_path / "out", "while writing")
    assert proc.returncode == -signal.SIGKILL
    (left,) = leftovers(tmp_path)
    assert left.startswith(".out.ckptkit-partial-") and not (tmp_path / "out").exists()
    convert(full_ckpt, tmp_path / "out", to="hf")
    assert f"removed {left}" in capfd.readouterr().err and leftovers(tmp_path) == []


@pytest.mark.parametrize("how, code, line", [("SIGINT", 130, "ckptkit: interrupted\n"),
                                             ("SIGTERM", 143, "ckptkit: terminated\n")])
def test_signals_mid_conversion_clean_up_and_exit_with_one_line(tmp_path, full_ckpt, how, code, line):
    # SIGINT and SIGTERM print one line and leave no staging directory behind.
    proc = _killed_conversion(full_ckpt, tmp_path / "out", "while writing", how)
    assert (proc.returncode, proc.stderr) == (code, line)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_closed_pipe_exits_quietly(tmp_path):
    # `ckptkit verify ... | head` ends quietly, with no BrokenPipeError traceback.
    torch.save({f"t{i}": torch.zeros(1) for i in range(3000)}, tmp_path / "many.pt")
    for args in (["inspect"], ["verify", tmp_path / "many.pt"]):
        proc = subprocess.run(f"{CONSOLE_SCRIPT} {' '.join(map(str, args))} {tmp_path / 'many.pt'} | head -c 10; "
                              "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                              text=True, timeout=120)
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


def test_concurrent_runs_to_one_destination_one_wins(tmp_path, full_ckpt, hf_ckpt):
    # One run wins; the other exits 2 rather than silently replacing the winner's output.
    dst = tmp_path / "out"
    runs = [subprocess.Popen([CONSOLE_SCRIPT, "convert", str(src), str(dst), "--to", "sharded", "-q"],
                             stderr=subprocess.PIPE, text=True) for src in (full_ckpt, hf_ckpt)]
    results = [(r.wait(timeout=120), r.stderr.read()) for r in runs]
    assert sorted(code for code, _ in results) == [0, 2], results
    assert "already exists" in next(err for code, err in results if code == 2)
    winner = (full_ckpt, hf_ckpt)[[code for code, _ in results].index(0)]
    assert ckptkit.verify(winner, dst).ok and leftovers(tmp_path) == []


@pytest.mark.parametrize("dst, to", [
    ("pytorch_model.bin", "full"),   # would become what SRC means (it is read before model.pt)
    ("out", "hf"),                   # a directory inside SRC
    ("model.pt", "full"),            # the very file SRC is read from
])
def test_destination_inside_or_changing_the_source_is_refused(tmp_path, training_state, dst, to):
    # Each would change what `fulldir` means (inspect would then read the new file instead of the old).
    fulldir = tmp_path / "fulldir"
    fulldir.mkdir()
    torch.save(training_state, fulldir / "model.pt")
    before = hash_tree(fulldir)
    proc = script("convert", fulldir, fulldir / dst, "--to", to, "--overwrite")
    assert_one_line_error(proc, "overlaps the input", "ckptkit never writes into its input")
    assert hash_tree(fulldir) == before and leftovers(fulldir) == []


def test_load_refuses_latest_naming_another_run(tmp_path):
    # latest naming ../other-run/step-5 is refused, never followed.
    ckptkit.save(tmp_path / "other-run", plain_model(), form="full", step=5)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("../other-run/step-00000005\n")
    with pytest.raises(FormatError, match=r"latest: names '\.\./other-run/step-00000005'; expected a step"):
        ckptkit.load(tmp_path / "run", plain_model())


@pytest.mark.parametrize("command", [["inspect"], ["convert", "{tmp}/out", "--to", "hf"], ["verify"],
                                     ["reshard", "{tmp}/out", "--world-size", "2"], ["export-hf", "{tmp}/out"]])
def test_missing_source_is_one_line(tmp_path, command):
    # A missing SRC is one line, not click's four-line usage error.
    args = [command[0], tmp_path / "nothing", *(a.format(tmp=tmp_path) for a in command[1:])]
    assert_one_line_error(script(*args), f"ckptkit: error: {tmp_path / 'nothing'}: no such file or directory")


# ------------------------------------------------------------------------------------ disks


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str, *options: str):
    where.mkdir()
    opts = ",".join((f"size={size}", *options))
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); these checks need root "
                    "and a container that allows mounts")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_names_the_file_and_leaves_nothing(tmp_path):
    src = tmp_path / "big.pt"
    torch.save({"a": torch.zeros(300_000), "b": torch.zeros(300_000)}, src)  # 2.4 MB of tensors
    with mounted_tmpfs(tmp_path / "small", "1m") as small:
        proc = script("convert", src, small / "out", "--to", "sharded", "--world-size", "2")
        assert_one_line_error(proc, "No space left on device (writing ", f"{small / 'out'}/__")
        assert list(small.iterdir()) == []


@pytest.mark.parametrize("dst_name", ["out", "new/out.pt"])  # DST itself, or in a directory made for it
def test_read_only_output_is_one_line_naming_dst_and_leaves_nothing(tmp_path, full_ckpt, dst_name):
    with mounted_tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        dst = ro / dst_name
        proc = script("convert", full_ckpt, dst, "--to", "full" if dst_name.endswith(".pt") else "hf")
        assert_one_line_error(proc, f"ckptkit: error: {dst}: cannot write there: {ro} is on a read-only filesystem; "
                                    "name a DST on a filesystem you can write to")
        assert "ckptkit-partial" not in proc.stderr and "Errno" not in proc.stderr  # no staging name, no errno
        assert list(ro.iterdir()) == []


# ------------------------------------------------------------------------------------ kills at random points


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT", "SIGTERM"])
def test_conversion_killed_at_random_points(tmp_path, how):
    rng = random.Random(f"conversion-{how}")
    src = tmp_path / "src.pt"
    torch.save({f"t{i}": torch.full((200_000,), float(i)) for i in range(40)}, src)  # 32 MB in 40 tensors
    expected = load_full(src)
    dst = tmp_path / "out"
    for attempt in range(4):
        if attempt % 2:  # half the time there is an older output to replace
            convert(src, dst, to="sharded", world_size=2, overwrite=True)
        before = hash_tree(dst) if dst.exists() else None
        proc = subprocess.Popen([CONSOLE_SCRIPT, "convert", str(src), str(dst), "--to", "sharded", "--world-size", "3",
                                 "--overwrite", "-q"], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60  # the run is past start-up once its staging directory is there
        while not leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.08))
        proc.send_signal(getattr(signal, how))
        code, err = proc.wait(timeout=120), proc.stderr.read()
        assert "Traceback" not in err, err
        assert code in (0, {"SIGKILL": -9, "SIGINT": 130, "SIGTERM": 143}[how]), (code, err)
        staging.recover(tmp_path)  # what the next run into this directory does first
        assert leftovers(tmp_path) == []
        if dst.exists() and hash_tree(dst) != before:  # complete, never half-written
            assert_same_tree(ckptkit_full(dst, tmp_path), expected)
        else:
            assert (hash_tree(dst) if dst.exists() else None) == before


_SAVING_LOOP = """
import ckptkit
from test_faults import plain_model
for step in range(1, 1000):
    ckptkit.save({root!r}, plain_model(float(step)), form={form!r}, step=step, keep_last=2)
    print(step, flush=True)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT", "SIGTERM"])
def test_save_killed_at_random_points_keeps_the_newest_complete_save_loadable(tmp_path, how):
    rng = random.Random(f"save-{how}")
    code = f"import sys; sys.path.insert(0, {TESTS!r})\n" + _SAVING_LOOP.format(root=str(tmp_path), form="sharded")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "1"
    time.sleep(rng.uniform(0.0, 1.5))
    proc.send_signal(getattr(signal, how))
    out, _ = proc.communicate(timeout=120)
    last = int(([line for line in ["1", *out.split()] if line.strip()])[-1])
    fresh = plain_model()
    result = ckptkit.load(tmp_path, fresh)
    assert result.step in (last, last + 1) and norm_of(fresh) == float(result.step)
    assert leftovers(tmp_path) == [] and len(run_directory.complete_steps(tmp_path)) <= 3


def test_load_of_a_run_without_complete_steps_says_so(tmp_path):
    (tmp_path / "latest").write_text("step-00000001\n")
    with pytest.raises(IncompleteCheckpointError, match="which does not exist"):
        ckptkit.load(tmp_path, plain_model())


def test_save_without_step_refuses_to_replace_a_directory_it_did_not_save(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="holds notes.txt, not a checkpoint ckptkit reads"):
        ckptkit.save(tmp_path, plain_model(), form="full")
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    ckptkit.save(tmp_path / "ck", plain_model(1.0), form="full")
    ckptkit.save(tmp_path / "ck", plain_model(2.0), form="full")  # its own checkpoint: replaced in one step
    fresh = plain_model()
    ckptkit.load(tmp_path / "ck", fresh)
    assert norm_of(fresh) == 2.0 and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------ destinations it cannot write


@pytest.mark.parametrize("below", ["out", "sub/out.pt"])
def test_a_destination_inside_a_file_is_one_line_naming_dst(tmp_path, full_ckpt, below):
    (tmp_path / "notes.txt").write_text("a file, not a directory\n")
    dst = tmp_path / "notes.txt" / below
    proc = script("convert", full_ckpt, dst, "--to", "full" if below.endswith(".pt") else "sharded")
    assert_one_line_error(proc, f"ckptkit: error: {dst}: {tmp_path / 'notes.txt'} is a file, not a directory; "
                                "name a DST outside it")
    assert "Errno" not in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "a file, not a directory\n"

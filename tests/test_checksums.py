"""Checksums (``ops/checksums.py``, ``ops/_read_checks.py``, ``io/checks.py``): ``ckptkit.save`` records each
chunk's CRC-32 while torch writes the chunk, and every command that reads a ``ckptkit.save`` checkpoint
(``export-hf``, ``reshard``, ``convert``) checks the ranges it reads against them as it streams.

The oracles are the exit code, the file system (no output, no leftovers) and torch's and safetensors' own
loaders; where to flip a byte is found by ``ckptkit.inspect``, which is no oracle here."""

from __future__ import annotations

import filecmp
import shutil
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from _checks import leftovers
from ckptkit.cli import cli
from ckptkit.formats import run_directory
from ckptkit.harness.model import TinyConfig, TinyTransformer

WEIGHT = "model.model.layers.0.mlp.up_proj.weight"
"""A weight of :func:`_model` (``model.`` is ckptkit.save's prefix for the model's state)."""


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(layers=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 128, (2, 8))).float().sum().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """The model and its AdamW state as ``ckptkit.save`` writes them, in the sharded (DCP), hf and full forms."""
    root = tmp_path_factory.mktemp("saved")
    model, opt = _model()
    for form in ("sharded", "hf", "full"):
        ckptkit.save(root / form, model, optimizer=opt, form=form)
    return {form: root / form for form in ("sharded", "hf", "full")}


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _flip_bit(ckpt: Path, key: str) -> tuple[Path, int]:
    """Flip one bit of ``key``'s bytes; the file and the offset of the byte flipped."""
    span = ckptkit.inspect(ckpt)[key].chunks[0].span
    with open(span.file, "r+b") as f:
        f.seek(span.offset + 6)
        byte = f.read(1)[0]
        f.seek(span.offset + 6)
        f.write(bytes([byte ^ 0x04]))
    return Path(span.file), span.offset


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


_COMMANDS = {
    "export-hf": ("export-hf",),
    "reshard": ("reshard", "--world-size", "3"),
    "reshard --workers 2": ("reshard", "--world-size", "3", "--workers", "2"),
    "convert": ("convert", "--to", "full"),
}


@pytest.mark.parametrize("command", list(_COMMANDS))
def test_commands_refuse_a_flipped_weight_bit_naming_file_key_and_offset_and_write_nothing(saved, tmp_path,
                                                                                           command):
    ckpt = _copy(saved["sharded"], tmp_path)
    file, offset = _flip_bit(ckpt, WEIGHT)
    out = tmp_path / "out"
    verb, *rest = _COMMANDS[command]
    code, output = run(verb, ckpt, out, *rest, "-q")
    assert code == 2, output
    line = output.strip()
    assert "\n" not in line and line.startswith("ckptkit: "), output
    assert str(file) in line and repr(WEIGHT) in line and f"bytes {offset}-" in line, line
    assert "fails its CRC-32 check" in line and "--no-verify-checksums" in line, line
    assert not out.exists() and leftovers(tmp_path) == []
    code, output = run(verb, ckpt, out, *rest, "-q", "--no-verify-checksums")  # the opt-out reads it as it is
    assert code == 0 and out.exists(), output


@pytest.mark.parametrize("form, key", [("hf", "model.layers.0.mlp.up_proj.weight"), ("full", WEIGHT)])
def test_export_hf_of_an_hf_or_full_save_refuses_a_flipped_bit(saved, tmp_path, form, key):
    ckpt = _copy(saved[form], tmp_path)
    file, offset = _flip_bit(ckpt, key)
    code, output = run("export-hf", ckpt, tmp_path / "out", "-q")
    assert code == 2 and f"{file}: {key!r}, bytes {offset}-" in output, output
    assert not (tmp_path / "out").exists()


def test_export_hf_of_a_clean_save_is_byte_equal_with_and_without_the_checks(saved, tmp_path):
    from safetensors.torch import load_file

    checked, unchecked = tmp_path / "checked", tmp_path / "unchecked"
    assert run("export-hf", saved["sharded"], checked, "-q")[0] == 0
    assert run("export-hf", saved["sharded"], unchecked, "-q", "--no-verify-checksums")[0] == 0
    names = sorted(p.name for p in checked.iterdir())
    assert names == sorted(p.name for p in unchecked.iterdir())
    assert all(filecmp.cmp(checked / n, unchecked / n, shallow=False) for n in names)
    weights = load_file(checked / "model.safetensors")
    model, _ = _model()
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)


def test_export_hf_notes_a_truncated_optimizer_shard_it_does_not_read(saved, tmp_path):
    ckpt = _copy(saved["sharded"], tmp_path)
    shard = ckpt / "__0_0.distcp"  # the optimizer's moments come after the model's weights
    shard.write_bytes(shard.read_bytes()[:-100])
    report = ckptkit.export_hf(ckpt, tmp_path / "out")
    notes = [n for n in report.notes if "__0_0.distcp ends at byte" in n]
    assert len(notes) == 1 and "'optim.state." in notes[0] and "truncated" in notes[0], report.notes
    assert run("reshard", ckpt, tmp_path / "resharded", "--world-size", "2", "-q")[0] == 2  # a full read refuses it


def test_save_computes_each_checksum_while_torch_writes_the_items(tmp_path, monkeypatch):
    # The save's checksums are computed beside torch's writes, item by item, not in a pass over every byte first.
    import torch.distributed.checkpoint.filesystem as dcp_files

    from ckptkit.ops import checksums

    events: list[str] = []
    lock = threading.Lock()
    write_item, tensor_crc = dcp_files._write_item, checksums.tensor_crc

    def logged_write(*args, **kwargs):
        with lock:
            events.append("write")
        return write_item(*args, **kwargs)

    def logged_crc(t, crc=0):
        with lock:
            events.append("crc")
        return tensor_crc(t, crc)

    monkeypatch.setattr(dcp_files, "_write_item", logged_write)
    monkeypatch.setattr(checksums, "tensor_crc", logged_crc)
    model, opt = _model()
    ckptkit.save(tmp_path / "ckpt", model, optimizer=opt)
    assert events.index("write") < len(events) - 1 - events[::-1].index("crc"), events
    assert ckptkit.verify(tmp_path / "ckpt").ok


def test_save_rotation_deletes_old_steps_after_returning_and_before_the_next_save(tmp_path, monkeypatch):
    # Deleting an old step is not on the save's critical path: the save returns with the step out of sight,
    # the deletion finishes in the background, and the next save waits for it before writing.
    from ckptkit.io.storage.local import staging

    release, started = threading.Event(), threading.Event()
    remove_path = staging.remove_path

    def slow_remove(path: Path) -> None:
        started.set()
        release.wait(60)
        remove_path(path)

    monkeypatch.setattr(staging, "remove_path", slow_remove)
    model, _ = _model()
    ckptkit.save(tmp_path, model, form="full", step=1, keep_last=1)
    done = threading.Event()
    threading.Thread(target=lambda: (ckptkit.save(tmp_path, model, form="full", step=2, keep_last=1),
                                     done.set())).start()
    assert done.wait(30) and started.wait(30)  # returned while the old step's deletion still waits
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [2]
    release.set()
    ckptkit.save(tmp_path, model, form="full", step=3, keep_last=3)  # waits for the deletion first
    assert leftovers(tmp_path) == [], leftovers(tmp_path)

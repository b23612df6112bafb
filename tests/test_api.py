"""The package's public surface: ``import ckptkit`` and call what ``__all__`` lists, as the README does."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptkit


def test_ckptkit_all_names_resolve():
    for name in ckptkit.__all__:
        assert getattr(ckptkit, name) is not None, name
    assert issubclass(ckptkit.UsageError, ckptkit.CheckpointError)
    assert issubclass(ckptkit.CheckpointError, ValueError)


def test_ckptkit_readme_calls_in_a_fresh_interpreter(tmp_path):
    torch.save({"model": {"w": torch.arange(6.0).reshape(3, 2)}, "step": 1}, tmp_path / "src.pt")
    program = textwrap.dedent(f"""
        import ckptkit
        ckptkit.convert({str(tmp_path / 'src.pt')!r}, {str(tmp_path / 'dcp')!r}, to="sharded", world_size=2)
        m = ckptkit.inspect({str(tmp_path / 'dcp')!r})
        ckptkit.reshard({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'dcp3')!r}, world_size=3)
        ckptkit.convert({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'model.pt')!r}, to="full")
        ckptkit.export_hf({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'hf')!r})
        assert ckptkit.verify({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'dcp3')!r}).ok
        assert ckptkit.verify({str(tmp_path / 'src.pt')!r}, {str(tmp_path / 'model.pt')!r}).ok
        print(m.world_size)
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2"


def test_ckptkit_is_typed_for_type_checkers():
    from importlib.resources import files

    assert files("ckptkit").joinpath("py.typed").is_file()


def test_parse_size_decimal_as_huggingface_hub_binary_and_plain():
    from huggingface_hub.serialization._base import parse_size_to_int  # the oracle for decimal units

    from ckptkit.errors import UsageError
    from ckptkit.ops.convert import parse_size

    for text in ("5GB", "1.5MB", "10KB", "2TB", " 3gb "):
        assert parse_size(text) == parse_size_to_int(text.strip())
    assert (parse_size("1GiB"), parse_size("512MiB"), parse_size("1000000"), parse_size("7B")) == \
        (1 << 30, 512 << 20, 1000000, 7)
    for bad in ("lots", "5 GBs", "", "-1GB"):
        with pytest.raises(UsageError, match=re.escape(f"--max-memory: expected a size like 5GB, 512MiB or 1000000, "
                                                       f"got {bad!r}")):
            parse_size(bad, "--max-memory")


def test_progress_bar_is_tqdm_auto_in_a_notebook(monkeypatch):
    import types

    from ckptkit.io.progress import progress_bar

    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: object()))
    chosen = []
    import tqdm.auto

    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda **kw: chosen.append(kw) or real(**{**kw, "disable": True}))
    with progress_bar(3_000_000, "hf", True) as update:
        update(1_000_000)
    assert chosen and chosen[0]["unit_divisor"] == 1000  # decimal units, as every size ckptkit prints
    with progress_bar(10, "hf", False) as update:           # --quiet: no bar
        update(5)
    assert len(chosen) == 1


def test_write_options_object_and_keywords_write_the_same_bytes(tmp_path):
    # The write tail as one object, or as keywords of the call (which replace the object's fields): one output.
    torch.save({"model": {"w": torch.arange(12.0).reshape(4, 3)}, "step": 1}, tmp_path / "src.pt")
    by_keywords = ckptkit.convert(tmp_path / "src.pt", tmp_path / "a", to="sharded", world_size=2, fsync=True)
    options = ckptkit.WriteOptions(fsync=True, dry_run=True)
    by_object = ckptkit.convert(tmp_path / "src.pt", tmp_path / "b", to="sharded", world_size=2, options=options,
                                dry_run=False)
    assert not by_keywords.dry_run and not by_object.dry_run
    assert by_object.written == by_keywords.written
    for name, _ in by_keywords.written:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    dry = ckptkit.export_hf(tmp_path / "src.pt", tmp_path / "hf", options=options)
    assert dry.dry_run and not (tmp_path / "hf").exists()


def test_write_options_distributed_in_the_object_runs_on_all_ranks(tmp_path):
    # distributed=True given inside WriteOptions reaches the all-ranks guard as the keyword does: without a process
    # group, the call is refused before anything is read or written.
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "src.pt")
    for call in (lambda: ckptkit.reshard(tmp_path / "src.pt", tmp_path / "r", world_size=2,
                                         options=ckptkit.WriteOptions(distributed=True)),
                 lambda: ckptkit.export_hf(tmp_path / "src.pt", tmp_path / "h",
                                           options=ckptkit.WriteOptions(distributed=True))):
        with pytest.raises(ckptkit.UsageError, match="distributed=True writes from every rank"):
            call()
    assert not (tmp_path / "r").exists() and not (tmp_path / "h").exists()


def test_write_keywords_name_every_write_option():
    import dataclasses

    from ckptkit.ops.convert import WriteKeywords

    assert set(WriteKeywords.__annotations__) == {f.name for f in dataclasses.fields(ckptkit.WriteOptions)}

"""ckptkit.io.storage.memory: a backend in one file (``ckmem://``), written and read end to end by the library
calls; safetensors and torch load the bytes it holds, and torch's tensors are the oracle."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

import ckptkit
from _checks import leftovers, load_hf
from ckptkit.errors import UsageError
from ckptkit.formats import read
from ckptkit.formats.hf import HfIO, HfOptions
from ckptkit.io import storage
from ckptkit.io.execute import whole_files
from ckptkit.io.options import WriteOptions
from ckptkit.io.storage import register, storage_at, storage_for
from ckptkit.io.storage.memory import FILES, MemoryStorage

STATE = {"model": {"embed.weight": torch.arange(24.0).reshape(6, 4), "norm.weight": torch.ones(4),
                   "proj.weight": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}}


@pytest.fixture
def files():
    """The memory backend's files, emptied before and after each test."""
    FILES.clear()
    yield FILES
    FILES.clear()


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(STATE, path)
    return path


def test_storage_for_resolves_ckmem_urls_to_the_registered_backend():
    storage, path = storage_at("ckmem://run/model")
    assert isinstance(storage, MemoryStorage) and str(path) == "ckmem://run/model"
    assert storage.shared_writes is False and storage.descriptors is True
    assert storage_for(path) is storage  # the path it gave resolves back to it


def test_register_adds_a_scheme_and_pathlib_mangled_urls_of_it_are_refused(monkeypatch):
    monkeypatch.setattr(storage, "_registry", dict(storage._registry))
    mine = MemoryStorage()
    register("ckmem2", lambda options: mine)
    assert storage_for("ckmem2://x") is mine and storage_for("CKMEM2://x") is mine
    with pytest.raises(UsageError, match=r"^ckmem2:/x: looks like a ckmem2:// URL that lost a slash"):
        storage_for(Path("ckmem2://x"))


def test_export_hf_to_memory_writes_safetensors_bytes_equal_to_the_source(files, src):
    ckptkit.export_hf(src, "ckmem://out/hf")
    names = sorted(k for k in files if k.startswith("out/hf/"))
    assert "out/hf/model.safetensors" in names
    got = load_safetensors(files["out/hf/model.safetensors"])
    assert got.keys() == STATE["model"].keys()
    for key, tensor in STATE["model"].items():
        assert torch.equal(got[key], tensor), key


def test_convert_to_a_memory_file_is_the_torch_save_file_written_locally(files, src, tmp_path):
    ckptkit.convert(src, "ckmem://out/model.pt", to="full")
    ckptkit.convert(src, tmp_path / "local.pt", to="full")
    assert files["out/model.pt"] == (tmp_path / "local.pt").read_bytes()
    got = torch.load(io.BytesIO(files["out/model.pt"]), weights_only=True)
    for key, tensor in STATE["model"].items():
        assert torch.equal(got["model"][key], tensor), key


def test_reshard_from_memory_to_memory_and_back_to_disk_keeps_every_tensor(files, src, tmp_path):
    ckptkit.convert(src, "ckmem://a/dcp", to="sharded", world_size=2)
    ckptkit.reshard("ckmem://a/dcp", "ckmem://b/dcp", world_size=3)
    assert "b/dcp/.metadata" in files and "b/dcp/__2_0.distcp" in files
    ckptkit.export_hf("ckmem://b/dcp", tmp_path / "hf")
    got = load_hf(tmp_path / "hf")
    for key, tensor in STATE["model"].items():
        assert torch.equal(got[key], tensor), key
    assert leftovers(tmp_path) == []


def test_memory_destination_that_exists_is_refused_and_left_as_it_was(files, src):
    files["out/model.pt"] = b"old"
    with pytest.raises(UsageError, match=r"^ckmem://out/model.pt already exists; pass --overwrite"):
        ckptkit.convert(src, "ckmem://out/model.pt", to="full")
    assert files == {"out/model.pt": b"old"}
    ckptkit.convert(src, "ckmem://out/model.pt", to="full", overwrite=True)
    assert torch.equal(torch.load(io.BytesIO(files["out/model.pt"]), weights_only=True)["model"]["norm.weight"],
                       STATE["model"]["norm.weight"])


def test_memory_abort_after_writing_every_file_leaves_nothing(files, src):
    plan = HfIO().plan(read(src), HfOptions())
    storage, dst = storage_at("ckmem://out/hf")
    with pytest.raises(RuntimeError, match="stopped"), storage.stage(dst, plan, overwrite=False) as staged:
        staged.write(whole_files(plan), max_memory=WriteOptions().max_memory)
        raise RuntimeError("stopped")
    assert files == {}


def test_memory_to_several_workers_is_refused_with_one_line(files, src):
    with pytest.raises(UsageError, match="--workers write to a local or shared filesystem"):
        ckptkit.convert(src, "ckmem://out/dcp", to="sharded", world_size=4, workers=2)

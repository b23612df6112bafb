"""megatron-core 0.16.1's ``torch_dist`` checkpoints, written by its own ``dist_checkpointing.save`` from tiny
GPTModels on 2 gloo ranks (``_megatron.py``), read by ckptkit, and loaded back by megatron-core's own
``dist_checkpointing.load``. torch's ``dcp_to_torch_save`` is the oracle for the DCP part."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, leftovers, load_dcp, load_hf
from _megatron import loaded, saved
from ckptkit.cli import cli

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron")


@pytest.fixture(scope="module")
def llama_tp2(tmp) -> Path:
    """Llama-style at TP=2, with Megatron-LM's common state (args, iteration) in common.pt."""
    return saved(tmp, "llama", 2)


@pytest.fixture(scope="module")
def llama_tp1(tmp) -> Path:
    """Llama-style at TP=1, as megatron-core alone saves a model: an empty common.pt."""
    return saved(tmp, "llama", 1, with_args=False)


def _common(ckpt: Path) -> dict:
    # The test's own files: megatron-core pickles an argparse.Namespace and its own enum there.
    return torch.load(ckpt / "common.pt", weights_only=False)


def _run(*args) -> tuple[int, str]:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def test_megatron_inspect_lists_the_dcp_tensors_and_common_state(llama_tp2, tmp_path):
    manifest = ckptkit.inspect(llama_tp2)
    oracle = load_dcp(llama_tp2, tmp_path / "oracle.pt")
    tensors = {t.key: (t.dtype.name, t.shape) for t in manifest.tensors}
    assert tensors == {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape))
                       for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    assert tensors["decoder.layers.self_attention.linear_qkv.weight"] == ("float32", (2, 64, 32))  # (4 + 2·2)·8
    assert {o.key for o in manifest.objects if o.sidecar == "common.pt"} == {"args", "checkpoint_version", "iteration"}
    details = dict(manifest.details)
    assert details["metadata.json"] == "megatron-core torch_dist (version 1)"
    assert details["common.pt"].startswith("megatron-core's common state: 3 entries (args, ")
    code, out = _run("inspect", llama_tp2)
    assert code == 0 and "metadata.json: megatron-core torch_dist" in out and "iteration = 0  (common.pt)" in out


@pytest.mark.parametrize("which", ["llama_tp2", "llama_tp1"])
def test_megatron_convert_full_is_dcp_to_torch_save_plus_common_state_as_megatron_load_merges_it(
        which, request, tmp_path):
    ckpt = request.getfixturevalue(which)
    ckptkit.convert(ckpt, tmp_path / "full.pt", to="full")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    expected = {**load_dcp(ckpt, tmp_path / "oracle.pt"), **_common(ckpt)}
    assert_same_tree(full, expected)
    if which == "llama_tp2":
        assert full["args"].num_query_groups == 2 and full["iteration"] == 0


def test_megatron_export_hf_without_preset_keeps_megatron_names_and_bytes(llama_tp2, tmp_path):
    ckptkit.export_hf(llama_tp2, tmp_path / "hf")
    oracle = load_dcp(llama_tp2, tmp_path / "oracle.pt")
    assert_same_tree(load_hf(tmp_path / "hf"), {k: v for k, v in oracle.items() if isinstance(v, torch.Tensor)})


def test_megatron_reshard_relays_files_and_megatron_loads_the_output(llama_tp2, tmp_path):
    ckptkit.reshard(llama_tp2, tmp_path / "r3", world_size=3)
    assert sorted(p.name for p in (tmp_path / "r3").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "common.pt", "metadata.json"]
    assert (tmp_path / "r3" / "metadata.json").read_bytes() == (llama_tp2 / "metadata.json").read_bytes()
    assert_same_tree(_common(tmp_path / "r3"), _common(llama_tp2))
    oracle = load_dcp(llama_tp2, tmp_path / "oracle.pt")
    result = loaded(tmp_path, "llama", 2, tmp_path / "r3")  # megatron-core's own load, at TP=2
    assert_same_tree(result["params"], {k: oracle[k] for k in result["params"]})
    assert set(result["params"]) == {k for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    assert result["common"]["args"] == _common(llama_tp2)["args"] and result["common"]["iteration"] == 0


def _copy(ckpt: Path, to: Path) -> Path:
    shutil.copytree(ckpt, to)
    return to


def test_megatron_common_pt_with_a_class_off_the_allow_list_exits_2(llama_tp2, tmp_path):
    bad = _copy(llama_tp2, tmp_path / "bad")
    torch.save({"args": datetime.timedelta(days=1)}, bad / "common.pt")
    code, out = _run("export-hf", bad, tmp_path / "out")
    assert code == 2 and out.count("\n") == 1, out
    assert "common.pt: the pickle asks for datetime.timedelta, which is not on ckptkit's allow-list" in out
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_megatron_metadata_json_naming_another_backend_exits_2(llama_tp2, tmp_path):
    bad = _copy(llama_tp2, tmp_path / "bad")
    config = json.loads((bad / "metadata.json").read_text())
    (bad / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    code, out = _run("convert", bad, tmp_path / "out.pt", "--to", "full")
    assert code == 2 and out.count("\n") == 1, out
    assert "metadata.json: megatron-core checkpoint with sharded_backend 'zarr'" in out
    assert not (tmp_path / "out.pt").exists()

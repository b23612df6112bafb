"""accelerate 1.15 ``Accelerator.save_state`` under FSDP1 and FSDP2, SHARDED and FULL_STATE_DICT.

SHARDED writes ``pytorch_model_fsdp_0/`` (DCP of ``{"model": model_sd}``) and ``optimizer_0/`` (DCP of
``{"optimizer": optim_sd}``); FULL writes ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` from rank 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from _checks import assert_same_tree, load_dcp, load_full, load_hf
from _compare import assert_loads_in_transformers, assert_resumes
from _spawn import spawn
from _workers import accelerate_save, tiny_llama
from ckptkit.cli import cli
from ckptkit.errors import UsageError


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def saved(request, tmp_path_factory) -> tuple[Path, dict]:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp(f"accelerate-fsdp{request.param}")
    spawn(accelerate_save, 2, request.param, str(out))
    return out, torch.load(out / "expected.pt", weights_only=True)


def test_accelerate_export_hf_sharded_and_full(saved, tmp_path, llama_assets):
    out, expected = saved
    for src in (out / "sharded" / "pytorch_model_fsdp_0", out / "full" / "pytorch_model_fsdp.bin"):
        report = ckptkit.export_hf(src, tmp_path / src.name, hf_assets=llama_assets)
        assert_same_tree(load_hf(tmp_path / src.name), expected["model"])  # HF names, exact fp32 weights
        assert_loads_in_transformers(tmp_path / src.name, expected["model"])
    assert report.notes[0] == "checkpoint is a flat model state dict"


def test_accelerate_optimizer_only_is_refused_for_export(saved, tmp_path):
    out, _ = saved
    result = CliRunner().invoke(cli, ["export-hf", str(out / "sharded" / "optimizer_0"), str(tmp_path / "hf")])
    assert result.exit_code == 2
    assert result.output.startswith("ckptkit: error: ") and result.output.count("\n") == 1
    assert "holds optimizer state only" in result.output
    assert f"the model is probably in {out / 'sharded' / 'pytorch_model_fsdp_0'}" in result.output
    with pytest.raises(UsageError, match=r"optimizer\.bin: holds optimizer state only"):
        ckptkit.export_hf(out / "full" / "optimizer.bin", tmp_path / "hf")


def test_accelerate_inspect_reshard_and_convert(saved, tmp_path):
    out, expected = saved
    sharded = ckptkit.inspect(out / "sharded" / "pytorch_model_fsdp_0")
    assert (sharded.world_size, len(sharded.tensors)) == (2, 21)
    assert {t.key for t in ckptkit.inspect(out / "full" / "pytorch_model_fsdp.bin").tensors} == set(expected["model"])
    ckptkit.reshard(out / "sharded" / "pytorch_model_fsdp_0", tmp_path / "model3", world_size=3)
    assert_same_tree(load_dcp(tmp_path / "model3", tmp_path / "m.pt"), {"model": expected["model"]})
    ckptkit.reshard(out / "sharded" / "optimizer_0", tmp_path / "optim3", world_size=3)
    assert_same_tree(load_dcp(tmp_path / "optim3", tmp_path / "o.pt")["optimizer"]["state"],
                     expected["optimizer"]["state"])
    ckptkit.convert(out / "sharded" / "pytorch_model_fsdp_0", tmp_path / "model.bin", to="full")
    assert_same_tree(load_full(tmp_path / "model.bin"), {"model": expected["model"]})


def test_accelerate_load_into_a_fresh_model(saved):
    out, expected = saved
    for src in (out / "sharded" / "pytorch_model_fsdp_0", out / "full" / "pytorch_model_fsdp.bin"):
        model = tiny_llama()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert not ckptkit.load(src, model).optimizer_loaded
        assert_same_tree(model.state_dict(), expected["model"])


def test_accelerate_save_state_directory_is_one_checkpoint_with_the_optimizer(saved, tmp_path):
    out, expected = saved
    root = out / "sharded"
    manifest = ckptkit.inspect(root)
    assert (manifest.world_size, len(manifest.tensors)) == (2, 21 + 63)
    assert_resumes(root, expected, step=2)  # accelerate saves no step: the optimizer's
    report = ckptkit.reshard(root, tmp_path / "r3", world_size=3)
    assert sorted(p.name for p in (tmp_path / "r3").iterdir()) == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert any(n.startswith("not read from the source: random_states_0.pkl") for n in report.notes), report.notes
    # torch's own reader of each directory, as accelerate's load_state reads them (dcp.load of each)
    model = load_dcp(tmp_path / "r3" / "pytorch_model_fsdp_0", tmp_path / "m.pt")
    assert_same_tree(model, {"model": expected["model"]})
    optim = load_dcp(tmp_path / "r3" / "optimizer_0", tmp_path / "o.pt")["optimizer"]
    assert_same_tree(optim["state"], expected["optimizer"]["state"])
    assert ckptkit.inspect(tmp_path / "r3").world_size == 3
    assert_resumes(tmp_path / "r3", expected, step=2)
    ckptkit.export_hf(root, tmp_path / "hf")
    assert_same_tree(load_hf(tmp_path / "hf"), expected["model"])
    ckptkit.convert(root, tmp_path / "full.pt", to="full")
    full = load_full(tmp_path / "full.pt")
    assert_same_tree(full["model"], expected["model"])
    assert_same_tree(full["optimizer"]["state"], expected["optimizer"]["state"])
    assert ckptkit.verify(root, tmp_path / "r3").ok

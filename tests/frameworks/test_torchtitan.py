"""torchtitan's checkpoint layout, by its exact save calls (torchtitan itself pulls dependencies that do not
install beside torch 2.13 here; ``_workers.torchtitan_save`` names the version and source file).

The model's keys sit at the top level, beside ``optimizer``, ``lr_scheduler``, ``dataloader`` and
``train_state``: export-hf once wrote the optimizer moments into model.safetensors next to the weights.
The model here is transformers' Llama, so its top-level keys are ``model.*`` and ``lm_head.weight``: dotted
key prefixes, not nested sections.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_dcp, load_hf
from _compare import assert_loads_in_transformers
from _spawn import spawn
from _workers import tiny_llama, torchtitan_save


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("torchtitan")
    spawn(torchtitan_save, 2, str(out))
    return out / "step-2", torch.load(out / "expected.pt", weights_only=True)


def test_torchtitan_export_hf_takes_the_model_and_leaves_training_state_out(saved, tmp_path, llama_assets):
    ckpt, expected = saved
    report = ckptkit.export_hf(ckpt, tmp_path / "hf", hf_assets=llama_assets)
    assert_same_tree(load_hf(tmp_path / "hf"), expected["model"])  # 21 weights, no exp_avg, exp_avg_sq or step
    assert_loads_in_transformers(tmp_path / "hf", expected["model"])
    assert report.notes[0] == "model taken from the top-level tensors beside the training state"
    assert report.notes[1].startswith("left out: dataloader (3 other entries); lr_scheduler (")
    assert "optimizer (63 tensors, " in report.notes[1] and "train_state (2 other entries)" in report.notes[1]
    ckptkit.convert(ckpt, tmp_path / "converted", to="hf")
    assert_same_tree(load_hf(tmp_path / "converted"), expected["model"])
    assert ckptkit.verify(ckpt, tmp_path / "converted", model_only=True).ok


def test_torchtitan_inspect_and_reshard_keep_every_entry(saved, tmp_path):
    ckpt, expected = saved
    manifest = ckptkit.inspect(ckpt)
    assert (manifest.world_size, len(manifest.tensors)) == (2, 21 + 63)
    ckptkit.reshard(ckpt, tmp_path / "step-2", world_size=3)
    resharded = load_dcp(tmp_path / "step-2", tmp_path / "r.pt")
    assert_same_tree(resharded, load_dcp(ckpt, tmp_path / "s.pt"))
    assert_same_tree({k: resharded[k] for k in expected["model"]}, expected["model"])
    assert resharded["train_state"] == {"step": 2, "ntokens_seen": 64}


def test_torchtitan_load_model_and_flattened_optimizer(saved):
    ckpt, expected = saved
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert ckptkit.load(ckpt, model, optimizer=opt).optimizer_loaded
    assert_same_tree(model.state_dict(), expected["model"])
    assert_same_tree({n: opt.state[p] for n, p in model.named_parameters()}, expected["optimizer"]["state"])
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in expected["optimizer"]["param_groups"]]

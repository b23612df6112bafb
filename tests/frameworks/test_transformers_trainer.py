"""transformers 5.23 ``Trainer`` with FSDP2 and SHARDED_STATE_DICT: ``checkpoint-2/`` holds accelerate's
``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (two param groups, with ``initial_lr``), plus the Trainer's
rng, scheduler and trainer_state files, and no config.json."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_dcp, load_full, load_hf
from _compare import assert_loads_in_transformers, assert_resumes
from _spawn import spawn
from _workers import tiny_llama, trainer_save
from ckptkit.errors import UsageError


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("trainer")
    spawn(trainer_save, 2, str(out))
    return out / "run" / "checkpoint-2", torch.load(out / "expected.pt", weights_only=True)


def test_trainer_export_hf(saved, tmp_path, llama_assets):
    ckpt, expected = saved
    ckptkit.export_hf(ckpt / "pytorch_model_fsdp_0", tmp_path / "hf", hf_assets=llama_assets, max_shard_size="40KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert_same_tree(load_hf(tmp_path / "hf"), expected["model"])
    assert_loads_in_transformers(tmp_path / "hf", expected["model"])
    with pytest.raises(UsageError, match=r"holds optimizer state only .*pytorch_model_fsdp_0"):
        ckptkit.export_hf(ckpt / "optimizer_0", tmp_path / "wrong")


def test_trainer_inspect_reshard_and_convert_keep_both_param_groups(saved, tmp_path):
    ckpt, expected = saved
    optim = ckptkit.inspect(ckpt / "optimizer_0")
    assert (optim.world_size, len(optim.tensors)) == (2, 63)
    ckptkit.convert(ckpt / "optimizer_0", tmp_path / "optimizer.pt", to="full")
    assert_same_tree(load_full(tmp_path / "optimizer.pt")["optimizer"]["state"], expected["optimizer"]["state"])
    ckptkit.reshard(ckpt / "optimizer_0", tmp_path / "optim3", world_size=3)
    optim = load_dcp(tmp_path / "optim3", tmp_path / "o.pt")["optimizer"]
    assert_same_tree(optim["state"], expected["optimizer"]["state"])
    assert [set(g["params"]) for g in optim["param_groups"]] == \
        [set(g["params"]) for g in expected["optimizer"]["param_groups"]]
    assert all("initial_lr" in g for g in optim["param_groups"])


def test_trainer_load_into_a_fresh_model(saved):
    ckpt, expected = saved
    model = tiny_llama()
    ckptkit.load(ckpt / "pytorch_model_fsdp_0", model)
    assert_same_tree(model.state_dict(), expected["model"])


def test_trainer_checkpoint_directory_loads_model_optimizer_and_step(saved, tmp_path):
    ckpt, expected = saved
    assert_resumes(ckpt, expected, step=2)
    ckptkit.reshard(ckpt, tmp_path / "r3", world_size=3)
    optim = load_dcp(tmp_path / "r3" / "optimizer_0", tmp_path / "o.pt")["optimizer"]
    assert_same_tree(optim["state"], expected["optimizer"]["state"])
    assert all("initial_lr" in g for g in optim["param_groups"])
    assert_resumes(tmp_path / "r3", expected, step=2)  # trainer_state.json is not carried: the optimizer's step


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"global_step": 2'],
                         ids=["nested-too-deep", "cut-short"])
def test_trainer_load_of_an_unreadable_trainer_state_is_one_line_naming_it(saved, tmp_path, text):
    import shutil

    from ckptkit.errors import FormatError

    ckpt, _ = saved
    shutil.copytree(ckpt, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "trainer_state.json").write_text(text)
    with pytest.raises(FormatError, match=r"trainer_state\.json: not the Trainer's state JSON") as raised:
        ckptkit.load(tmp_path / "ckpt", tiny_llama())
    assert "\n" not in str(raised.value)

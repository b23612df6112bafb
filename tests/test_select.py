"""The model-part rule (``ckptkit.ops.select``) as export-hf, convert --to hf and verify --model-only apply it.

Checkpoints are laid out as the frameworks lay them out; results are read back by safetensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from _checks import assert_same_tree, load_hf
from ckptkit.cli import cli
from ckptkit.errors import UsageError
from ckptkit.ops.convert import convert
from ckptkit.ops.export import export_hf
from ckptkit.ops.verify import verify


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(8, 4, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
            "model.norm.weight": torch.ones(4), "lm_head.weight": torch.randn(8, 4, generator=g)}


def _optimizer(model: dict[str, torch.Tensor], prefix: str = "") -> dict:
    """An AdamW state dict keyed by parameter name, as ``get_state_dict`` gives it."""
    state = {f"{prefix}{k}": {"step": torch.tensor(2.0), "exp_avg": v * 0.1, "exp_avg_sq": v * v}
             for k, v in model.items()}
    return {"state": state, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": list(state)}]}


def test_export_hf_torchtitan_layout_takes_the_top_level_tensors(tmp_path):
    # torchtitan's CheckpointManager: model keys flat at the top level, beside its training state.
    model = _model()
    state = {**model, "optimizer": _optimizer(model), "lr_scheduler": {"last_epoch": 3},
             "dataloader": {"world_size": 1}, "train_state": {"step": 3, "ntokens_seen": 4096}}
    dcp.save(state, checkpoint_id=str(tmp_path / "step-3"))
    report = export_hf(tmp_path / "step-3", tmp_path / "hf")
    assert_same_tree(load_hf(tmp_path / "hf"), model)
    assert report.notes == (
        "model taken from the top-level tensors beside the training state",
        "left out: dataloader (1 other entry); lr_scheduler (1 other entry); optimizer (12 tensors, 3 other "
        "entries); train_state (2 other entries)",
    )
    convert(tmp_path / "step-3", tmp_path / "converted", to="hf")
    assert_same_tree(load_hf(tmp_path / "converted"), model)
    assert verify(tmp_path / "step-3", tmp_path / "hf", model_only=True).ok


def test_convert_hf_of_a_training_checkpoint_writes_the_model_under_hf_names(tmp_path):
    # accelerate's FULL save and ckptkit.save alike: {"model": {HF names}, "optim": ..., "step": ...}
    model = _model()
    torch.save({"model": model, "optim": _optimizer(model), "scheduler": {"last_epoch": 2}, "step": 2},
               tmp_path / "train.pt")
    report = convert(tmp_path / "train.pt", tmp_path / "hf", to="hf")
    assert_same_tree(load_hf(tmp_path / "hf"), model)  # no optimizer moments, no model.model.* names
    assert report.notes[0] == "model taken from top-level key 'model'"
    assert report.notes[-1].startswith("left out: optim (12 tensors, ")


@pytest.mark.parametrize("layout, beside", [
    # accelerate (and the HF Trainer): save_state writes optimizer_0/ next to pytorch_model_fsdp_0/
    ("accelerate", "pytorch_model_fsdp_0"),
    # oumi: dcp.save(optimizer_state_dict) into optimizer/ next to model/, no prefix
    ("oumi", "model"),
])
def test_export_hf_refuses_an_optimizer_only_checkpoint_and_points_to_the_model(tmp_path, layout, beside):
    model = _model()
    optim_dir = tmp_path / ("optimizer_0" if layout == "accelerate" else "optimizer")
    if layout == "accelerate":
        dcp.save({"model": model}, checkpoint_id=str(tmp_path / beside))
        dcp.save({"optimizer": _optimizer(model)}, checkpoint_id=str(optim_dir))
    else:
        dcp.save(model, checkpoint_id=str(tmp_path / beside))
        dcp.save(_optimizer(model), checkpoint_id=str(optim_dir))
    with pytest.raises(UsageError, match=r"holds optimizer state only \(e\.g\. '.*exp_avg.*'.*\), no model weights\. "
                                         r"Frameworks save the model beside it: .*; the model is probably in "
                                         rf".*/{beside}$"):
        export_hf(optim_dir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    result = CliRunner().invoke(cli, ["export-hf", str(optim_dir), str(tmp_path / "hf2")])
    assert result.exit_code == 2 and result.output.startswith("ckptkit: error: ") and result.output.count("\n") == 1
    export_hf(tmp_path / beside, tmp_path / "hf")  # the model beside it exports under HF names
    assert_same_tree(load_hf(tmp_path / "hf"), model)


def test_export_hf_refuses_a_checkpoint_of_training_state_alone(tmp_path):
    torch.save({"lr_scheduler": {"last_epoch": 1}, "rng": torch.arange(4, dtype=torch.uint8)}, tmp_path / "s.pt")
    with pytest.raises(UsageError, match=r"holds no model weights, only training state \(lr_scheduler .*; rng"):
        export_hf(tmp_path / "s.pt", tmp_path / "hf")


@pytest.mark.parametrize("model_key, rule", [
    ("ema.model", "model taken from key 'ema.model' (--model-key)"),                        # nested dicts
    ("state_dict.net", "model taken from the keys under 'state_dict.net.' (--model-key)"),  # a key prefix
])
def test_export_hf_model_key_takes_a_dotted_path(tmp_path, model_key, rule):
    model = _model()
    torch.save({"ema": {"model": model}, "state_dict": {f"net.{k}": v + 1 for k, v in model.items()},
                "step": 1}, tmp_path / "src.pt")
    report = export_hf(tmp_path / "src.pt", tmp_path / "hf", model_key=model_key)
    expected = model if model_key == "ema.model" else {k: v + 1 for k, v in model.items()}
    assert_same_tree(load_hf(tmp_path / "hf"), expected)
    assert report.notes[0] == rule


def test_export_hf_lightning_trainer_strips_the_lightningmodule_attribute(tmp_path):
    # Lightning Trainer's full .ckpt: state_dict holds LightningModule names (self.model = LlamaForCausalLM).
    model = _model()
    ckpt = {"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.6.6",
            "state_dict": {f"model.{k}": v for k, v in model.items()},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"kth_value": torch.tensor(float("inf"))}},
            "optimizer_states": [_optimizer(model)], "lr_schedulers": [{"last_epoch": 2}]}
    torch.save(ckpt, tmp_path / "epoch=0-step=2.ckpt")
    report = export_hf(tmp_path / "epoch=0-step=2.ckpt", tmp_path / "hf")
    assert_same_tree(load_hf(tmp_path / "hf"), model)
    assert report.notes[:2] == ("model taken from top-level key 'state_dict' (a Lightning Trainer checkpoint: "
                                "LightningModule attribute 'model.' stripped)", "stripped 'model.' from 4 keys")
    # Fabric's own user keys carry no such attribute: the names stay.
    torch.save({"model": model, "optimizer": _optimizer(model), "step": 2}, tmp_path / "fabric.ckpt")
    export_hf(tmp_path / "fabric.ckpt", tmp_path / "hf2")
    assert_same_tree(load_hf(tmp_path / "hf2"), model)

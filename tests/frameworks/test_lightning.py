"""Lightning 2.6 (FSDPStrategy, FSDP1): Fabric's ``fabric.save`` and the Trainer's ``ModelCheckpoint``, sharded
(a DCP directory plus ``meta.pt``) and full (one ``torch.save`` file); Lightning itself loads what ckptkit
writes from them, at another world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_full, load_hf
from _compare import assert_loads_in_transformers
from _spawn import spawn
from _workers import (
    fabric_load,
    fabric_save,
    lightning_trainer_load,
    lightning_trainer_save,
    tiny_llama,
)
from ckptkit.ops.inspect import summary

# ------------------------------------------------------------------------------------------------ Fabric


@pytest.fixture(scope="module")
def fabric(tmp_path_factory) -> dict:
    """Fabric saves at 2 ranks; ckptkit converts; Fabric loads ckptkit's outputs at 3 ranks."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("fabric")
    spawn(fabric_save, 2, str(out))
    ckptkit.convert(out / "sharded", out / "from-sharded.ckpt", to="full")       # loaded by _lazy_load
    ckptkit.reshard(out / "sharded", out / "resharded3", world_size=3)
    ckptkit.convert(out / "ckpt.pt", out / "from-full3", to="sharded", world_size=3)  # meta.pt written
    paths = [str(out / n) for n in ("from-sharded.ckpt", "resharded3", "from-full3")]
    loads = spawn(fabric_load, 3, paths, str(out / "expected.pt"))[0]
    return {"out": out, "expected": torch.load(out / "expected.pt", weights_only=True),
            "loads": {Path(r["path"]).name: r for r in loads}}


@pytest.mark.parametrize("name", [
    "resharded3",         # ckptkit reshard of Fabric's sharded checkpoint, 2 -> 3 ranks, meta.pt carried
    "from-full3",         # ckptkit convert of Fabric's full checkpoint to sharded for 3 ranks, meta.pt written
    "from-sharded.ckpt",  # ckptkit convert of Fabric's sharded checkpoint to one full file
])
def test_fabric_loads_ckptkit_output_at_another_world_size(fabric, name):
    loaded = fabric["loads"][name]
    assert loaded["model"] == [] and loaded["optimizer"] == [], loaded
    assert (loaded["step"], loaded["hparams"], loaded["last_epoch"]) == (2, {"lr": 1e-2, "name": "tiny"}, 2)
    assert loaded["rest"] == {}


def test_fabric_lazy_load_reads_ckptkit_full_output(fabric):
    from lightning.fabric.utilities.load import _lazy_load, _materialize_tensors

    lazy = _materialize_tensors(_lazy_load(fabric["out"] / "from-sharded.ckpt"))
    assert_same_tree(lazy["model"], fabric["expected"]["model"])
    assert lazy["step"] == 2 and lazy["scheduler"]["last_epoch"] == 2


def test_fabric_inspect_export_and_load(fabric, tmp_path, llama_assets):
    out, expected = fabric["out"], fabric["expected"]
    manifest = ckptkit.inspect(out / "sharded")
    assert summary(manifest)["details"]["meta.pt"] == "Lightning's non-tensor state: 3 entries"
    assert {str(e.path[0]) for e in manifest.entries if e.sidecar} == {"scheduler", "step", "hparams"}
    assert len(ckptkit.inspect(out / "ckpt.pt").tensors) == 21 + 63  # FSDP1's _has_been_cloned tensors read
    for src in (out / "sharded", out / "ckpt.pt"):
        ckptkit.export_hf(src, tmp_path / src.name, hf_assets=llama_assets)
        assert_same_tree(load_hf(tmp_path / src.name), expected["model"])
        model = tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert ckptkit.load(src, model, optimizer=opt).optimizer_loaded
        assert_same_tree(model.state_dict(), expected["model"])
        assert_same_tree({n: opt.state[p] for n, p in model.named_parameters()}, expected["optimizer"]["state"])
    assert_loads_in_transformers(tmp_path / "sharded", expected["model"])


# ----------------------------------------------------------------------------------------------- Trainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> dict:
    """The Trainer saves at 2 ranks; ckptkit reshards; the Trainer resumes from it at 3 ranks."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("lightning-trainer")
    spawn(lightning_trainer_save, 2, str(out))
    sharded = out / "ckpts" / "epoch=0-step=2.ckpt"
    ckptkit.reshard(sharded, out / "resharded3.ckpt", world_size=3)
    resumed = spawn(lightning_trainer_load, 3, str(out / "resharded3.ckpt"), str(out / "expected.pt"))[0]
    expected = torch.load(out / "expected.pt", weights_only=True)
    # expected.pt holds LightningModule names (self.model = LlamaForCausalLM): model.<HF name>
    hf = {k.removeprefix("model."): v for k, v in expected["model"].items()}
    return {"out": out, "sharded": sharded, "expected": expected, "hf": hf, "resumed": resumed,
            "meta": torch.load(sharded / "meta.pt", weights_only=True)}


def test_lightning_trainer_resumes_from_ckptkit_reshard_at_another_world_size(trainer):
    resumed = trainer["resumed"]
    assert resumed["model"] == [] and resumed["optimizer"] == [], resumed
    # global_step comes back from the loops' state in meta.pt; the Trainer then trains on to max_steps
    assert (resumed["global_step"], resumed["final_step"]) == (2, 3)
    assert resumed["last_epoch"] == trainer["meta"]["lr_schedulers"][0]["last_epoch"]


def test_lightning_trainer_inspect_and_export_hf_strips_the_lightningmodule_attribute(trainer, tmp_path,
                                                                                       llama_assets):
    manifest = ckptkit.inspect(trainer["sharded"])
    assert summary(manifest)["details"]["meta.pt"] == "Lightning's non-tensor state: 8 entries"
    assert {str(e.path[0]) for e in manifest.entries if e.sidecar} == set(trainer["meta"])
    assert len(ckptkit.inspect(trainer["out"] / "full.ckpt").tensors) == 21 + 63 + 1  # and the callback's kth_value
    for src in (trainer["sharded"], trainer["out"] / "full.ckpt"):
        report = ckptkit.export_hf(src, tmp_path / src.name, hf_assets=llama_assets)
        assert_same_tree(load_hf(tmp_path / src.name), trainer["hf"])
        assert "LightningModule attribute 'model.' stripped" in report.notes[0]
    assert_loads_in_transformers(tmp_path / trainer["sharded"].name, trainer["hf"])


def test_lightning_trainer_convert_full_keeps_meta_and_load_takes_model_and_optimizer(trainer, tmp_path):
    ckptkit.convert(trainer["sharded"], tmp_path / "full.ckpt", to="full")
    assert ckptkit.verify(trainer["sharded"], tmp_path / "full.ckpt").ok
    full = load_full(tmp_path / "full.ckpt")
    assert_same_tree({k: full[k] for k in trainer["meta"]}, trainer["meta"])  # global_step, loops, callbacks ...
    assert full["global_step"] == 2 and "fit_loop" in full["loops"]
    assert_same_tree(full["model"], trainer["expected"]["model"])
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert ckptkit.load(trainer["sharded"], model, optimizer=opt).optimizer_loaded
    assert_same_tree(model.state_dict(), trainer["hf"])
    assert_same_tree({f"model.{n}": opt.state[p] for n, p in model.named_parameters()},
                     trainer["expected"]["optimizer"]["state"])

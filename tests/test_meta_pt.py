"""Lightning's ``meta.pt`` beside a DCP directory: shown, carried through sharded outputs, merged into FULL.

Directories are laid out as Lightning's FSDP strategies write them (``dcp.save`` of modules and optimizers,
``torch.save`` of the rest into ``meta.pt``); Lightning itself reading ckptkit's output is in
``tests/frameworks/test_lightning.py``.
"""

from __future__ import annotations

import argparse
import fractions
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from _checks import assert_same_tree, hash_tree, load_dcp, load_full
from ckptkit.errors import FormatError, UnsafeCheckpointError
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.inspect import inspect, render, summary
from ckptkit.ops.verify import verify

META = {"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"kth_value": torch.tensor(float("inf")),
                                                          "best_model_path": "/runs/x.ckpt"}},
        "lr_schedulers": [{"last_epoch": 2, "_last_lr": [0.0025]}], "hyper_parameters": {"lr": 0.01}}


def _lightning_dir(root: Path, meta=None) -> tuple[Path, dict]:
    """A Lightning Trainer sharded checkpoint: ``{"model": ..., "optimizer_0": ...}`` as DCP, plus meta.pt."""
    g = torch.Generator().manual_seed(0)
    model = {"model.model.embed_tokens.weight": torch.randn(7, 4, generator=g),
             "model.lm_head.weight": torch.randn(7, 4, generator=g)}
    optim = {"state": {k: {"exp_avg": v * 2, "step": torch.tensor(2.0)} for k, v in model.items()},
             "param_groups": [{"lr": 0.0025, "params": list(model)}]}
    state = {"model": model, "optimizer_0": optim}
    dcp.save(state, checkpoint_id=str(root))
    torch.save(META if meta is None else meta, root / "meta.pt")
    return root, state


def test_inspect_shows_meta_pt_entries(tmp_path):
    src, _ = _lightning_dir(tmp_path / "epoch=0-step=2.ckpt")
    manifest = inspect(src)
    assert {str(e.path[0]) for e in manifest.entries if e.sidecar == "meta.pt"} == set(META)
    s = summary(manifest)
    assert s["details"]["meta.pt"] == "Lightning's non-tensor state: 7 entries"
    lines = render(s).splitlines()
    assert "  global_step = 2  (meta.pt)" in lines
    assert "  lr_schedulers.0.last_epoch = 2  (meta.pt)" in lines
    kth = "callbacks.ModelCheckpoint{'monitor': None}.kth_value"
    assert any(line.startswith(f"  {kth}") and line.endswith("(meta.pt)") for line in lines)


@pytest.mark.parametrize("world_size", [1, 3])
def test_reshard_carries_meta_pt(tmp_path, world_size):
    src, state = _lightning_dir(tmp_path / "src.ckpt")
    reshard(src, tmp_path / "out.ckpt", world_size=world_size)
    assert_same_tree(torch.load(tmp_path / "out.ckpt" / "meta.pt", weights_only=True), META)
    assert verify(src, tmp_path / "out.ckpt").ok
    assert_same_tree(load_dcp(tmp_path / "out.ckpt", tmp_path / "c.pt"), state)  # nothing of meta.pt in the DCP
    convert(src, tmp_path / "conv", to="sharded", world_size=2)
    assert_same_tree(torch.load(tmp_path / "conv" / "meta.pt", weights_only=True), META)


def test_reshard_keeps_an_empty_meta_pt(tmp_path):
    # fabric.save of modules and optimizers alone: meta.pt is {}, and Lightning still needs the file
    src, state = _lightning_dir(tmp_path / "src", meta={})
    reshard(src, tmp_path / "out", world_size=2)
    assert torch.load(tmp_path / "out" / "meta.pt", weights_only=True) == {}
    assert_same_tree(load_dcp(tmp_path / "out", tmp_path / "c.pt"), state)


def test_convert_full_merges_meta_pt_at_the_top_level(tmp_path):
    src, state = _lightning_dir(tmp_path / "src")
    convert(src, tmp_path / "full.ckpt", to="full")
    assert_same_tree(load_full(tmp_path / "full.ckpt"), {**state, **META})
    assert verify(src, tmp_path / "full.ckpt").ok


def test_convert_full_to_sharded_writes_meta_pt_and_keeps_it_through_reshard(tmp_path):
    # Fabric's full checkpoint: modules and optimizers beside the rest of the user's state.
    _, state = _lightning_dir(tmp_path / "unused")
    full = {**state, "scheduler": {"last_epoch": 2}, "step": 2, "hparams": {"lr": 0.01, "name": "tiny"}}
    torch.save(full, tmp_path / "ckpt.pt")
    convert(tmp_path / "ckpt.pt", tmp_path / "dcp", to="sharded", world_size=2)
    rest = {"scheduler": {"last_epoch": 2}, "step": 2, "hparams": {"lr": 0.01, "name": "tiny"}}
    assert torch.load(tmp_path / "dcp" / "meta.pt", weights_only=True) == rest
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "c.pt"), full)  # DCP's loaders still see all of it
    reshard(tmp_path / "dcp", tmp_path / "dcp3", world_size=3)
    assert torch.load(tmp_path / "dcp3" / "meta.pt", weights_only=True) == rest
    convert(tmp_path / "dcp3", tmp_path / "back.pt", to="full")
    assert_same_tree(load_full(tmp_path / "back.pt"), full)


def test_meta_pt_off_the_allow_list_is_carried_as_it_is(tmp_path):
    src, _ = _lightning_dir(tmp_path / "src", meta={"hparams": fractions.Fraction(1, 3)})
    before = hash_tree(src / "meta.pt")
    assert "not readable as data" in summary(inspect(src))["details"]["meta.pt"]
    reshard(src, tmp_path / "out", world_size=2)
    assert (tmp_path / "out" / "meta.pt").read_bytes() == (src / "meta.pt").read_bytes()
    with pytest.raises(UnsafeCheckpointError, match=r"meta\.pt.*fractions\.Fraction, which is not on ckptkit's "
                                                    r"allow-list"):
        convert(src, tmp_path / "full.pt", to="full")
    assert hash_tree(src / "meta.pt") == before


def test_meta_pt_hparams_namespace_is_read_as_data_and_written_back_as_torch_loads_it(tmp_path):
    hparams = argparse.Namespace(lr=0.01, layers=2, name="run")
    src, _ = _lightning_dir(tmp_path / "src", meta={"hparams": hparams})
    assert "not readable as data" not in summary(inspect(src))["details"]["meta.pt"]
    convert(src, tmp_path / "full.pt", to="full")
    assert torch.load(tmp_path / "full.pt", weights_only=False)["hparams"] == hparams
    reshard(src, tmp_path / "out", world_size=2)
    assert torch.load(tmp_path / "out" / "meta.pt", weights_only=False)["hparams"] == hparams


def test_meta_pt_damaged_stops_the_copy(tmp_path):
    # Carried as it is only when a class is all that stops reading it: a broken archive is not passed on.
    src, _ = _lightning_dir(tmp_path / "src", meta={"step": 2})
    data = (src / "meta.pt").read_bytes()
    (src / "meta.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match=r"meta\.pt"):
        reshard(src, tmp_path / "out", world_size=2)
    assert not (tmp_path / "out").exists()

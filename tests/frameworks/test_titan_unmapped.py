"""torchtitan 0.3's families that ckptkit does not map are refused by name under ``--preset auto``: a flux
checkpoint (a diffusion model, whose Hugging Face form is diffusers') never reaches an HF folder under its own
names. The names come from torchtitan's own flux state-dict adapter."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import UsageError

pytest.importorskip("torchtitan")


def flux_names() -> list[str]:
    """torchtitan's own names of flux's tensors (its adapter's direct map; layer ``{}`` as block 0). flux's
    package ``__init__`` imports its data pipeline (PIL, datasets), which naming tensors does not need: the model
    subpackage is loaded without it."""
    import torchtitan.models as models

    if "torchtitan.models.flux" not in sys.modules:
        package = types.ModuleType("torchtitan.models.flux")
        package.__path__ = [os.path.join(models.__path__[0], "flux")]
        sys.modules["torchtitan.models.flux"] = package
    from torchtitan.models.flux.model.state_dict_adapter import FluxStateDictAdapter

    adapter = FluxStateDictAdapter.__new__(FluxStateDictAdapter)
    FluxStateDictAdapter.__init__(adapter, None, None)
    return [name.format(0) for name in adapter.from_hf_map_direct.values() if name is not None]


@pytest.fixture(scope="module")
def flux_dcp(tmp_path_factory) -> Path:
    """A model-only DCP with flux's torchtitan names, as torchtitan's CheckpointManager keeps them."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("flux") / "step-0"
    dcp.save({name: torch.randn(4, 2) for name in flux_names()}, checkpoint_id=str(out), no_dist=True)
    return out


def test_export_hf_refuses_torchtitans_flux_by_name(flux_dcp, tmp_path):
    with pytest.raises(UsageError, match=r"torchtitan's flux is not mapped: the keys are its names .*diffusers"):
        ckptkit.export_hf(flux_dcp, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_export_hf_refuses_a_flux_config_by_name_and_keeps_names_under_preset_none(flux_dcp, tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text('{"_class_name": "FluxTransformer2DModel", "num_layers": 1}')
    with pytest.raises(UsageError, match=r"config.json names 'FluxTransformer2DModel'"):
        ckptkit.export_hf(flux_dcp, tmp_path / "hf", hf_assets=assets)
    ckptkit.export_hf(flux_dcp, tmp_path / "kept", hf_assets=assets, preset="none")
    from safetensors import safe_open

    with safe_open(tmp_path / "kept" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(flux_names())

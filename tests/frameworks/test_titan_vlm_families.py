"""torchtitan 0.3's multimodal families both ways, against torchtitan's own state-dict adapters and transformers:
Kimi K2.5 (``kimi_k2_7``).

Tiny models of torchtitan's own classes (:mod:`_titan_families`) are saved as torchtitan's CheckpointManager
saves them, over 2 gloo ranks, once for the module. Then:

- ``export-hf`` equals torchtitan's ``to_hf()`` of the same state dict, key for key and bit for bit, and the
  transformers class of the family loads it with nothing missing, unexpected or mismatched;
- an HF checkpoint of each family (``to_hf()`` of another torchtitan model: the release layout) converts to a
  torchtitan DCP that torchtitan's strict ``dcp.load`` of its whole model reads as ``from_hf()`` of the same
  weights, and back to HF unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_hf
from _spawn import spawn

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
import _titan_families as fam  # noqa: E402  (imports torchtitan's models lazily, after the skip)

NAMES = ("kimi_k2_7",)
_PRESETS = {"kimi_k2_7": "torchtitan-kimi-k2.5"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("titan_vlm_families")
    spawn(fam.save_families, 2, str(out), NAMES)
    return out


def to_hf(name: str, state: dict) -> dict:
    """torchtitan's ``to_hf()`` of ``state``."""
    config, adapter, _ = fam.family(name)
    return adapter(config, None).to_hf({k: v.clone() for k, v in state.items()})


def from_hf(name: str, hf: dict) -> dict:
    """torchtitan's ``from_hf()`` of ``hf``."""
    config, adapter, _ = fam.family(name)
    return adapter(config, None).from_hf(dict(hf))


def hf_class_loads(directory: Path) -> None:
    """The transformers class that ``config.json`` names loads ``directory`` with nothing missing, unexpected or
    mismatched."""
    import transformers

    config = json.loads((directory / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    _, info = cls.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("name", NAMES)
def test_export_hf_equals_torchtitans_to_hf_and_loads_in_transformers(saved, tmp_path, name):
    expected = to_hf(name, torch.load(saved / name / "expected.pt", weights_only=True))
    ckptkit.export_hf(saved / name / "step-0", tmp_path / "hf", hf_assets=saved / name / "assets")
    assert_same_tree(load_hf(tmp_path / "hf"), expected)
    hf_class_loads(tmp_path / "hf")


def hf_dir(name: str, state: dict, out: Path) -> Path:
    from safetensors.torch import save_file

    fam.write_hf_assets(name, out)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_convert_hf_to_torchtitan_dcp_resumes_in_torchtitan_as_from_hf_and_exports_back(tmp_path, name):
    import torch.distributed.checkpoint as dcp

    hf = {k: v.contiguous() for k, v in to_hf(name, fam.build(name, seed=1).state_dict()).items()}
    src = hf_dir(name, hf, tmp_path / "hf")
    expected = from_hf(name, hf)
    ckptkit.convert(src, tmp_path / "titan", to="sharded", world_size=2, preset=_PRESETS[name])
    state = fam.build(name, seed=5).state_dict()  # torchtitan's whole model: a strict load
    dcp.load(state, checkpoint_id=str(tmp_path / "titan"))
    initial = fam.build(name, seed=5, perturb=False).state_dict()
    assert_same_tree(state, {k: expected.get(k, v) for k, v in initial.items()})
    ckptkit.export_hf(tmp_path / "titan", tmp_path / "back", hf_assets=src)
    assert_same_tree(load_hf(tmp_path / "back"), hf)

"""torchtitan 0.3's model families both ways, against torchtitan's own state-dict adapters and transformers.

Tiny models of torchtitan's own classes (Qwen3, Qwen3-MoE, DeepSeek-V3; :mod:`_titan_families`) are saved as
torchtitan's CheckpointManager saves them, over 2 gloo ranks, once for the module. Then:

- ``export-hf`` equals torchtitan's ``to_hf()`` of the same state dict, key for key and bit for bit, loads in
  transformers with nothing missing or unexpected, and gives the logits of the model built from ``to_hf()``;
- an HF model of each family, saved by transformers, converts to a torchtitan DCP at 2 and 3 ranks that
  ``dcp.load`` reads into torchtitan's model as ``from_hf()`` of the same weights, and back to HF unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_hf
from _spawn import spawn

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
import _titan_families as fam  # noqa: E402  (imports torchtitan's models lazily, after the skip)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("titan_families")
    spawn(fam.save_families, 2, str(out))
    return out


def to_hf(name: str, state: dict) -> dict:
    config, adapter, _ = fam.family(name)
    return adapter(config, None).to_hf({k: v.clone() for k, v in state.items()})


def hf_model(name: str, directory: Path):
    """transformers' model of ``directory``, loaded with nothing missing, unexpected or mismatched."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def hf_dir(name: str, state: dict, out: Path) -> Path:
    """``state`` saved as an HF model directory with the family's config.json."""
    from safetensors.torch import save_file

    fam.write_hf_assets(name, out)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("name", fam.FAMILIES)
def test_export_hf_equals_torchtitans_to_hf_and_loads_in_transformers(saved, tmp_path, name):
    expected = to_hf(name, torch.load(saved / name / "expected.pt", weights_only=True))
    ckptkit.export_hf(saved / name / "step-0", tmp_path / "hf", hf_assets=saved / name / "assets")
    got = load_hf(tmp_path / "hf")
    assert_same_tree(got, expected)
    tokens = torch.randint(0, fam.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = hf_model(name, tmp_path / "hf")(tokens).logits
        theirs = hf_model(name, hf_dir(name, expected, tmp_path / "theirs"))(tokens).logits
    assert torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory) -> dict[str, Path]:
    """Each family as transformers saves it (``save_pretrained`` of a model built from the HF config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tmp_path_factory.mktemp("hf_families")
    dirs = {}
    for name in fam.FAMILIES:
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fam.family(name)[2]), dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        model.save_pretrained(out / name)
        dirs[name] = out / name
    return dirs


def titan_load(name: str, dcp_dir: Path, keys) -> dict:
    """``dcp.load`` of ``keys`` (torchtitan's model's) from ``dcp_dir``, as CheckpointManager loads a model at
    step 0: the model's keys flat at the top level."""
    import torch.distributed.checkpoint as dcp

    model = fam.build(name, seed=5)
    state = {k: v for k, v in model.state_dict().items() if k in keys}
    dcp.load(state, checkpoint_id=str(dcp_dir))
    return state


@pytest.mark.parametrize("name", fam.FAMILIES)
@pytest.mark.parametrize("ranks", [2, 3])
def test_convert_hf_to_torchtitan_dcp_loads_as_from_hf_and_exports_back_unchanged(hf_saved, tmp_path, name, ranks):
    config, adapter, _ = fam.family(name)
    hf = load_hf(hf_saved[name])
    expected = adapter(config, None).from_hf(dict(hf))
    ckptkit.convert(hf_saved[name], tmp_path / "titan", to="sharded", world_size=ranks,
                    preset=_PRESETS[name], hf_assets=hf_saved[name])
    assert_same_tree(titan_load(name, tmp_path / "titan", expected), expected)
    ckptkit.export_hf(tmp_path / "titan", tmp_path / "back", hf_assets=hf_saved[name])
    assert_same_tree(load_hf(tmp_path / "back"), hf)


_PRESETS = {"qwen3": "torchtitan-qwen3", "qwen3_moe": "torchtitan-qwen3-moe", "deepseek_v3": "torchtitan-deepseek-v3"}

"""A rename carries the optimizer's moments: torchtitan's stacked experts split and joined as its own adapter
splits and joins the weights, and the state a rename cannot carry refused by name. Resumes through a rename, in
each framework's own loader, are the cells of the resume matrix (``test_resume_matrix.py``).
"""

from __future__ import annotations

import re

import pytest
import torch

import ckptkit

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")


def _moments(params: dict[str, torch.Tensor], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW-shaped state of each parameter, every value distinct: exp_avg, exp_avg_sq, step."""
    g = torch.Generator().manual_seed(seed)
    return {k: {"exp_avg": torch.randn(v.shape, generator=g), "exp_avg_sq": torch.rand(v.shape, generator=g),
                "step": torch.tensor(3.0)} for k, v in params.items()}


def _slot(state: dict[str, dict[str, torch.Tensor]], slot: str) -> dict[str, torch.Tensor]:
    return {k: v[slot] for k, v in state.items()}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """torchtitan's Qwen3-MoE (stacked experts) and AdamW-shaped state of its parameters, by torchtitan's names
    and, through torchtitan's own adapter (a linear map, so moments map as weights do), by HF's."""
    import _titan_families as fam

    out = tmp_path_factory.mktemp("moe")
    model = fam.build("qwen3_moe")
    config, adapter, _ = fam.family("qwen3_moe")
    buffers = {n for n, _ in model.named_buffers()}  # the weights by their checkpoint names (q/k/v apart)
    titan = {k: v.detach() for k, v in model.state_dict().items() if k not in buffers}
    state = _moments(titan, 3)
    hf = {slot: adapter(config, None).to_hf(_slot(state, slot)) for slot in ("exp_avg", "exp_avg_sq")}
    return out, fam.write_hf_assets("qwen3_moe", out / "assets"), titan, state, hf, adapter(config, None)


def test_convert_joins_and_splits_moments_of_stacked_experts_as_torchtitans_adapter(moe, tmp_path):
    import torch.distributed.checkpoint as dcp

    out, assets, titan, state, hf, adapter = moe
    flat = {f"state.{k}.{slot}": v for k, slots in state.items() for slot, v in slots.items()}
    dcp.save({**titan, "optimizer": {**flat, **{f"param_groups.{k}.lr": 0.01 for k in titan}}},
             checkpoint_id=str(tmp_path / "titan"))
    ckptkit.convert(tmp_path / "titan", tmp_path / "hf", to="sharded", world_size=2, preset="torchtitan-qwen3-moe",
                    hf_assets=assets)  # torchtitan -> HF: stacked experts split per expert
    names = list(hf["exp_avg"])
    got = {f"state.{k}.{s}": torch.zeros_like(hf["exp_avg"][k]) for k in names for s in ("exp_avg", "exp_avg_sq")}
    got |= {f"state.{k}.step": torch.tensor(0.0) for k in names} | {f"param_groups.{k}.lr": 0.0 for k in names}
    dcp.load({"optimizer": got}, checkpoint_id=str(tmp_path / "hf"))
    for slot in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(got[f"state.{k}.{slot}"], hf[slot][k]) for k in names)
    assert all(got[f"state.{k}.step"] == 3 and got[f"param_groups.{k}.lr"] == 0.01 for k in names)

    # HF -> torchtitan: per-expert moments joined into the stacked ones, as torchtitan's from_hf joins weights.
    osd = {"state": {k: {s: hf[s][k] for s in hf} | {"step": torch.tensor(3.0)} for k in names},
           "param_groups": [{"lr": 0.01, "params": names}]}
    dcp.save({"model": {k: torch.zeros_like(v) for k, v in adapter.to_hf(dict(titan)).items()}, "optim": osd},
             checkpoint_id=str(tmp_path / "from_hf"))
    ckptkit.convert(tmp_path / "from_hf", tmp_path / "back", to="sharded", world_size=3,
                    preset="torchtitan-qwen3-moe", hf_assets=assets)
    back = {f"state.{k}.{s}": torch.zeros_like(v) for k, v in titan.items() for s in ("exp_avg", "exp_avg_sq")}
    back |= {f"param_groups.{k}.lr": 0.0 for k in titan}
    dcp.load({"optimizer": back}, checkpoint_id=str(tmp_path / "back"))
    assert all(torch.equal(back[f"state.{k}.{s}"], state[k][s]) for k in titan for s in ("exp_avg", "exp_avg_sq"))
    assert all(back[f"param_groups.{k}.lr"] == 0.01 for k in titan)


def test_convert_refuses_optimizer_state_that_is_not_element_wise(moe, tmp_path):
    import torch.distributed.checkpoint as dcp

    out, assets, titan, _, _, _ = moe
    key = next(k for k, v in titan.items() if v.dim() == 2)
    factored = {f"state.{k}.exp_avg_sq_row": torch.ones(v.shape[0]) for k, v in titan.items() if v.dim() == 2}
    dcp.save({**titan, "optimizer": factored}, checkpoint_id=str(tmp_path / "adafactor"))
    with pytest.raises(ckptkit.CheckpointError, match=rf"optimizer state 'optimizer\.state\.{re.escape(key)}\."
                                                      r"exp_avg_sq_row' of shape \[\d+\] is not element-wise"):
        ckptkit.convert(tmp_path / "adafactor", tmp_path / "out", to="sharded", preset="torchtitan-qwen3-moe",
                        hf_assets=assets)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_the_optimizer_state_of_torchtitans_fused_qkv_by_name(moe, tmp_path):
    import torch.distributed.checkpoint as dcp

    import _titan_families as fam

    out, assets, titan, _, _, _ = moe
    fused = {n: p.detach() for n, p in fam.build("qwen3_moe").named_parameters()}  # as its optimizer names them
    state = {f"state.{k}.{s}": v for k, slots in _moments(fused, 4).items() for s, v in slots.items()}
    dcp.save({**titan, "optimizer": state}, checkpoint_id=str(tmp_path / "fused"))
    with pytest.raises(ckptkit.CheckpointError, match=r"optimizer state 'optimizer\.state\.layers\.0\.attention\."
                                                      r"qkv_linear\.wqkv\.weight', .* names no parameter the model's "
                                                      r"weights are saved as"):
        ckptkit.convert(tmp_path / "fused", tmp_path / "out", to="sharded", preset="torchtitan-qwen3-moe",
                        hf_assets=assets)

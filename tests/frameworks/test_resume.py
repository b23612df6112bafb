"""Resume in another framework with the optimizer: a rename carries the moments (:mod:`_resume`).

torchtitan's own Llama 3 and plain FSDP2 (transformers' Llama) each train 3 steps on 2 gloo ranks and save with
their own calls; ckptkit renames each into the other's names (``--preset torchtitan-llama``, the rotary q/k row
order applied to the weights *and* to ``exp_avg``/``exp_avg_sq``) at 3 ranks; each resumes in the other
framework with its own loader for steps 4-6. The oracle is the uninterrupted run: the losses and the final
weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import ckptkit

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
import _resume  # noqa: E402  (imports torchtitan lazily, after the skip)
from _spawn import spawn  # noqa: E402

NOISE = 1e-5
"""torchtitan's and transformers' forwards differ in float rounding (complex vs rotate-half RoPE): the
resumed runs stay within 1e-6 of the uninterrupted ones, losses and weights alike."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    out = tmp_path_factory.mktemp("resume")
    _resume.hf_config().save_pretrained(out / "assets")
    spawn(_resume.sources, 2, str(out))
    for src, dst in (("titan", "titan_as_hf"), ("fsdp2", "fsdp2_as_titan")):
        ckptkit.convert(out / src / "step-3", out / dst, to="sharded", world_size=3, preset="torchtitan-llama",
                        hf_assets=out / "assets")
    spawn(_resume.resumes, 3, str(out / "titan_as_hf"), str(out / "fsdp2_as_titan"), str(out))
    return out, torch.load(out / "expected.pt", weights_only=True), torch.load(out / "resumed.pt", weights_only=True)


def _assert_on_the_trajectory(resumed: dict, expected: dict) -> None:
    assert resumed["losses"] == pytest.approx(expected["losses"][3:], abs=NOISE)
    assert resumed["model"].keys() == expected["model"].keys()
    worst = max((resumed["model"][k] - expected["model"][k]).abs().max().item() for k in expected["model"])
    assert worst < NOISE, worst


def test_convert_torchtitan_to_hf_names_resumes_in_fsdp2_on_the_trajectory(runs):
    out, expected, resumed = runs
    _assert_on_the_trajectory(resumed["titan"], expected["titan"])


def test_resume_with_a_fresh_optimizer_leaves_the_trajectory_by_far_more_than_the_tolerance(runs):
    _, expected, resumed = runs
    control, oracle = resumed["fresh optimizer"]["model"], expected["titan"]["model"]
    assert max((control[k] - oracle[k]).abs().max().item() for k in oracle) > 100 * NOISE


def test_convert_fsdp2_to_torchtitan_names_resumes_in_torchtitan_on_the_trajectory(runs):
    out, expected, resumed = runs
    _assert_on_the_trajectory(resumed["fsdp2"], expected["fsdp2"])


def test_convert_under_a_preset_reports_the_optimizer_carried(runs, tmp_path):
    out, _, _ = runs
    report = ckptkit.convert(out / "titan" / "step-3", tmp_path / "hf", to="sharded", preset="torchtitan-llama",
                             hf_assets=out / "assets", dry_run=True)
    assert not any(n.startswith("left out") for n in report.notes), report.notes
    assert any(n.startswith("optimizer 'optimizer' carried under the mapped names: 21 parameters' state "
                            "(exp_avg, exp_avg_sq, step)") for n in report.notes), report.notes


def test_load_resumes_the_renamed_optimizer(runs):
    out, _, _ = runs
    model = _resume.hf_model(5)
    opt = torch.optim.AdamW(model.parameters(), lr=_resume.LR)
    assert ckptkit.load(out / "titan_as_hf", model, optimizer=opt).optimizer_loaded
    assert all(opt.state[p]["step"].item() == 3 for p in model.parameters())


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

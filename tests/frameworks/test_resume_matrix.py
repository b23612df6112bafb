"""The resume matrix: eight frameworks' own saves (:mod:`_matrix`) resumed by five targets' own load paths
(:mod:`_matrix_targets`, and ``ckptkit.load``) after the conversion each cell needs.

Every cell converts the step-3 save with the command the resume guide names, resumes it with the target's own
calls on 2 gloo ranks and trains steps 4-6: the losses and the final weights (HF names) must be the source's
uninterrupted run's within :data:`TOLERANCE`, and the step the target's state holds after the load must be 3.
Each target's control, the first source's weights with a fresh optimizer, must miss by far more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit

for _module in ("transformers", "torchtitan", "deepspeed", "megatron.core", "accelerate", "lightning"):
    pytest.importorskip(_module)
import _matrix as mx  # noqa: E402  (imports the frameworks lazily, after the skips)
import _matrix_targets as mt  # noqa: E402
import _megatron_distopt as md  # noqa: E402
from _spawn import spawn  # noqa: E402

TOLERANCE = 1e-6
"""The frameworks' forwards differ in float rounding (complex and rotate-half RoPE): the resumed runs stay within
5e-7 of the uninterrupted ones, losses and weights alike."""
HF_NAMED = ("fsdp2", "ckptkit", "accelerate", "fabric", "zero2", "zero3")
"""The sources that save transformers' Llama, under HF names."""
TARGETS = ("fsdp2", "torchtitan", "deepspeed", "megatron", "load")


def saved(sources: Path, source: str) -> Path:
    """Where ``source`` saved its step-3 checkpoint (a run or save directory, as its framework lays it out)."""
    return sources / {"torchtitan": "torchtitan/step-3", "megatron": "megatron/step-3"}.get(source, source)


def _hf_names(sources: Path, source: str, out: Path, assets: Path) -> Path:
    """``source``'s save under HF names at 3 ranks: ``reshard`` of an HF-named save, ``convert --preset`` of
    torchtitan's and megatron-core's."""
    dst = out / f"{source}-hf"
    if not dst.exists():
        if source in HF_NAMED:
            ckptkit.reshard(saved(sources, source), dst, world_size=3)
        else:
            ckptkit.convert(saved(sources, source), dst, to="sharded", world_size=3, preset=f"{source}-llama"
                            if source == "megatron" else "torchtitan-llama", hf_assets=assets)
    return dst


def convert(sources: Path, source: str, target: str, out: Path, assets: Path) -> Path:
    """The cell's conversion of ``source``'s save for ``target`` (the commands of the resume guide's matrix)."""
    src, dst = saved(sources, source), out / f"{source}-{target}"
    if target in ("fsdp2", "load"):
        return _hf_names(sources, source, out, assets)
    if target == "torchtitan" and source == "torchtitan":
        ckptkit.reshard(src, dst, world_size=3)
    elif target == "torchtitan":
        hf = src if source in HF_NAMED else _hf_names(sources, source, out, assets)
        ckptkit.convert(hf, dst, to="sharded", world_size=3, preset="torchtitan-llama", hf_assets=assets)
    elif target == "deepspeed":
        preset = {"torchtitan": "torchtitan-llama", "megatron": "megatron-llama"}.get(source)
        ckptkit.convert(src, dst, to="deepspeed-universal", preset=preset, hf_assets=assets if preset else None)
    else:
        hf = src if source in HF_NAMED else _hf_names(sources, source, out, assets)
        ckptkit.convert(hf, dst, to="megatron", hf_assets=assets)
    return dst


@pytest.fixture(scope="module")
def matrix(matrix_sources, tmp_path_factory) -> dict[str, Any]:
    """Every cell's conversion, and the sources' uninterrupted runs."""
    out = tmp_path_factory.mktemp("matrix")
    md.hf_config().save_pretrained(out / "assets")
    converted = {(s, t): convert(matrix_sources, s, t, out, out / "assets") for t in TARGETS for s in mx.SOURCES}
    return {"out": out, "converted": converted, "expected": torch.load(matrix_sources / "expected.pt",
                                                                       weights_only=True)}


def _cells(matrix: dict, target: str) -> list[tuple[str, str]]:
    return [(s, str(matrix["converted"][s, target])) for s in mx.SOURCES]


@pytest.fixture(scope="module")
def into_fsdp2(matrix) -> dict[str, Any]:
    spawn(mt.fsdp2, 2, _cells(matrix, "fsdp2"), str(matrix["out"] / "fsdp2.pt"))
    return torch.load(matrix["out"] / "fsdp2.pt", weights_only=True)


@pytest.fixture(scope="module")
def into_torchtitan(matrix) -> dict[str, Any]:
    spawn(mt.torchtitan, 2, _cells(matrix, "torchtitan"), str(matrix["out"] / "torchtitan.pt"))
    return torch.load(matrix["out"] / "torchtitan.pt", weights_only=True)


@pytest.fixture(scope="module")
def into_deepspeed(matrix) -> dict[str, Any]:
    spawn(mt.deepspeed, 2, _cells(matrix, "deepspeed"), str(matrix["out"] / "deepspeed.pt"))
    return torch.load(matrix["out"] / "deepspeed.pt", weights_only=True)


@pytest.fixture(scope="module")
def into_megatron(matrix) -> dict[str, Any]:
    spawn(mt.megatron, 2, _cells(matrix, "megatron"), str(matrix["out"] / "megatron.pt"))
    return torch.load(matrix["out"] / "megatron.pt", weights_only=True)


def _load_steps(model, opt, sched) -> list[float]:
    """Steps 4-6 in one process: the whole global batch at once, whose mean loss (and gradient) is the mean of
    the ranks' equal shares."""
    losses = []
    for step in mt.RESUMED:
        ids = md.batch(step, 0, 1)
        loss = mx.loss_of(model(ids), ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), mx.CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def into_load(matrix) -> dict[str, Any]:
    """``ckptkit.load`` of each cell into transformers' Llama and torch's AdamW (its scheduler built first), in
    this process."""
    out = {}
    for source, path in [*_cells(matrix, "load"), ("control", str(matrix["converted"][mx.SOURCES[0], "load"]))]:
        model = mx.hf_model(99)
        opt = mx.adamw(model)
        sched = mx.constant(opt)
        result = ckptkit.load(path, model, optimizer=opt, scheduler=sched, load_optimizer=source != "control")
        out[source] = {"step": result.step, "losses": _load_steps(model, opt, sched),
                       "model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    return out


def _worst(resumed: dict, expected: dict) -> tuple[float, float]:
    losses = max(abs(a - b) for a, b in zip(resumed["losses"], expected["losses"][md.SAVED:], strict=True))
    assert resumed["model"].keys() == expected["model"].keys()
    weights = max((resumed["model"][k] - expected["model"][k]).abs().max().item() for k in expected["model"])
    return losses, weights


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", mx.SOURCES)
def test_resume_matrix_cell_goes_on_on_the_uninterrupted_run(matrix, request, source, target):
    resumed = request.getfixturevalue(f"into_{target}")[source]
    assert resumed["step"] == md.SAVED
    if target == "torchtitan":  # torchtitan's schedule stands where the source's stood
        assert resumed["last_epoch"] == md.SAVED
    losses, weights = _worst(resumed, matrix["expected"][source])
    assert losses < TOLERANCE and weights < TOLERANCE, (losses, weights)
    if "logits" in resumed and "logits" in matrix["expected"][source]:  # megatron-core's forward of the same tokens
        assert (resumed["logits"] - matrix["expected"][source]["logits"]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("target", TARGETS)
def test_resume_matrix_control_with_a_fresh_optimizer_misses_by_far_more_than_the_tolerance(matrix, request,
                                                                                              target):
    resumed = request.getfixturevalue(f"into_{target}")["control"]
    losses, weights = _worst(resumed, matrix["expected"][mx.SOURCES[0]])
    assert weights > 100 * TOLERANCE, weights


def test_resume_matrix_plain_fsdp2_goes_on_in_deepspeeds_zero3_engine_too(matrix, into_deepspeed):
    resumed = into_deepspeed["zero3 engine"]
    assert resumed["step"] == md.SAVED
    # DeepSpeed 0.19.8's ZeRO-3 load gives the first group's weight decay to both (ZeRO-2's keeps each group's)
    # and one step tensor to both sub-groups; the resume undoes both. If this fails, DeepSpeed loads them itself.
    assert resumed["weight_decay"] == [mx.WD, mx.WD] and into_deepspeed["fsdp2"]["weight_decay"] == [mx.WD, 0.0]
    assert resumed["shared_step"]
    losses, weights = _worst(resumed, matrix["expected"][mx.SOURCES[0]])
    assert losses < TOLERANCE and weights < TOLERANCE, (losses, weights)


def test_convert_to_megatron_joins_the_state_megatron_cores_own_load_restores(matrix_sources, into_megatron, matrix):
    # megatron-core's save -> HF names -> --to megatron: its own load restores every parameter's fp32 main
    # parameter and moments exactly as its run held them at the save.
    loaded = md.per_parameter_states(matrix["out"], "loaded")
    saved_states = md.per_parameter_states(matrix_sources / "megatron")
    assert loaded.keys() == saved_states.keys() and len(loaded) == 21
    for name, slots in saved_states.items():
        for slot in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[name][slot], slots[slot]), (name, slot)


@pytest.mark.parametrize("source", HF_NAMED)
def test_load_returns_the_step_each_framework_saved(matrix_sources, source):
    model = mx.hf_model(7)
    result = ckptkit.load(saved(matrix_sources, source), model, optimizer=mx.adamw(model))
    assert result.optimizer_loaded and result.step == md.SAVED


def test_convert_into_torchtitan_names_reports_the_optimizer_and_the_training_state_written(matrix_sources,
                                                                                          matrix):
    report = ckptkit.convert(saved(matrix_sources, "zero2"), matrix["out"] / "dry", to="sharded",
                             preset="torchtitan-llama", hf_assets=matrix["out"] / "assets", dry_run=True)
    assert any(n.startswith("optimizer 'optim' carried under the mapped names, as torchtitan keeps it ('optimizer', "
                            "param groups per parameter): 21 parameters' state (exp_avg, exp_avg_sq, step)")
               for n in report.notes), report.notes
    assert ("train_state written for torchtitan's Trainer: step 3 (from global_steps), ntokens_seen 0 (the source "
            "does not count tokens)") in report.notes
    assert ("lr_scheduler written for torchtitan's LRSchedulersContainer: last_epoch 3 (from global_steps)"
            in report.notes)


def test_convert_to_deepspeed_universal_of_megatron_cores_buckets_without_a_preset_is_refused_in_one_line(
        matrix_sources, tmp_path):
    from click.testing import CliRunner

    from ckptkit.cli import cli

    result = CliRunner().invoke(cli, ["convert", str(saved(matrix_sources, "megatron")), str(tmp_path / "uc"), "--to",
                                      "deepspeed-universal"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "megatron-core's DistributedOptimizer keeps its state in buckets" in result.stderr
    assert "--preset megatron-llama" in result.stderr and not (tmp_path / "uc").exists()

"""DeepSpeed's universal checkpoint, checked with DeepSpeed 0.19.8's own engine and converter on CPU.

An FSDP2 run (torch's ``fully_shard`` and AdamW, 2 gloo ranks) saves with DCP after step 3 and goes on to step 6
uninterrupted. ckptkit writes the step-3 save as a universal checkpoint; DeepSpeed's engine loads it with
``load_universal`` under ZeRO-2 on 1 rank and ZeRO-3 on 3 ranks and trains steps 4-6: its losses and final
parameters must be the uninterrupted run's to rounding (a resume with a fresh optimizer is 1e-2 off). The same
for a tiny Llama saved in torchtitan's layout after step 2 and resumed under ZeRO-1. And DeepSpeed's own
``ds_to_universal`` output, read by ckptkit, must hold DeepSpeed's own tensors.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from _ds_universal import Net, ds_resume, ds_save, fsdp2_run
from _spawn import spawn
from ckptkit.cli import cli
from ckptkit.errors import IncompleteCheckpointError, UsageError

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (bin/_env installs deepspeed==0.19.8)")
NOISE = 1e-5
"""Rounding between two runs of the same arithmetic in different partitions: seen up to 2.4e-7."""


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fsdp2")
    spawn(fsdp2_run, 2, str(out / "step3"), str(out / "run.pt"), 3, 6)
    return out / "step3", torch.load(out / "run.pt", weights_only=True)


@pytest.fixture(scope="module")
def universal(fsdp2, tmp_path_factory) -> tuple[Path, ckptkit.Report]:
    out = tmp_path_factory.mktemp("universal") / "ds"
    return out, ckptkit.convert(fsdp2[0], out, to="deepspeed-universal")


def _resumed(universal_dir: Path, tmp_path: Path, stage: int, world: int, first: int = 4, last: int = 6,
             kind: str = "net") -> dict:
    spawn(ds_resume, world, str(universal_dir), str(tmp_path / "resumed.pt"), stage, first, last, kind)
    return torch.load(tmp_path / "resumed.pt", weights_only=True)


def _assert_on_the_uninterrupted_run(resumed: dict, uninterrupted: dict, saved_at: int = 3) -> None:
    assert resumed["loaded"]["global_steps"] == saved_at
    losses = torch.tensor(resumed["losses"]) - torch.tensor(uninterrupted["losses"][saved_at:])
    assert losses.abs().max() < NOISE, losses
    assert resumed["params"].keys() == uninterrupted["params"].keys()
    for name, value in uninterrupted["params"].items():
        assert (resumed["params"][name] - value).abs().max() < NOISE, name


@needs_deepspeed
def test_convert_to_deepspeed_universal_resumes_zero2_on_one_rank_on_the_uninterrupted_run(fsdp2, universal,
                                                                                          tmp_path):
    resumed = _resumed(universal[0], tmp_path, stage=2, world=1)
    assert resumed["loaded"]["path"].endswith("global_step3/mp_rank_00_model_states.pt")
    _assert_on_the_uninterrupted_run(resumed, fsdp2[1])


@needs_deepspeed
def test_convert_to_deepspeed_universal_resumes_zero3_on_three_ranks_on_the_uninterrupted_run(fsdp2, universal,
                                                                                             tmp_path):
    resumed = _resumed(universal[0], tmp_path, stage=3, world=3)
    assert resumed["loaded"]["path"].endswith("global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt")
    _assert_on_the_uninterrupted_run(resumed, fsdp2[1])


@needs_deepspeed
def test_convert_torchtitan_layout_to_deepspeed_universal_resumes_zero1_on_the_uninterrupted_run(tmp_path):
    pytest.importorskip("transformers")
    spawn(fsdp2_run, 2, str(tmp_path / "step-2"), str(tmp_path / "run.pt"), 2, 4, "torchtitan")
    report = ckptkit.convert(tmp_path / "step-2", tmp_path / "ds", to="deepspeed-universal")
    assert report.notes == ("left out: train_state (a universal checkpoint holds the model and the optimizer; "
                            "gradient clipping and loss scaling come from the engine's config)",)
    groups = torch.load(tmp_path / "ds" / "global_step2" / "zero" / "optimizer_state.pt")["param_groups"]
    assert len(groups) == 1 and groups[0]["lr"] == 1e-2 and len(groups[0]["params"]) == 21
    resumed = _resumed(tmp_path / "ds", tmp_path, stage=1, world=1, first=3, last=4, kind="llama")
    _assert_on_the_uninterrupted_run(resumed, torch.load(tmp_path / "run.pt", weights_only=True), saved_at=2)


@needs_deepspeed
def test_convert_to_deepspeed_universal_writes_the_step3_state_as_torch_loads_it(fsdp2, universal, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(fsdp2[0], tmp_path / "step3.pt")
    saved = torch.load(tmp_path / "step3.pt", weights_only=True)
    out, report = universal
    assert (out / "latest_universal").read_text() == "global_step3"
    zero = out / "global_step3" / "zero"
    for name, weight in saved["model"].items():
        fp32 = torch.load(zero / name / "fp32.pt", weights_only=True)
        assert fp32.keys() == {"param", "cat_dim"} and torch.equal(fp32["param"], weight)
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.load(zero / name / f"{slot}.pt", weights_only=True)["param"],
                               saved["optim"]["state"][name][slot])
        step = torch.load(zero / name / "step.pt", weights_only=True)
        assert torch.equal(step, saved["optim"]["state"][name]["step"])
    groups = torch.load(zero / "optimizer_state.pt", weights_only=True)["param_groups"]
    assert groups == saved["optim"]["param_groups"]
    states = torch.load(out / "global_step3" / "mp_rank_00_model_states.pt", weights_only=True)
    assert (states["global_steps"], states["dp_world_size"], states["module"]) == (3, 2, {})
    assert report.notes == ()
    verified = CliRunner().invoke(cli, ["verify", str(fsdp2[0]), str(out)])
    assert verified.exit_code == 0 and verified.output.endswith("identical\n"), verified.output


@pytest.fixture(scope="module")
def ds_own(tmp_path_factory) -> tuple[Path, Path]:
    """A ZeRO-2 checkpoint DeepSpeed's engine saved on 2 ranks after 3 steps, and ds_to_universal's output of it."""
    out = tmp_path_factory.mktemp("ds-own")
    spawn(ds_save, 2, str(out / "ds"), 2, 3)
    uc = out / "ds" / "global_step3_universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(out / "ds" / "global_step3"), "--output_folder", str(uc), "--inject_missing_state"],
                   check=True, capture_output=True, env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})
    return out / "ds" / "global_step3", uc


def _names(uc: Path) -> list[str]:
    return sorted(p.name for p in (uc / "zero").iterdir() if p.is_dir())


@needs_deepspeed
def test_read_deepspeed_universal_of_ds_to_universal_gives_deepspeeds_own_tensors(ds_own, tmp_path):
    uc = ds_own[1]
    report = ckptkit.convert(uc, tmp_path / "full.pt", to="full")
    assert report.source_format.value == "deepspeed-universal"
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert list(full["model"]) == ["embed.weight", "fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight",
                                   "fc2.bias", "head.weight"] and sorted(full["model"]) == _names(uc)
    for name in _names(uc):
        assert torch.equal(full["model"][name], torch.load(uc / "zero" / name / "fp32.pt")["param"])
        for slot in ("exp_avg", "exp_avg_sq"):
            theirs = torch.load(uc / "zero" / name / f"{slot}.pt")["param"]
            assert torch.equal(full["optim"]["state"][name][slot], theirs)
        assert torch.equal(full["optim"]["state"][name]["step"], torch.load(uc / "zero" / name / "step.pt"))
    groups = torch.load(uc / "zero" / "optimizer_state.pt", weights_only=False)["param_groups"]
    assert full["optim"]["param_groups"] == [{**groups[0], "params": list(full["model"])}]


@needs_deepspeed
def test_load_deepspeed_universal_of_ds_to_universal_restores_a_torch_model_and_adamw(ds_own):
    uc = ds_own[1]
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    result = ckptkit.load(uc, model, optimizer=optimizer)
    assert result.optimizer_loaded and optimizer.param_groups[0]["lr"] == 1e-2
    state = optimizer.state_dict()["state"]
    for i, (name, param) in enumerate(model.named_parameters()):
        assert torch.equal(param.detach(), torch.load(uc / "zero" / name / "fp32.pt")["param"]), name
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][slot], torch.load(uc / "zero" / name / f"{slot}.pt")["param"]), name
        assert torch.equal(state[i]["step"], torch.load(uc / "zero" / name / "step.pt"))


@needs_deepspeed
def test_convert_deepspeed_zero_to_deepspeed_universal_writes_what_ds_to_universal_writes(ds_own, tmp_path):
    zero, uc = ds_own
    ckptkit.convert(zero, tmp_path / "ours", to="deepspeed-universal")
    ours = tmp_path / "ours" / "global_step3"
    assert _names(ours) == _names(uc)
    for name in _names(uc):
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            theirs = torch.load(uc / "zero" / name / f"{kind}.pt")
            mine = torch.load(ours / "zero" / name / f"{kind}.pt", weights_only=True)
            assert mine.keys() == theirs.keys() and mine["cat_dim"] == theirs["cat_dim"], (name, kind)
            assert torch.equal(mine["param"], theirs["param"]), (name, kind)
        assert torch.equal(torch.load(ours / "zero" / name / "step.pt"), torch.load(uc / "zero" / name / "step.pt"))
    theirs = torch.load(uc / "zero" / "optimizer_state.pt", weights_only=False)["param_groups"][0]
    mine = torch.load(ours / "zero" / "optimizer_state.pt", weights_only=True)["param_groups"][0]
    assert {**mine, "params": None} == {**theirs, "params": None}


def test_convert_to_deepspeed_universal_keeps_buffers_in_the_model_states_and_says_the_load_skips_them(tmp_path):
    weight, buffer = torch.randn(3, 2), torch.arange(4)
    state = {"step": torch.tensor(5.0), "exp_avg": torch.randn(3, 2), "exp_avg_sq": torch.rand(3, 2)}
    torch.save({"model": {"w": weight, "buf": buffer}, "optim": {"state": {"w": state},
                                                              "param_groups": [{"lr": 0.5, "params": ["w"]}]}},
               tmp_path / "src.pt")
    report = ckptkit.convert(tmp_path / "src.pt", tmp_path / "uc", to="deepspeed-universal")
    assert report.notes[0].startswith("1 model tensors without optimizer state (buffers, frozen or tied parameters: "
                                      "buf) kept in the model states' module, which DeepSpeed's universal load")
    tag = tmp_path / "uc" / "global_step5"
    states = torch.load(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=True)
    assert torch.equal(states["module"]["buf"], buffer) and states["global_steps"] == 5
    assert torch.load(tag / "zero" / "optimizer_state.pt", weights_only=True)["param_groups"] == [
        {"lr": 0.5, "params": ["w"]}]
    back = ckptkit.convert(tmp_path / "uc", tmp_path / "back.pt", to="full")
    assert back.source_format.value == "deepspeed-universal"
    full = torch.load(tmp_path / "back.pt", weights_only=True)
    assert torch.equal(full["model"]["w"], weight) and torch.equal(full["model"]["buf"], buffer)
    assert all(torch.equal(full["optim"]["state"]["w"][k], v) for k, v in state.items())


def test_convert_to_deepspeed_universal_refuses_a_checkpoint_without_optimizer_state(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "model.pt")
    with pytest.raises(UsageError, match="holds no optimizer state .* which a universal checkpoint carries"):
        ckptkit.convert(tmp_path / "model.pt", tmp_path / "uc", to="deepspeed-universal")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "model.pt"), str(tmp_path / "uc"), "--to",
                                      "deepspeed-universal"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert "holds no optimizer state" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "uc").exists()


def test_convert_to_deepspeed_universal_refuses_optimizer_state_numbered_by_torchs_own_state_dict(tmp_path):
    state = {"step": torch.tensor(1.0), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}
    torch.save({"model": {"w": torch.ones(2)}, "optim": {"state": {0: state}, "param_groups": [{"params": [0]}]}},
               tmp_path / "src.pt")
    with pytest.raises(IncompleteCheckpointError, match="optimizer state for '0' but no model tensor .* numbers"):
        ckptkit.convert(tmp_path / "src.pt", tmp_path / "uc", to="deepspeed-universal")


@pytest.mark.parametrize(("steps", "message"), [
    # The parameter whose step differs from the others' is named, wherever it sits.
    ((5.0, 5.0, 5.0, 5.0, 7.0), r"p4: optimizer step 7 where 4 parameters have step 5"),
    ((5.0, 2.5), r"p1: optimizer step 2.5 is not a whole number"),
])
def test_convert_to_deepspeed_universal_names_the_parameter_whose_step_differs(tmp_path, steps, message):
    from ckptkit.errors import FormatError

    names = [f"p{i}" for i in range(len(steps))]
    state = {n: {"step": torch.tensor(s), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}
             for n, s in zip(names, steps, strict=True)}
    torch.save({"model": {n: torch.ones(2) for n in names},
                "optim": {"state": state, "param_groups": [{"lr": 0.5, "params": names}]}}, tmp_path / "src.pt")
    with pytest.raises(FormatError, match=message):
        ckptkit.convert(tmp_path / "src.pt", tmp_path / "uc", to="deepspeed-universal")
    assert not (tmp_path / "uc").exists()

"""DeepSpeed's universal checkpoint, checked with torch's readers and DeepSpeed 0.19.8's own converter on CPU.

ckptkit writes a plain FSDP2 save (the resume matrix's) as a universal checkpoint, which must hold the save's
tensors as torch reads them; DeepSpeed's own ``ds_to_universal`` output, read by ckptkit, must hold DeepSpeed's
own tensors. Every framework's save resumed by DeepSpeed's engine from a universal checkpoint (ZeRO-2, and
ZeRO-3 for one) is a cell of the resume matrix (``test_resume_matrix.py``).
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
from _ds_universal import Net, ds_save
from _spawn import spawn
from ckptkit.cli import cli
from ckptkit.errors import IncompleteCheckpointError, UsageError

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (bin/_env installs deepspeed==0.19.8)")
@pytest.fixture(scope="module")
def universal(matrix_sources, tmp_path_factory) -> tuple[Path, Path, ckptkit.Report]:
    """The resume matrix's plain FSDP2 save (transformers' Llama, AdamW in two groups, step 3) and its universal
    checkpoint."""
    out = tmp_path_factory.mktemp("universal") / "ds"
    return matrix_sources / "fsdp2", out, ckptkit.convert(matrix_sources / "fsdp2", out, to="deepspeed-universal")


@needs_deepspeed
def test_convert_to_deepspeed_universal_writes_the_step3_state_as_torch_loads_it(universal, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, out, report = universal
    dcp_to_torch_save(src, tmp_path / "step3.pt")
    saved = torch.load(tmp_path / "step3.pt", weights_only=True)
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
    assert report.notes == ("2 param groups, whose first parameters are model.embed_tokens.weight, "
                            "model.layers.0.input_layernorm.weight: DeepSpeed's load gives their hyperparameters to "
                            "the engine's groups by position, so build those in this order; under ZeRO-3 its load "
                            "gives the first group's to every group and one step tensor to all, so set the others' "
                            "and copy the step after it",)
    verified = CliRunner().invoke(cli, ["verify", str(src), str(out)])
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

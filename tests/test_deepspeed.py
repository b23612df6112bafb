"""DEEPSPEED: ZeRO stage 1, 2 and 3 checkpoints, read as DeepSpeed's ``zero_to_fp32`` merges them, by byte ranges.

The checkpoints are laid out as DeepSpeed 0.19.8's engine saves them (``_deepspeed``, whose docstring names the
DeepSpeed source lines), from per-parameter fp32 masters and Adam moments: the test knows the answer before
ckptkit reads anything. ``_deepspeed.torch_zero_to_fp32`` repeats zero_to_fp32's merge with torch as a second
oracle. Results are read back with torch, safetensors and DCP's own loader, never with ckptkit.

``CKPTKIT_SAMPLES=/path/to/samples`` also checks checkpoints written by DeepSpeed's engine itself
(``<samples>/deepspeed/<case>/ckpt`` with ``expected_stageN.pt`` and ``gathered_stageN.pt``).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from _checks import assert_tensor_identical, data_pkl_flips, load_dcp, load_full, load_hf
from _deepspeed import Config, register_standins, replace_in, torch_zero_to_fp32, write_checkpoint
from ckptkit.cli import cli
from ckptkit.core.manifest import Format
from ckptkit.errors import CheckpointError, FormatError, IncompleteCheckpointError, UsageError
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.export import export_hf
from ckptkit.ops.inspect import inspect

CONFIGS = {
    "stage1-bf16-ws2": Config(1, 2),  # no frozen_param_* saved: frozen weights come from module
    "stage1-bf16-ws3-align": Config(1, 3, align=True),  # parameter_alignment: padding after each parameter
    "stage2-bf16-ws2-align": Config(2, 2, align=True),
    "stage2-fp32-ws3": Config(2, 3, bf16=False),  # no mixed precision: no bf16_ prefix
    "stage3-bf16-ws2": Config(3, 2),  # 0-element placeholders in the model files
    "stage3-fp32-ws3": Config(3, 3, bf16=False),  # 6-element biases: ranks hold 2, 2, 2; 7: 3, 3, 1
}
TAG = "global_step3"


@pytest.fixture(autouse=True)
def standins(monkeypatch):
    register_standins(monkeypatch)


@pytest.fixture(params=list(CONFIGS))
def ckpt(request, tmp_path):
    config = CONFIGS[request.param]
    truth = write_checkpoint(tmp_path / "ckpt", config)
    return tmp_path / "ckpt", config, truth


def test_deepspeed_convert_gives_zero_to_fp32s_weights_and_the_adam_moments(ckpt, tmp_path):
    root, config, truth = ckpt
    convert(root, tmp_path / "out.pt", to="full")
    got = load_full(tmp_path / "out.pt")
    want = truth.zero_to_fp32(config.stage)
    oracle = torch_zero_to_fp32(root / TAG)
    assert list(got["model"]) == list(want) == list(oracle)  # zero_to_fp32's order: buffers, frozen, trained, tied
    for k, v in want.items():
        assert_tensor_identical(got["model"][k], v, k)
        assert_tensor_identical(oracle[k], v, f"oracle {k}")
    state = got["optim"]["state"]
    for name in truth.fp32:
        assert_tensor_identical(state[name]["exp_avg"], truth.exp_avg[name], f"{name}.exp_avg")
        assert_tensor_identical(state[name]["exp_avg_sq"], truth.exp_avg_sq[name], f"{name}.exp_avg_sq")
        assert_tensor_identical(state[name]["step"], torch.tensor(3.0), f"{name}.step")
    assert [g["params"] for g in got["optim"]["param_groups"]] == truth.groups
    assert [g["weight_decay"] for g in got["optim"]["param_groups"]] == [0.01, 0.0]


def test_deepspeed_export_hf_and_reshard_to_dcp(ckpt, tmp_path):
    root, config, truth = ckpt
    want = truth.zero_to_fp32(config.stage)
    export_hf(root, tmp_path / "hf", dtype="bf16")
    got = load_hf(tmp_path / "hf")
    assert set(got) == set(want)
    for k, v in want.items():
        assert_tensor_identical(got[k], v.to(torch.bfloat16) if v.is_floating_point() else v, k)
    report = reshard(root / TAG, tmp_path / "dcp", world_size=2)  # the tag directory itself works too
    assert report.destination_format is Format.SHARDED
    dcp = load_dcp(tmp_path / "dcp", tmp_path / "dcp.pt")
    for k, v in want.items():
        assert_tensor_identical(dcp["model"][k], v, k)


@pytest.mark.parametrize("name", ["stage1-bf16-ws2", "stage2-fp32-ws3", "stage3-fp32-ws3"])
def test_deepspeed_resharded_resumes_a_torch_adam_through_ckptkit_load(tmp_path, name):
    import ckptkit
    from _deepspeed import Net

    truth = write_checkpoint(tmp_path / "ckpt", CONFIGS[name])
    reshard(tmp_path / "ckpt", tmp_path / "dcp", world_size=2)
    net = Net()
    groups = [[net.embed.weight, net.fc1.weight, net.fc2.weight],
              [net.gate, net.fc1.bias, net.norm.weight, net.norm.bias, net.fc2.bias]]
    optim = torch.optim.Adam([{"params": g} for g in groups], lr=1.0)
    ckptkit.load(tmp_path / "dcp", net, optimizer=optim)
    names = {id(p): n for n, p in net.named_parameters()}
    for n, p in net.named_parameters():
        want = truth.fp32.get(n, truth.frozen.get(n))
        assert_tensor_identical(p.detach(), want.float() if n in truth.frozen else want, n)
    for p in (p for g in groups for p in g):
        for k in ("exp_avg", "exp_avg_sq"):
            assert_tensor_identical(optim.state[p][k], getattr(truth, k)[names[id(p)]], f"{names[id(p)]}.{k}")
    assert [g["lr"] for g in optim.param_groups] == [0.01, 0.01]


@pytest.mark.parametrize("name", ["stage2-fp32-ws3", "stage3-bf16-ws2"])
def test_deepspeed_load_of_the_save_directory_follows_its_latest_and_returns_global_steps(tmp_path, name):
    import ckptkit
    from _deepspeed import Net

    truth = write_checkpoint(tmp_path / "ckpt", CONFIGS[name])
    net = Net()
    groups = [[net.embed.weight, net.fc1.weight, net.fc2.weight],
              [net.gate, net.fc1.bias, net.norm.weight, net.norm.bias, net.fc2.bias]]
    optim = torch.optim.Adam([{"params": g} for g in groups], lr=1.0)
    result = ckptkit.load(tmp_path / "ckpt", net, optimizer=optim)
    assert (result.path, result.step, result.optimizer_loaded) == (tmp_path / "ckpt" / TAG, 3, True)
    names = {id(p): n for n, p in net.named_parameters()}
    for p in (p for g in groups for p in g):
        assert_tensor_identical(optim.state[p]["exp_avg"], truth.exp_avg[names[id(p)]], names[id(p)])
    assert ckptkit.load(tmp_path / "ckpt" / TAG, Net(), strict=False).step == 3


def test_deepspeed_inspect_names_stage_ranks_and_ties(tmp_path):
    write_checkpoint(tmp_path / "ckpt", Config(3, 2))
    m = inspect(tmp_path / "ckpt")
    details = dict(m.details)
    assert (m.format, m.world_size) == (Format.DEEPSPEED, 2)
    assert (details["tag"], details["zero stage"], details["tied"]) == (TAG, "3", "head.weight = embed.weight")
    assert details["optimizer files"] == "bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    # embed.weight (91 elements) is 46 + 45 elements of the two ranks' fp32 partitions: whole rows, then a split row.
    assert {Path(c.span.file).name for c in m["model.embed.weight"].chunks} == {
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}


def test_deepspeed_one_file_or_a_root_without_latest_points_to_the_directory(tmp_path):
    root = tmp_path / "ckpt"
    write_checkpoint(root, Config(3, 2))
    model = root / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with pytest.raises(UsageError, match=f"one file of a DeepSpeed ZeRO checkpoint.*pass the directory {root}"):
        inspect(model)
    (tmp_path / "ckpt" / "latest").unlink()
    with pytest.raises(UsageError, match=f"no 'latest' file names the tag to read; pass one of its tag directories "
                       f"\\({TAG}\\)"):
        inspect(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest").write_text("../elsewhere")
    with pytest.raises(FormatError, match="expected a tag directory name"):
        inspect(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------------------ refusals


def test_deepspeed_zero3_model_files_without_optimizer_files_are_refused(tmp_path):
    """ZeRO-3 model files hold 0-element placeholders; they are never a model by themselves."""
    write_checkpoint(tmp_path / "ckpt", Config(3, 2))
    for f in (tmp_path / "ckpt" / TAG).glob("*_optim_states.pt"):
        f.unlink()
    result = CliRunner().invoke(cli, ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "ZeRO-3 model files without their *_optim_states.pt files" in result.output
    assert "0-element placeholders" in result.output
    assert not (tmp_path / "hf").exists()


def test_deepspeed_truncated_optimizer_file_fails_with_one_line(tmp_path):
    write_checkpoint(tmp_path / "ckpt", Config(2, 2))
    f = tmp_path / "ckpt" / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:-700])
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "sharded"])
    assert result.exit_code == 2 and result.output.startswith("ckptkit: error: ")
    assert result.output.count("\n") == 1 and f.name in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, match", [
    ("mp_rank_01_model_states.pt", "model-parallel ranks other than 00 .*tensor-parallel"),
    ("layer_01-model_00-model_states.pt", "pipeline-parallel layer files"),
    ("expp_rank_0_mp_rank_00_optim_states.pt", "mixture-of-experts files"),
    ("offloaded_tensors/", "NVMe"),
    ("zero/", "universal checkpoint"),
])
def test_deepspeed_layouts_zero_to_fp32_cannot_merge_are_refused(tmp_path, extra, match):
    write_checkpoint(tmp_path / "ckpt", Config(2, 2))
    target = tmp_path / "ckpt" / TAG / extra.rstrip("/")
    if extra.endswith("/"):
        target.mkdir()
    else:
        shutil.copy(tmp_path / "ckpt" / TAG / "mp_rank_00_model_states.pt", target)
    with pytest.raises(FormatError, match=match):
        inspect(tmp_path / "ckpt")


def test_deepspeed_refuses_stage0_bf16_and_quantized_fragments(tmp_path):
    write_checkpoint(tmp_path / "a", Config(2, 2))
    for f in (tmp_path / "a" / TAG).glob("*_optim_states.pt"):  # BF16_Optimizer (stage 0) saves no zero_stage
        replace_in(f, lambda s: s["optimizer_state_dict"].pop("zero_stage"))
    with pytest.raises(FormatError, match="no 'zero_stage' .* not a ZeRO optimizer"):
        inspect(tmp_path / "a")
    write_checkpoint(tmp_path / "b", Config(3, 2))
    for f in (tmp_path / "b" / TAG).glob("*_model_states.pt"):
        replace_in(f, lambda s: s["frozen_param_fragments"].update(
            {"frozen.bias": torch.zeros(3, dtype=torch.int8)}))
    with pytest.raises(FormatError, match=r"frozen_param_fragments\['frozen.bias'\] is int8: quantized"):
        inspect(tmp_path / "b")


def test_deepspeed_missing_ranks_and_tampered_counts_are_refused(tmp_path):
    write_checkpoint(tmp_path / "a", Config(2, 3, bf16=False))
    (tmp_path / "a" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"_optim_states.pt of ranks \[1\] are missing"):
        inspect(tmp_path / "a")
    write_checkpoint(tmp_path / "b", Config(2, 2))
    replace_in(tmp_path / "b" / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
               lambda s: s["optimizer_state_dict"].update(partition_count=[3, 3]))
    with pytest.raises(FormatError, match=r"partition_count \[3, 3\], but the tag holds 2 optimizer files"):
        inspect(tmp_path / "b")


def _shape_of_fc1(shape: tuple[int, ...], module_too: bool):
    def edit(state: dict) -> None:
        state["param_shapes"][0]["fc1.weight"] = torch.Size(shape)
        if module_too:  # a consistent lie in the model file: only the optimizer files' own mappings tell
            state["module"]["fc1.weight"] = state["module"]["fc1.weight"].flatten()[:math.prod(shape)].view(shape)
    return edit


@pytest.mark.parametrize("stage, shape, module_too, match", [
    (2, (11, 6), False, r"param_shapes\[0\] lay out 276 elements, but the ranks' fp32 partitions of group 0 hold 287"),
    (2, (7, 11), False, r"param_shapes gives 'fc1.weight' shape \[7, 11\], its module entry is \[11, 7\]"),
    (2, (76,), True, r"param_slice_mappings\[0\] of rank 1 disagree .* at fc1.weight, fc2.weight"),
    (3, (7, 11), False, "param_shapes differ from zero_pp_rank_0_mp_rank_00_model_states.pt's"),
])
def test_deepspeed_tampered_param_shapes_are_refused(tmp_path, stage, shape, module_too, match):
    write_checkpoint(tmp_path / "ckpt", Config(stage, 2))
    name = "zero_pp_rank_1_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    replace_in(tmp_path / "ckpt" / TAG / name, _shape_of_fc1(shape, module_too))
    with pytest.raises(FormatError, match=match):
        inspect(tmp_path / "ckpt")


def test_deepspeed_byte_flips_give_an_error_or_what_the_bytes_say(tmp_path):
    """Flip one byte at a time across the pickles of a model and an optimizer file: ckptkit refuses the
    checkpoint, or exports exactly what torch's reading of the same bytes merges to (where torch cannot read
    them at all, the untampered model)."""
    for stage, victim in ((2, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                          (3, "zero_pp_rank_0_mp_rank_00_model_states.pt")):
        root = tmp_path / f"stage{stage}"
        truth = write_checkpoint(root, Config(stage, 2))
        outcomes = {"refused": 0, "as torch reads it": 0, "untampered": 0}
        for pos in data_pkl_flips(root / TAG / victim, 31):
            out = tmp_path / f"out{stage}-{pos}.pt"
            try:
                convert(root, out, to="full")
            except CheckpointError:
                outcomes["refused"] += 1
                continue
            try:
                want = torch_zero_to_fp32(root / TAG)
                outcomes["as torch reads it"] += 1
            except Exception:
                want = truth.zero_to_fp32(stage)
                outcomes["untampered"] += 1
            got = load_full(out)["model"]
            assert set(got) == set(want), (stage, pos)
            for k, v in want.items():
                v = v.float() if got[k].dtype != v.dtype else v  # zero_to_fp32 casts floating buffers
                assert_tensor_identical(got[k], v, f"flip at {pos}: {k}")
        assert outcomes["refused"] and outcomes["as torch reads it"], outcomes


# -------------------------------------------------------------------------------- checkpoints DeepSpeed wrote


SAMPLES = os.environ.get("CKPTKIT_SAMPLES")


@pytest.mark.skipif(not SAMPLES, reason="set CKPTKIT_SAMPLES to a directory holding deepspeed/<case>/ckpt samples")
def test_deepspeed_samples_written_by_the_engine_itself(tmp_path):
    cases = sorted(p.parent for p in Path(SAMPLES or ".", "deepspeed").glob("*/ckpt"))
    assert cases
    for case in cases:
        (expected_file,) = case.glob("expected_stage*.pt")
        expected = load_full(expected_file)  # DeepSpeed's get_fp32_state_dict_from_zero_checkpoint
        gathered = load_full(Path(str(expected_file).replace("expected_", "gathered_")))  # the live engine's
        convert(case / "ckpt", tmp_path / f"{case.name}.pt", to="full")
        got = load_full(tmp_path / f"{case.name}.pt")
        assert [k for k in got["model"] if k in expected] == list(expected), case.name
        for k, v in expected.items():
            g = got["model"][k]
            # zero_to_fp32 casts floating buffers to fp32; ckptkit keeps the saved dtype.
            assert_tensor_identical(g.float() if g.dtype != v.dtype else g, v, f"{case.name}: {k}")
        for k in set(got["model"]) - set(expected):  # stage 1's frozen weights, which zero_to_fp32 leaves out
            assert_tensor_identical(got["model"][k], gathered["module"][k], f"{case.name}: {k}")
        for moment in ("exp_avg", "exp_avg_sq"):
            for name, v in gathered[moment].items():
                assert_tensor_identical(got["optim"]["state"][name][moment], v, f"{case.name}: {name}.{moment}")

"""The FSDP harness: configuration rules, the matrices, the checks, the command, and the quick matrix run on
real gloo ranks (what CI runs; about a minute on 2 cores)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from itertools import product

import pytest
import torch
from click.testing import CliRunner

from ckptkit.harness import runner
from ckptkit.harness.checks import BF16_RTOL, FP32_RTOL, compare_losses, compare_states, loss_rtol
from ckptkit.harness.cli import harness
from ckptkit.harness.configs import (
    AutoWrap,
    Cell,
    ConfigError,
    Format,
    ParamDtype,
    Sharding,
    TrainConfig,
    Wrapper,
    ddp,
    fsdp1,
    fsdp2,
    plain,
)
from ckptkit.harness.control import CONTROL_SHARE, Control
from ckptkit.harness.launch import run_ranks
from ckptkit.harness.matrix import QUICK, full, select

# --------------------------------------------------------------------------------------------------------
# Configurations and cells


@pytest.mark.parametrize("make, message", [
    # a plain model at 2 ranks would train two diverging copies
    (lambda: TrainConfig(wrapper=Wrapper.PLAIN, world_size=2), r"world_size must be 1, got 2; use ddp"),
    (lambda: TrainConfig(wrapper=Wrapper.DDP, world_size=0), r"world_size must be an int >= 1, got 0"),
    # FSDP1 options must be given for FSDP1 ...
    (lambda: TrainConfig(wrapper=Wrapper.FSDP1, world_size=2), r"fsdp1 needs sharding \(use fsdp1\(\.\.\.\)"),
    # ... which is said even where an FSDP2 option makes the layout 2-D as well
    (lambda: TrainConfig(wrapper=Wrapper.FSDP1, world_size=3, hsdp=True), r"fsdp1 needs sharding.*hsdp is an fsdp2"),
    # ... and only for it
    (lambda: TrainConfig(wrapper=Wrapper.DDP, world_size=2, sharding=Sharding.FULL_SHARD),
     r"sharding is an fsdp1 option, but wrapper is ddp"),
    (lambda: TrainConfig(wrapper=Wrapper.FSDP1, world_size=2, sharding=Sharding.FULL_SHARD, auto_wrap=AutoWrap.NONE,
                         use_orig_params=False, bf16=True), r"bf16 is an fsdp2 option, but wrapper is fsdp1"),
    (lambda: TrainConfig(wrapper=Wrapper.FSDP2, world_size=2, hsdp=False, bf16=True, cpu_offload=False,
                         reshard_after_forward=True, param_dtype=ParamDtype.BF16),
     r"param_dtype is an fsdp1 option, but wrapper is fsdp2"),
    # offloading belongs to both FSDPs
    (lambda: TrainConfig(wrapper=Wrapper.DDP, world_size=2, cpu_offload=True),
     r"cpu_offload is an fsdp1 or fsdp2 option, but wrapper is ddp"),
    (lambda: ddp(2, form=Format.LOCAL), r"form local is FSDP1's LOCAL_STATE_DICT, but wrapper is ddp"),
    (lambda: fsdp2(2, form=Format.LOCAL), r"form local is FSDP1's LOCAL_STATE_DICT, but wrapper is fsdp2"),
    # hybrid layouts are 2 x k
    (lambda: fsdp1(3, sharding=Sharding.HYBRID_SHARD),
     r"FSDP1 HYBRID_SHARD lays ranks out as 2 x k, so world_size must be even, got 3"),
    (lambda: fsdp2(5, hsdp=True), r"FSDP2 HSDP lays ranks out as 2 x k, so world_size must be even, got 5"),
    (lambda: fsdp1(4, sharding=Sharding.HYBRID_SHARD_ZERO2, form=Format.LOCAL),
     r"refuses LOCAL_STATE_DICT with a DeviceMesh"),
])
def test_train_config_rejects(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_train_config_names_and_meshes():
    assert plain().name == "plain@1:full"
    assert ddp(3, form=Format.SHARDED).name == "ddp@3:sharded"
    hybrid = fsdp1(4, sharding=Sharding.HYBRID_SHARD, use_orig_params=True)
    assert hybrid.name == "fsdp1(hybrid_shard,wrap=block,orig)@4:sharded"
    assert hybrid.mesh_shape == (2, 2)
    mixed = fsdp1(2, form=Format.LOCAL, use_orig_params=True, param_dtype=ParamDtype.FP16, cpu_offload=True)
    assert mixed.name == "fsdp1(full_shard,wrap=block,orig,fp16,offload)@2:local"
    hsdp = fsdp2(6, form=Format.FULL, hsdp=True, bf16=True, cpu_offload=True, reshard_after_forward=False)
    assert hsdp.name == "fsdp2(2d,bf16,offload,no-reshard)@6:full"
    assert hsdp.mesh_shape == (2, 3)
    assert fsdp2(3).mesh_shape == (3,)


@pytest.mark.parametrize("make, message", [
    (lambda: Cell(plain(form=Format.HF), fsdp2(2)), r"HF is a target form only"),
    # LOCAL output is re-laid from a LOCAL input with the same flat parameters
    (lambda: Cell(fsdp2(2), fsdp1(3, form=Format.LOCAL)), r"a LOCAL target needs a LOCAL source"),
    (lambda: Cell(fsdp1(2, form=Format.LOCAL), fsdp1(3, form=Format.LOCAL, auto_wrap=AutoWrap.SIZE)),
     r"same auto_wrap, use_orig_params and param_dtype"),
    # FSDP aligns flat parameters in the param dtype
    (lambda: Cell(fsdp1(2, form=Format.LOCAL, param_dtype=ParamDtype.BF16), fsdp1(3, form=Format.LOCAL)),
     r"same auto_wrap, use_orig_params and param_dtype"),
    (lambda: Cell(fsdp1(2, form=Format.LOCAL, sharding=Sharding.NO_SHARD),
                  fsdp1(3, form=Format.LOCAL, sharding=Sharding.NO_SHARD)), r"NO_SHARD ranks hold them whole"),
])
def test_cell_rejects(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize("cell, operation", [
    (Cell(fsdp2(2), fsdp2(3)), "reshard"),                                            # DCP to DCP
    (Cell(fsdp1(2, form=Format.LOCAL), fsdp1(3, form=Format.LOCAL)), "reshard"),          # LOCAL to LOCAL
    (Cell(fsdp1(2, form=Format.LOCAL), fsdp2(3)), "convert"),                           # LOCAL to DCP
    (Cell(fsdp2(2), ddp(3, form=Format.FULL)), "convert"),                              # DCP to torch.save
    (Cell(ddp(2), plain(form=Format.FULL)), "convert"),                                 # torch.save to torch.save
    (Cell(fsdp2(2), plain(form=Format.HF)), "export_hf"),
])
def test_cell_operation(cell, operation):
    assert cell.operation == operation


# --------------------------------------------------------------------------------------------------------
# Matrices


def test_full_matrix_covers_every_option_as_source_and_as_target():
    cells = full()
    assert len({c.name for c in cells}) == len(cells)
    sources, targets = {c.source for c in cells}, {c.target for c in cells}
    fsdp1_options = {(c.sharding, c.auto_wrap, c.use_orig_params, c.form) for c in sources
                     if c.wrapper is Wrapper.FSDP1}
    # 5 strategies x 3 wraps x 2 x 3 forms, less hybrid x LOCAL (torch refuses it)
    assert len(fsdp1_options) == 5 * 3 * 2 * 3 - 2 * 3 * 2
    fsdp2_options = {(c.hsdp, c.bf16, c.cpu_offload, c.reshard_after_forward, c.form) for c in sources
                     if c.wrapper is Wrapper.FSDP2}
    assert len(fsdp2_options) == 2 ** 4 * 2
    fsdp1_targets = {(c.sharding, c.auto_wrap, c.use_orig_params, c.form) for c in targets
                     if c.wrapper is Wrapper.FSDP1}
    # as targets HF joins the forms; LOCAL targets leave out hybrid and NO_SHARD
    assert len(fsdp1_targets) == 5 * 3 * 2 * 4 - 2 * 3 * 2 - 3 * 2
    fsdp2_targets = {(c.hsdp, c.bf16, c.cpu_offload, c.reshard_after_forward, c.form) for c in targets
                     if c.wrapper is Wrapper.FSDP2}
    assert len(fsdp2_targets) == 2 ** 4 * 3
    assert {(c.wrapper, c.form) for c in sources | targets} >= {(w, f) for w in (Wrapper.PLAIN, Wrapper.DDP)
                                                                 for f in (Format.FULL, Format.SHARDED)}


def test_full_matrix_covers_fsdp1_mixed_precision_and_offload():
    cells = full()
    mixed = (ParamDtype.BF16, ParamDtype.FP16)
    for side, forms in (("source", (Format.FULL, Format.SHARDED, Format.LOCAL)),
                        ("target", (Format.FULL, Format.SHARDED, Format.LOCAL, Format.HF))):
        configs = {getattr(c, side) for c in cells}
        # bf16 and fp16 under every wrap, both use_orig_params, in every form
        assert {(c.param_dtype, c.auto_wrap, c.use_orig_params, c.form) for c in configs
                if c.param_dtype in mixed} == set(product(mixed, AutoWrap, (False, True), forms))
        assert {(c.use_orig_params, c.form) for c in configs
                if c.wrapper is Wrapper.FSDP1 and c.cpu_offload} == set(product((False, True), forms))
    # LOCAL under mixed precision is re-laid N -> M with the same param dtype
    assert any(c.source.param_dtype is c.target.param_dtype is ParamDtype.FP16 and c.target.form is Format.LOCAL
               and c.source.world_size != c.target.world_size for c in cells)


def test_matrices_change_world_size_where_they_can():
    for cell in (*QUICK, *full()):
        one_rank = cell.source.world_size == cell.target.world_size == 1
        if not one_rank and cell.target.wrapper is not Wrapper.PLAIN:
            assert cell.source.world_size != cell.target.world_size, cell.name


def test_select_matches_anywhere_in_the_name():
    assert [c.name for c in select(QUICK, "fsdp1(hybrid*")] == [
        "fsdp1(hybrid_shard,wrap=block)@4:sharded -> fsdp2@3:sharded"]
    assert all(c.target.form is Format.HF for c in select(QUICK, ":hf"))
    assert select(QUICK, None) == QUICK
    assert select(QUICK, "no such cell") == ()


# --------------------------------------------------------------------------------------------------------
# Checks


def _state(**changes) -> dict:
    state = {"model": {"w": torch.tensor([1.0, -0.0, float("nan")]), "b": torch.arange(3)},
             "optim": {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
                       "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["w", "b"]}]},
             "step": 2}
    for path, value in changes.items():
        node = state
        *parents, last = path.split("__")
        for p in parents:
            node = node[int(p) if p.isdigit() else p]
        node[last] = value
    return state


def test_compare_states_identical_counts_tensors():
    check = compare_states(_state(), _state())
    assert check.ok and check.tensors == 4
    assert check.summary == "4 tensors bit-exact"


@pytest.mark.parametrize("change, message", [
    ({"model__w": torch.tensor([1.0, 0.0, float("nan")])}, r"model\.w: bits differ"),              # -0.0 became 0.0
    ({"model__w": torch.tensor([1.0, -0.0, float("nan")], dtype=torch.float64)},
     r"model\.w: dtype torch\.float32 vs torch\.float64"),
    ({"model__b": torch.arange(4)}, r"model\.b: shape \[3\] vs \[4\]"),
    ({"optim__param_groups__0__lr": 0.02}, r"optim\.param_groups\.0\.lr: 0\.01 vs 0\.02"),
    ({"step": 3}, r"step: 2 vs 3"),
    ({"optim__state__w__exp_avg": torch.full((3,), 1.5)}, r"exp_avg: bits differ \(max abs difference 0\.5\)"),
])
def test_compare_states_finds(change, message):
    check = compare_states(_state(), _state(**change))
    assert not check.ok
    assert any(re.search(message, p) for p in check.problems), check.problems


def test_compare_states_missing_and_extra_keys():
    actual = _state()
    actual["model"]["extra"] = actual["model"].pop("b")
    assert set(compare_states(_state(), actual).problems) == {"model.b: missing after load",
                                                            "model.extra: not in the saved state"}


def test_compare_states_tolerates_what_torch_loaders_change():
    # each wrapper orders a group's parameters its own way; torch's full-state loader makes tuples lists
    actual = _state(optim__param_groups__0__params=["b", "w"], optim__param_groups__0__betas=[0.9, 0.999])
    assert compare_states(_state(), actual).ok


def test_compare_states_model_only_ignores_optimizer_and_step():
    assert compare_states(_state(), _state(step=None, optim=None), model_only=True).ok


def test_compare_losses():
    assert compare_losses([3.0, 2.5], [3.0, 2.5], FP32_RTOL, first_step=2).summary == "2 losses bit-identical"
    close = compare_losses([3.0, 2.5], [3.0, 2.5 * (1 + 1e-7)], FP32_RTOL, first_step=2)
    assert close.ok and "within rtol 1e-05" in close.summary
    far = compare_losses([3.0, 2.5], [3.0, 2.6], FP32_RTOL, first_step=2)
    assert not far.ok and far.summary.startswith("loss at step 3: 2.600000, uninterrupted run 2.500000")
    assert not compare_losses([3.0], [math.nan], BF16_RTOL, first_step=2).ok
    assert not compare_losses([3.0, 2.0], [3.0], FP32_RTOL, first_step=2).ok


def test_loss_rtol_follows_precision():
    assert loss_rtol(Cell(fsdp2(2), fsdp2(3))) == FP32_RTOL
    assert loss_rtol(Cell(fsdp2(2, bf16=True), fsdp2(3))) == BF16_RTOL
    assert loss_rtol(Cell(fsdp2(2), fsdp1(3, form=Format.FULL, param_dtype=ParamDtype.FP16))) == BF16_RTOL
    assert loss_rtol(Cell(fsdp1(2, param_dtype=ParamDtype.FP32), fsdp2(3))) == FP32_RTOL


# --------------------------------------------------------------------------------------------------------
# The command


def _cli(*args: str):
    return CliRunner().invoke(harness, list(args))


def test_cli_lists_cells():
    result = _cli("--matrix", "quick", "--list", "--cells", ":hf")
    assert result.exit_code == 0
    assert result.output == "fsdp2@2:sharded -> plain@1:hf  [export_hf]\n"


def test_cli_only_picks_exact_names_from_either_matrix():
    quick, full_only = QUICK[0].name, "fsdp2(2d)@4:full -> plain@1:full"
    result = _cli("--only", full_only, "--only", quick, "--list")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"{full_only}  [convert]", f"{quick}  [reshard]"]
    unknown = _cli("--only", "a -> b", "--list")
    assert unknown.exit_code == 2 and "no quick or full cell is named 'a -> b'" in unknown.output


def test_cli_no_matching_cell_is_a_usage_error():
    result = _cli("--cells", "nothing like this")
    assert result.exit_code == 2
    assert "no quick cell matches --cells 'nothing like this'" in result.output


def test_cli_exits_1_when_a_cell_fails(monkeypatch):
    def fake_run_cells(cells, **options):  # the HF cell passes, the other fails
        return [runner.CellResult(c, runner.Status.PASS, "22 tensors bit-exact") if c.operation == "export_hf" else
                runner.CellResult(c, runner.Status.FAIL, "ckptkit reshard: boom", "boom\ntraceback") for c in cells]

    monkeypatch.setattr(runner, "run_cells", fake_run_cells)
    pattern = "fsdp2@2:sharded -> [pf]*[3h]"  # fsdp2@3:sharded and plain@1:hf
    result = _cli("--cells", pattern)
    assert result.exit_code == 1
    assert re.search(r"\n2  fsdp2@2:sharded -> plain@1:hf +export_hf +pass +22 tensors bit-exact\n", result.output)
    assert re.search(r"\n1  fsdp2@2:sharded -> fsdp2@3:sharded +reshard +FAIL +ckptkit reshard: boom\n", result.output)
    assert "1 passed, 1 failed, 0 torch, 0 skipped" in result.output
    as_json = json.loads(_cli("--cells", pattern, "--json").stdout)
    assert as_json["counts"] == {"pass": 1, "FAIL": 1, "torch": 0, "skip": 0}
    assert as_json["cells"][0] == {"cell": "fsdp2@2:sharded -> fsdp2@3:sharded", "source": "fsdp2@2:sharded",
                                   "target": "fsdp2@3:sharded", "operation": "reshard", "status": "FAIL",
                                   "reason": "ckptkit reshard: boom", "detail": "boom\ntraceback", "control": None}


def test_cli_exits_0_and_lists_cells_whose_drift_torch_shows_alone(monkeypatch):
    control = Control(cell_drift=3.3e-3, drift=3.1e-3, own_drift=3.2e-3, rtol=FP32_RTOL, state="9 tensors bit-exact",
                      torch_version="9.9.9")

    def fake_run_cells(cells, **options):
        return [runner.CellResult(c, runner.Status.TORCH, "drifts", control=control) for c in cells]

    monkeypatch.setattr(runner, "run_cells", fake_run_cells)
    result = _cli("--cells", "fsdp2@2:sharded -> fsdp2@3")
    assert result.exit_code == 0, result.output
    assert ("fsdp2@2:sharded -> fsdp2@3:sharded: cell 3.3e-03, torch-only control 3.1e-03 (its own uninterrupted "
            "run 3.2e-03; torch 9.9.9)") in result.output
    assert "0 passed, 0 failed, 1 torch, 0 skipped" in result.output
    as_json = json.loads(_cli("--cells", "fsdp2@2:sharded -> fsdp2@3", "--json").stdout)
    assert as_json["counts"]["torch"] == 1 and as_json["torch"] == ["fsdp2@2:sharded -> fsdp2@3:sharded"]
    assert as_json["cells"][0]["control"] == {"cell_drift": 3.3e-3, "drift": 3.1e-3, "own_drift": 3.2e-3,
                                              "rtol": FP32_RTOL, "state": "9 tensors bit-exact", "torch": "9.9.9",
                                              "blames_torch": True}


def test_fsdp1_offload_is_skipped_with_torchs_reason_where_pinning_is_refused():
    offload = Cell(fsdp1(2, cpu_offload=True), fsdp2(3))
    reason = runner._skip_reason(offload, "Cannot access accelerator device when none is available.")
    assert reason is not None and reason.startswith("FSDP1 CPUOffload(offload_params=True) pins the offloaded shards")
    assert reason.endswith("which torch refuses here: Cannot access accelerator device when none is available.")
    assert runner._skip_reason(offload, None) is None  # where torch pins (beside a GPU), the cell runs
    assert runner._skip_reason(Cell(fsdp2(2, cpu_offload=True), fsdp2(3)), "refused") is None  # FSDP2 pins nothing here
    if not torch.cuda.is_available():
        assert runner._pinning_refused() == "Cannot access accelerator device when none is available."


def test_backend_is_nccl_only_where_every_rank_has_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [runner._backend("cuda", world) for world in (1, 2, 3)] == ["nccl", "nccl", "gloo"]
    assert runner._backend("cpu", 1) == "gloo"


# --------------------------------------------------------------------------------------------------------
# Runs on real ranks


def _rank_failing_on_bad_jobs(rank: int, world: int, jobs, device: str) -> None:
    for job in jobs:
        if job.directory.endswith("bad"):
            raise ValueError("this job fails on purpose")
        runner._record_outcome(job, {"losses": [float(len(job.directory))]})


def _segfault(rank: int, world: int) -> None:
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # a read at address 0: SIGSEGV, as a native crash in a collective gives
    torch.distributed.barrier()


def test_run_ranks_reports_where_a_rank_died_of_a_signal():
    with pytest.raises(RuntimeError) as raised:
        run_ranks(_segfault, 2, deadline=120)
    message = str(raised.value)
    assert message.startswith("rank 1 of 2 died: process 1 terminated with signal SIGSEGV"), message
    assert "rank 1 (faulthandler):\nFatal Python error: Segmentation fault" in message
    assert re.search(r'line \d+ in _segfault', message), message


def test_run_jobs_pins_a_failure_on_its_job_and_runs_the_rest(tmp_path):
    jobs = []
    for name in ("first", "bad", "last"):
        (tmp_path / name).mkdir()
        jobs.append(runner._Job(plain(), str(tmp_path / name)))
    results = runner._run_jobs(_rank_failing_on_bad_jobs, jobs, "cpu", say=lambda line: None)
    assert results[jobs[0]] == {"losses": [float(len(jobs[0].directory))]}
    assert "ValueError: this job fails on purpose" in str(results[jobs[1]])
    assert results[jobs[2]] == {"losses": [float(len(jobs[2].directory))]}


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    return {r.cell.name: r for r in runner.run_cells(QUICK, workdir=tmp_path_factory.mktemp("harness"))}


@pytest.mark.parametrize("cell", QUICK, ids=[c.name for c in QUICK])
def test_quick_matrix_cell_passes(quick_results, cell):
    result = quick_results[cell.name]
    # A cell skips only where torch itself refuses what it needs: FSDP1 CPU offload pins memory, which torch
    # refuses without an accelerator. Every other skip, and that one beside a GPU, is a failure.
    refused = runner._pinning_refused()
    expected = runner._skip_reason(cell, refused)
    if expected is None:
        assert result.status is runner.Status.PASS, f"{result.status.value}: {result.reason}\n{result.detail}"
    else:
        assert (result.status, result.reason) == (runner.Status.SKIP, expected)


def test_skip_reason_fsdp2_on_more_ranks_than_gpus_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    reason = runner._skip_reason(Cell(fsdp1(2, form=Format.FULL), fsdp2(3)), None, "cuda")
    assert reason == ("FSDP2 on 3 ranks needs a GPU per rank (NCCL); this machine has 1, and FSDP2 ranks sharing "
                      "GPUs over gloo die with SIGSEGV (CKPTKIT_HARNESS_STAGE_FSDP2=1 tries them with CPU-staged "
                      "collectives)")
    assert runner._skip_reason(Cell(fsdp1(2), fsdp1(3)), None, "cuda") is None  # FSDP1 ranks share GPUs fine
    assert runner._skip_reason(Cell(fsdp2(1), fsdp2(1)), None, "cuda") is None
    assert runner._skip_reason(Cell(fsdp2(2), fsdp2(3)), None, "cpu") is None


# --------------------------------------------------------------------------------------------------------
# Torch-only controls


def _control(drift: float, cell_drift: float = 1e-3) -> Control:
    return Control(cell_drift=cell_drift, drift=drift, own_drift=drift, rtol=FP32_RTOL, state="ok")


@pytest.mark.parametrize("control, state_ok, status", [
    (_control(1e-3), True, runner.Status.TORCH),                       # torch alone drifts as much
    (_control(CONTROL_SHARE * 1e-3), True, runner.Status.TORCH),       # half as much still counts
    (_control(0.4e-3), True, runner.Status.FAIL),                      # torch drifts, ckptkit adds more
    (_control(0.0), True, runner.Status.FAIL),                         # torch resumes exactly: ckptkit's drift
    (_control(FP32_RTOL / 2, cell_drift=FP32_RTOL), True, runner.Status.FAIL),  # within rtol is no drift
    (_control(1e-3), False, runner.Status.FAIL),                       # bytes differ: ckptkit's whatever torch does
    (RuntimeError("rank 0 died"), True, runner.Status.FAIL),           # no control, no excuse
])
def test_with_control_blames_torch_only_where_bytes_are_exact_and_the_control_drifts_as_much(control, state_ok,
                                                                                             status):
    cell = Cell(fsdp2(2), fsdp2(3))
    verdict = runner._Verdict(runner.CellResult(cell, runner.Status.FAIL, "losses drift"), 1e-3, state_ok)
    result = runner._with_control(verdict, control)
    assert result.status is status
    if isinstance(control, Control):
        assert result.control is control and f"torch {control.torch_version}" in result.reason
    else:
        assert result.reason.endswith("torch-only control failed: rank 0 died")


def _corrupt_moments(path) -> None:
    """Zero every AdamW first moment of a converted torch.save file: bytes a loader takes without complaint."""
    state = torch.load(path, weights_only=True)
    for slots in state["optim"]["state"].values():
        slots["exp_avg"].zero_()
    torch.save(state, path)


PERTURBED = Cell(plain(), dataclasses.replace(plain(), perturb_resume=True))
CORRUPTED = Cell(plain(), plain())


@pytest.fixture(scope="module")
def control_results(tmp_path_factory):
    convert = runner._convert

    def corrupting_convert(cell, src, dst, assets):
        finding = convert(cell, src, dst, assets)
        if cell == CORRUPTED:
            _corrupt_moments(dst)
        return finding

    with pytest.MonkeyPatch.context() as patch:  # the conversion runs in this process; the ranks are spawned
        patch.setattr(runner, "_convert", corrupting_convert)
        results = runner.run_cells((PERTURBED, CORRUPTED), workdir=tmp_path_factory.mktemp("controls"))
    return dict(zip((PERTURBED, CORRUPTED), results, strict=True))


def test_run_cells_calls_a_drift_in_the_target_configurations_own_training_torchs(control_results):
    result = control_results[PERTURBED]
    assert result.status is runner.Status.TORCH, f"{result.reason}\n{result.detail}"
    control = result.control
    assert control is not None and control.blames_torch and control.torch_version == torch.__version__
    # torch's own save and load restored every byte; the drift is all in the resumed run
    assert re.fullmatch(r"\d+ tensors bit-exact", control.state)
    assert control.drift > FP32_RTOL and control.drift >= CONTROL_SHARE * control.cell_drift
    assert f"torch-only control (torch {torch.__version__}, no ckptkit)" in result.reason


def test_run_cells_fails_a_corrupted_conversion_whose_control_resumes_exactly(control_results):
    result = control_results[CORRUPTED]
    assert result.status is runner.Status.FAIL
    assert "exp_avg: bits differ" in result.reason
    control = result.control
    assert control is not None and not control.blames_torch
    assert control.drift <= FP32_RTOL < control.cell_drift and control.own_drift == 0.0


def _staged_losses(rank: int, world: int) -> list[list[float]]:
    """Three steps of FSDP2 at ``world`` ranks with torch's collectives, then with the CPU-staged ones."""
    from ckptkit.harness import training
    from ckptkit.harness.staged import stage_collectives

    losses = []
    for staged in (False, True):
        model, optimizer = training.build(fsdp2(world), torch.device("cpu"))
        if staged:
            stage_collectives(model)
        losses.append(training.train(model, optimizer, start=0, steps=3, device=torch.device("cpu")))
    return losses


def test_cpu_staged_fsdp2_collectives_train_bit_for_bit_as_torchs():
    default, staged = run_ranks(_staged_losses, 2)[0]
    assert staged == default


def test_skip_reason_lets_fsdp2_share_gpus_when_staging_is_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CKPTKIT_HARNESS_STAGE_FSDP2", "1")
    assert runner._skip_reason(Cell(fsdp1(2, form=Format.FULL), fsdp2(3)), None, "cuda") is None

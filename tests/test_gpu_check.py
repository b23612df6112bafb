"""``bin/gpu-check`` where there is no GPU: its steps, its one-line refusal, and its report, rehearsed on CPU."""

from __future__ import annotations

import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bin" / "gpu_check.py"


def _gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_lists_its_steps():
    result = _gpu_check("--list", "--steps", "full,tests", "--cells", "fsdp1(*")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["full", "tests"]
    assert lines[0].endswith("-m ckptkit.cli harness --device cuda --json --no-controls --cells fsdp1(* --matrix full")
    assert lines[1].endswith(f"-m pytest -m cuda -q -rA -p no:cacheprovider {SCRIPT.parent.parent / 'tests'}")


def test_gpu_check_refuses_unknown_steps():
    result = _gpu_check("--steps", "quick,nope")
    assert result.returncode == 2
    assert "--steps 'quick,nope': expected some of quick, full, bench, tests, control" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_check_without_cuda_fails_fast_in_one_line(tmp_path):
    result = _gpu_check("--out", str(tmp_path / "report.md"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"gpu-check: error: torch {torch.__version__} sees no "
                                                             "CUDA device here")
    assert "Traceback" not in result.stderr and not (tmp_path / "report.md").exists()


def test_gpu_check_rehearsal_on_cpu_writes_one_report(tmp_path):
    # The one-rank FSDP1 offload cell: skipped on a CPU-only torch, so no ranks start.
    report = tmp_path / "report.md"
    result = _gpu_check("--device", "cpu", "--steps", "quick", "--control", "--cells", "offload)@1:sharded",
                        "--out", str(report))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"gpu-check: PASS; report: {report}"
    text = report.read_text()
    assert text.startswith("# ckptkit gpu-check\n")
    assert f"torch {torch.__version__}" in text and "device: cpu (a rehearsal" in text and "- result: PASS" in text
    assert "## 1. harness, quick matrix" in text
    assert "--device cpu --json --no-controls --cells offload)@1:sharded" in text
    assert "## 2. torch-only controls for the failed cells\n\nno harness cell failed: no control to run\n" in text
    if not torch.cuda.is_available():
        assert "0 passed, 0 failed, 0 torch, 1 skipped" in text
        assert "| skip | FSDP1 CPUOffload(offload_params=True) pins the offloaded shards" in text


def test_gpu_check_report_names_failed_steps_and_failing_cells():
    gpu_check = _module()
    harness_json = ('{"seconds": 3.0, "counts": {"pass": 1, "FAIL": 1, "skip": 0}, "cells": ['
                    '{"cell": "a -> b", "operation": "convert", "status": "pass", '
                    '"reason": "9 tensors bit-exact; 3 losses within rtol 1e-05 (max rel diff 2.0e-07)", "detail": ""},'
                    '{"cell": "fsdp1(bf16)@2:local -> c", "operation": "reshard", "status": "FAIL", '
                    '"reason": "target run failed: boom", "detail": "Traceback: boom"}]}')
    steps = [gpu_check.StepResult("full", "harness, full matrix", [sys.executable, "-m", "x"], 1, 5.0, harness_json,
                                  ""),
             gpu_check.StepResult("bench", "bin/bench", ["bench.py"], 0, 2.0, "the bench table\n", "")]
    text = gpu_check.render("cuda", ["GPUs: 1 x Some GPU"], steps, datetime.datetime(2026, 1, 2, 3, 4))
    assert "- date: 2026-01-02 03:04 UTC\n- GPUs: 1 x Some GPU\n- result: FAIL (full)" in text
    assert "1 passed, 1 failed, 0 torch, 0 skipped in 3.0 s." in text
    assert "largest relative loss difference: fp32 2e-07, bf16/fp16 0." in text
    assert "| 2 | `fsdp1(bf16)@2:local -> c` | reshard | FAIL | target run failed: boom |" in text
    assert "<details><summary>fsdp1(bf16)@2:local -> c</summary>" in text and "Traceback: boom" in text
    assert "## 2. bin/bench\n\n`bench.py`: exit 0 in 2 s\n\n```text\nthe bench table\n```" in text


def _harness_json(*cells: tuple[str, str], control: dict | None = None) -> str:
    counts = {s: sum(status == s for _, status in cells) for s in ("pass", "FAIL", "torch", "skip")}
    return json.dumps({"seconds": 1.0, "counts": counts, "cells": [
        {"cell": name, "operation": "convert", "status": status, "reason": "r", "detail": "",
         "control": control if status in ("torch", "FAIL") else None} for name, status in cells]})


def test_gpu_check_control_step_reruns_the_failed_cells_of_both_matrices(monkeypatch):
    gpu_check = _module()
    quick = gpu_check.StepResult("quick", "q", ["x"], 1, 1.0, _harness_json(("a -> b", "FAIL"), ("c -> d", "pass")), "")
    full = gpu_check.StepResult("full", "f", ["x"], 1, 1.0, _harness_json(("a -> b", "FAIL"), ("e -> f", "FAIL")), "")
    assert gpu_check.failed_cells([quick, full]) == ["a -> b", "e -> f"]
    ran = []
    monkeypatch.setattr(gpu_check, "_run", lambda name, title, command: ran.append(command) or
                        gpu_check.StepResult(name, title, command, 0, 2.0, "{}", ""))
    gpu_check._control("cuda", [quick, full])
    assert ran[0][3:] == ["harness", "--device", "cuda", "--json", "--only", "a -> b", "--only", "e -> f"]
    nothing = gpu_check._control("cuda", [gpu_check.StepResult("quick", "q", ["x"], 0, 1.0,
                                                                _harness_json(("c -> d", "pass")), "")])
    assert (nothing.command, nothing.returncode, len(ran)) == ([], 0, 1)


def test_gpu_check_report_gives_the_failures_and_their_controls():
    gpu_check = _module()
    control = {"cell_drift": 3.3e-3, "drift": 3.2e-3, "own_drift": 3.1e-3, "rtol": 1e-5,
               "state": "82 tensors bit-exact", "torch": "2.11.0+cu130", "blames_torch": True}
    quick = gpu_check.StepResult("quick", "harness, quick matrix", ["q"], 1, 40.0,
                                 _harness_json(("a -> b", "FAIL"), ("c -> d", "pass")), "")
    control_step = gpu_check.StepResult("control", "torch-only controls for the failed cells", ["c"], 0, 20.0,
                                        _harness_json(("a -> b", "torch"), control=control), "")
    text = gpu_check.render("cuda", [], [quick, control_step], datetime.datetime(2026, 1, 2, 3, 4))
    assert "- result: PASS\n- torch's own drift, not ckptkit's: the failed cells of quick (see the controls)" in text
    assert "- steps took 60 s in all" in text
    assert "## 1. harness, quick matrix" in text and "| 1 | `a -> b` | convert | FAIL | r |" in text
    assert "## 2. torch-only controls for the failed cells" in text and "0 passed, 0 failed, 1 torch, 0 skipped" in text
    assert ("- `a -> b`: torch: cell drift 3.3e-03, torch-only control 3.2e-03 (from its own uninterrupted run "
            "3.1e-03), torch 2.11.0+cu130") in text
    still = gpu_check.StepResult("control", "c", ["c"], 1, 20.0, _harness_json(("a -> b", "FAIL"), control=control), "")
    assert "- result: FAIL (quick, control)" in gpu_check.render("cuda", [], [quick, still],
                                                                 datetime.datetime(2026, 1, 2, 3, 4))

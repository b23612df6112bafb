"""``bin/gpu-check``: everything that proves ckptkit's CUDA path, in one command and one report file.

Steps, in order (``--steps`` picks some):
1. ``quick``: the harness's quick matrix on CUDA ranks (``ckptkit harness --device cuda``);
2. ``full``: the full matrix on CUDA ranks: NCCL where every rank has a GPU of its own, gloo ranks holding
   CUDA tensors where a cell needs more ranks than there are GPUs;
3. ``bench``: ``bin/bench`` (the byte path; it needs no GPU, but its figures belong to the same machine);
4. ``tests``: the test suite's ``cuda``-marked tests;
5. ``control`` (also ``--control``): the cells that failed in ``quick`` or ``full`` run again, each with a
   torch-only control (``ckptkit harness --only NAME ...``): ``torch`` where torch resuming the target
   configuration from its own checkpoint drifts as much, ``FAIL`` where it does not. Nothing runs when
   nothing failed.

``quick`` and ``full`` run without controls (``--no-controls``), so that their time does not depend on how
many cells fail; the report gives their tables and the control step's. A harness step whose every failed
cell the control step calls ``torch`` does not fail the check.

Each step runs as its own process; its progress goes to stderr as it runs. The report (Markdown) names the
machine, the GPUs, the versions, and each step's command, exit status, time and results; its path is printed
at the end. Exit status: 0 every step passed, 1 a step failed, 2 no CUDA device (or bad usage).
``--device cpu`` rehearses the same steps on CPU ranks, so the command and its report can be checked on a
machine without a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("quick", "full", "bench", "tests", "control")
HARNESS_STEPS = ("quick", "full")
_LOSS = re.compile(r"max rel diff ([0-9.e+-]+)")


@dataclass(frozen=True)
class StepResult:
    name: str
    title: str
    command: list[str]
    returncode: int
    seconds: float
    stdout: str
    stderr: str


def _commands(device: str, cells: str | None, bench_size: str) -> dict[str, tuple[str, list[str]]]:
    """Each step's title and command line."""
    harness = [*_harness(device), "--no-controls"] + (["--cells", cells] if cells else [])
    return {
        "quick": ("harness, quick matrix", [*harness, "--matrix", "quick"]),
        "full": ("harness, full matrix", [*harness, "--matrix", "full"]),
        "control": ("torch-only controls for the failed cells", [*_harness(device), "--only", "<each failed cell>"]),
        "bench": ("bin/bench", [sys.executable, str(ROOT / "bin" / "benchkit"), "convert", "--size", bench_size]),
        "tests": ("tests marked cuda", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rA",
                                        "-p", "no:cacheprovider", str(ROOT / "tests")]),
    }


def _harness(device: str) -> list[str]:
    return [sys.executable, "-m", "ckptkit.cli", "harness", "--device", device, "--json"]


def failed_cells(results: list[StepResult]) -> list[str]:
    """The names of the cells that failed in the harness steps, in order, once each."""
    names: list[str] = []
    for r in results:
        if r.name in HARNESS_STEPS:
            with contextlib.suppress(ValueError):
                names += [c["cell"] for c in json.loads(r.stdout)["cells"] if c["status"] == "FAIL"]
    return list(dict.fromkeys(names))


def _control(device: str, results: list[StepResult]) -> StepResult:
    """Re-run the failed cells with their torch-only controls; a no-op step where nothing failed."""
    title = "torch-only controls for the failed cells"
    names = failed_cells(results)
    if not names:
        return StepResult("control", title, [], 0, 0.0, "", "no harness cell failed: no control to run\n")
    return _run("control", title, [*_harness(device), *(a for n in names for a in ("--only", n))])


def explained(results: list[StepResult]) -> set[str]:
    """Harness steps whose every failed cell the control step calls ``torch`` (it exited 0 on all of them)."""
    control = next((r for r in results if r.name == "control"), None)
    if control is None or control.returncode != 0 or not control.command:
        return set()
    return {r.name for r in results if r.name in HARNESS_STEPS and r.returncode == 1}


def _run(name: str, title: str, command: list[str]) -> StepResult:
    """Run one step: stdout is kept for the report; stderr is echoed as it comes (progress) and kept too."""
    click.echo(f"gpu-check: [{name}] {' '.join(command)}", err=True)
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_lines: list[str] = []

    def pump() -> None:
        for line in proc.stderr or ():
            err_lines.append(line)
            sys.stderr.write(f"  {line}")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    stdout = proc.stdout.read() if proc.stdout else ""
    proc.wait()
    reader.join()
    seconds = time.perf_counter() - start
    click.echo(f"gpu-check: [{name}] exit {proc.returncode} in {seconds:.0f} s", err=True)
    return StepResult(name, title, command, proc.returncode, seconds, stdout, "".join(err_lines))


def _machine(device: str) -> list[str]:
    import torch

    lines = [f"host: {platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"GPUs: {len(names)} x {', '.join(sorted(set(names)))}")
    lines.append(f"device: {device}" + ("" if device == "cuda" else " (a rehearsal: ranks compute on the CPU)"))
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if commit.returncode == 0:
        lines.append(f"ckptkit commit {commit.stdout.strip()}")
    return lines


def _harness_section(step: StepResult) -> list[str]:
    """Counts, loss figures and the cell table from ``ckptkit harness --json``."""
    try:
        doc = json.loads(step.stdout)
    except ValueError:
        return ["The harness gave no JSON; the end of its output:", "", "```text", step.stderr[-4000:], "```"]
    counts, cells = doc["counts"], doc["cells"]
    out = [f"{counts['pass']} passed, {counts['FAIL']} failed, {counts.get('torch', 0)} torch, {counts['skip']} "
           f"skipped in {doc['seconds']} s."]
    for c in cells:
        if (control := c.get("control")) is not None:
            out.append(f"- `{c['cell']}`: {c['status']}: cell drift {control['cell_drift']:.1e}, torch-only control "
                       f"{control['drift']:.1e} (from its own uninterrupted run {control['own_drift']:.1e}), "
                       f"torch {control['torch']}")
    identical = sum("losses bit-identical" in c["reason"] for c in cells)
    diffs: dict[bool, list[float]] = {False: [], True: []}
    for c in cells:
        if c["status"] == "pass" and (m := _LOSS.search(c["reason"])):
            diffs[bool(re.search(r"bf16|fp16", c["cell"]))].append(float(m.group(1)))
    out.append(f"Cells with bit-identical losses: {identical}; largest relative loss difference: fp32 "
               f"{max(diffs[False], default=0):.2g}, bf16/fp16 {max(diffs[True], default=0):.2g}.")
    out += ["", "| # | source -> target | ckptkit | result | reason |", "|---|---|---|---|---|"]
    out += [f"| {i} | `{c['cell']}` | {c['operation']} | {c['status']} | {c['reason'].replace('|', '/')} |"
            for i, c in enumerate(cells, 1)]
    failed = [c for c in cells if c["status"] == "FAIL"]
    for c in failed:
        out += ["", f"<details><summary>{c['cell']}</summary>", "", "```text", c["detail"][-6000:], "```",
                "</details>"]
    return out


def failed_steps(results: list[StepResult]) -> list[str]:
    """Steps that failed, less the harness steps whose failures the control step put down to torch."""
    excused = explained(results)
    return [r.name for r in results if r.returncode != 0 and r.name not in excused]


def render(device: str, machine: list[str], results: list[StepResult], started: datetime.datetime) -> str:
    failed = failed_steps(results)
    excused = sorted(explained(results))
    lines = ["# ckptkit gpu-check", "", f"- date: {started:%Y-%m-%d %H:%M} UTC"]
    lines += [f"- {m}" for m in machine]
    lines += [f"- result: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}"]
    lines += [f"- torch's own drift, not ckptkit's: the failed cells of {', '.join(excused)} (see the controls)"
              ] if excused else []
    lines += [f"- steps took {sum(r.seconds for r in results):.0f} s in all", ""]
    for n, r in enumerate(results, 1):
        shown = [Path(a).name if a == sys.executable else a for a in r.command]
        if not r.command:  # a step with nothing to run
            lines += [f"## {n}. {r.title}", "", r.stderr.strip(), ""]
            continue
        lines += [f"## {n}. {r.title}", "", f"`{' '.join(shown)}`: exit {r.returncode} in {r.seconds:.0f} s", ""]
        if r.name in (*HARNESS_STEPS, "control"):
            lines += _harness_section(r)
        else:
            text = r.stdout if r.name == "bench" and r.returncode == 0 else (r.stdout + r.stderr)
            lines += ["```text", text.strip()[-12000:], "```"]
        lines.append("")
    return "\n".join(lines)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="The report file (default: gpu-check-<UTC time>.md in the current directory).")
@click.option("--steps", default=",".join(STEPS), show_default=True,
              help="Which steps to run, comma-separated, in the order above.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu rehearses the same steps without a GPU.")
@click.option("--cells", default=None, metavar="PATTERN", help="Only harness cells matching this pattern.")
@click.option("--bench-size", default="2GB", show_default=True, help="bin/bench convert --size.")
@click.option("--control", "add_control", is_flag=True,
              help="Add the control step to --steps: re-run the failed harness cells with torch-only controls.")
@click.option("--list", "list_only", is_flag=True, help="Print the steps' commands and exit.")
def main(out_path: Path | None, steps: str, device: str, cells: str | None, bench_size: str, add_control: bool,
         list_only: bool) -> None:
    """Run the CUDA quick and full harness matrices, bin/bench and the cuda-marked tests, then torch-only
    controls for the cells that failed; write one report."""
    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STEPS]
    if unknown or not chosen:
        raise click.UsageError(f"--steps {steps!r}: expected some of {', '.join(STEPS)}")
    if add_control and "control" not in chosen:
        chosen.append("control")
    # The controls re-run what the harness steps found, so they come after them whatever the order given.
    chosen = [s for s in chosen if s != "control"] + (["control"] if "control" in chosen else [])
    commands = _commands(device, cells, bench_size)
    if list_only:
        for name in chosen:
            click.echo(f"{name}: {' '.join(commands[name][1])}")
        return
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        click.echo(f"gpu-check: error: torch {torch.__version__} sees no CUDA device here; run it on a machine "
                   "with a GPU (or --device cpu to rehearse)", err=True)
        sys.exit(2)
    started = datetime.datetime.now(datetime.timezone.utc)
    out_path = out_path or Path(f"gpu-check-{started:%Y%m%d-%H%M%S}.md")
    machine = _machine(device)
    results: list[StepResult] = []
    for name in chosen:
        results.append(_control(device, results) if name == "control" else _run(name, *commands[name]))
    out_path.write_text(render(device, machine, results, started))
    failed = failed_steps(results)
    click.echo(f"gpu-check: {'FAIL in ' + ', '.join(failed) if failed else 'PASS'}; report: {out_path.absolute()}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""Run matrix cells on real ranks, in three phases that share work between cells.

1. Sources: each distinct source configuration trains ``STEPS`` steps, writes the reference (its full
   state, by rank 0) and its checkpoint, then trains ``RESUME_STEPS`` more: the uninterrupted run.
2. Conversions: ckptkit turns each cell's source checkpoint into the target's form and world size, in
   this process (offline, no process group), and ``verify`` compares the two.
3. Targets: fresh ranks load each converted checkpoint under the target configuration, capture the full
   state they loaded (rank 0 writes it), and train ``RESUME_STEPS`` steps.
4. Controls, for the cells whose losses drift: each target configuration trains, saves with torch alone and
   resumes from that checkpoint (phases 1 and 3 with no conversion between them); :mod:`.control` weighs
   the result and says whether the cell is ``torch`` or ``FAIL``.

Jobs of one world size share a spawned group, one after another; each job writes ``outcome.json`` when it
ends. If a group dies, the first job without an outcome is the one that was running: it gets the error,
and the jobs after it run again in a new group.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..ops.convert import convert, reshard
from ..ops.export import export_hf
from ..ops.verify import verify
from .checks import compare_losses, compare_states, loss_rtol
from .configs import Cell, Format, TrainConfig, Wrapper
from .control import Control, control_config
from .launch import run_ranks
from .states import checkpoint_path, full_state, load, save, write_flat_layout
from .training import MODEL, build, perturb_resumed, train

__all__ = ["COLLECTIVE_TIMEOUT", "RESUME_STEPS", "STEPS", "CellResult", "Status", "check_device",
           "run_cells"]

STEPS = 2
"""Steps before saving: AdamW's moments and step count are real and differ from their initial values."""
RESUME_STEPS = 3
"""Steps after resuming, compared with the uninterrupted run."""
COLLECTIVE_TIMEOUT = 300.0
"""Seconds a rank waits on a peer before the group fails instead of hanging (CI machines are slow)."""
REFERENCE, LOADED, OUTCOME = "reference.pt", "loaded.pt", "outcome.json"


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    TORCH = "torch"
    """The losses drift, and torch resuming the target configuration from its own checkpoint drifts as much."""
    SKIP = "skip"


@dataclass(frozen=True)
class CellResult:
    cell: Cell
    status: Status
    reason: str
    detail: str = ""
    """Everything behind ``reason``: the whole error with its traceback, or every state difference."""
    control: Control | None = None
    """The torch-only control, for a cell whose losses drift."""

    def to_json(self) -> dict:
        return {"cell": self.cell.name, "source": self.cell.source.name, "target": self.cell.target.name,
                "operation": self.cell.operation, "status": self.status.value, "reason": self.reason,
                "detail": self.detail, "control": self.control.to_json() if self.control else None}


@dataclass(frozen=True)
class _Job:
    """One configuration run on one group: ``checkpoint`` is written (source) or read (target)."""

    config: TrainConfig
    directory: str
    reads: str | None = None
    """The directory whose checkpoint a target job loads, where it is not its own (a control's resume)."""

    @property
    def checkpoint(self) -> Path:
        return checkpoint_path(self.reads or self.directory, self.config.form)


def check_device(device: str) -> None:
    """Raise ValueError unless the harness can run ranks on ``device`` here."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device 'cuda': torch {torch.__version__} sees no CUDA device here; use --device cpu")


def _backend(device: str, world: int) -> str:
    """NCCL where every rank has a GPU of its own. Else gloo, on CUDA tensors for ``cuda``: it runs allreduce,
    allgather and broadcast on them, and reduce-scatter as an allreduce (torch 2.13 ProcessGroupGloo.cpp)."""
    return "nccl" if device == "cuda" and world <= torch.cuda.device_count() else "gloo"


def _start_rank(device: str) -> torch.device:
    """Set this rank up for a run of jobs; the device it computes on."""
    # torch's notices about its own internals (deprecations, "NO_SHARD returns a full state dict" when FSDP1
    # runs on one rank), repeated by every rank for every job, would bury the report: none is the user's to act on.
    for category in (UserWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"torch\.")
    # The matrix runs NO_SHARD on purpose; torch's deprecation of it is attributed to the wrapping call.
    warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated", category=FutureWarning)
    # launch.run_ranks has set this rank's GPU as the current one.
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _record_outcome(job: _Job, outcome: dict) -> None:
    dist.barrier()  # every rank is past the job before it counts as done
    if dist.get_rank() == 0:
        (Path(job.directory) / OUTCOME).write_text(json.dumps(outcome))


def _source_rank(rank: int, world: int, jobs: tuple[_Job, ...], device: str) -> None:
    dev = _start_rank(device)
    for job in jobs:
        model, optimizer = build(job.config, dev)
        train(model, optimizer, start=0, steps=STEPS, device=dev)
        # Taken before saving: FSDP1 takes no full state after a sharded one.
        reference = full_state(model, optimizer, STEPS)
        if rank == 0:
            torch.save(reference, Path(job.directory) / REFERENCE)
        save(job.config.form, model, optimizer, STEPS, job.checkpoint)
        _record_outcome(job, {"losses": train(model, optimizer, start=STEPS, steps=RESUME_STEPS, device=dev)})


def _target_rank(rank: int, world: int, jobs: tuple[_Job, ...], device: str) -> None:
    dev = _start_rank(device)
    for job in jobs:
        model, optimizer = build(job.config, dev)
        step = load(job.config.form, model, optimizer, job.checkpoint)
        loaded = full_state(model, None if job.config.form is Format.HF else optimizer, step)
        if rank == 0:
            torch.save(loaded, Path(job.directory) / LOADED)
        perturb_resumed(job.config, optimizer)
        losses = train(model, optimizer, start=STEPS, steps=RESUME_STEPS, device=dev)
        _record_outcome(job, {"step": step, "losses": losses})


def _message(error: BaseException) -> str:
    """The error's message on one line, without the traceback run_ranks appends to a rank's failure."""
    text = str(error).split("Traceback (most recent call last)")[0]
    return " ".join(text.split()) or type(error).__name__


def _run_jobs(fn: Callable, jobs: list[_Job], device: str,
              say: Callable[[str], None]) -> dict[_Job, dict | BaseException]:
    """Each job's outcome, or the error it died of."""
    results: dict[_Job, dict | BaseException] = {}
    for world in sorted({j.config.world_size for j in jobs}):
        pending = [j for j in jobs if j.config.world_size == world]
        while pending:
            start, error = time.perf_counter(), None
            try:
                # A rank stuck outside a collective never times out on its own: the group gets a collective
                # timeout per job, then dies and its running job takes the blame.
                run_ranks(fn, world, tuple(pending), device, backend=_backend(device, world),
                          timeout=COLLECTIVE_TIMEOUT, deadline=COLLECTIVE_TIMEOUT * (1 + len(pending)),
                          cuda=device == "cuda")
            except Exception as e:  # a rank's exception, a crash (signal) or a timeout: attributed below
                error = e
            say(f"  {len(pending)} job(s) on {world} rank(s): {time.perf_counter() - start:.1f} s")
            for j in pending:
                if (Path(j.directory) / OUTCOME).is_file():
                    results[j] = json.loads((Path(j.directory) / OUTCOME).read_text())
            pending = [j for j in pending if j not in results]
            if pending:
                # Jobs run in order, so the first without an outcome is the one the group died in.
                results[pending.pop(0)] = error or RuntimeError("the group ended without writing an outcome")
    return results


def _convert(cell: Cell, src: Path, dst: Path, assets: Path) -> str | None:
    """Run the cell's ckptkit operation; a verify finding, or None."""
    if cell.operation == "export_hf":
        # The harness's model keeps its own names (its config describes it as a LLaMA but for its position
        # table, which transformers' class would not load): --preset none makes that a note, not a refusal.
        export_hf(src, dst, hf_assets=assets, preset=None)
        return None  # verify would report the lm_head.weight the export leaves out; the load check covers it
    if cell.operation == "reshard":
        reshard(src, dst, world_size=cell.target.world_size)
    else:
        ranked = cell.target.form in (Format.SHARDED, Format.LOCAL)  # a full or hf file is laid out for none
        convert(src, dst, to=cell.target.form, world_size=cell.target.world_size if ranked else None)
    report = verify(src, dst)
    if report.ok:
        return None
    first = report.differences[0]
    return f"ckptkit verify: {len(report.differences)} differences, first {first.key}: {first.what}"


@dataclass(frozen=True)
class _Verdict:
    """A cell judged on its own run; ``drift`` is set where its losses drift, and a control is due."""

    result: CellResult
    drift: float | None = None
    state_ok: bool = False


def _compared_losses(cell: Cell, expected: list[float], actual: list[float]):
    # HF carries the weights alone: the first resumed step's loss (a forward pass on the loaded weights)
    # must match; after it a fresh AdamW takes over, so later losses are not expected to.
    count = 1 if cell.target.form is Format.HF else RESUME_STEPS
    return compare_losses(expected[:count], actual[:count], loss_rtol(cell), first_step=STEPS)


def _judge(cell: Cell, source: dict, target: dict, reference: Path, loaded: Path) -> _Verdict:
    hf = cell.target.form is Format.HF
    state = compare_states(torch.load(reference, weights_only=True), torch.load(loaded, weights_only=True),
                           model_only=hf)
    losses = _compared_losses(cell, source["losses"], target["losses"])
    drift = None if losses.ok else losses.worst
    if not state.ok:  # the bytes differ: ckptkit's, whatever a control finds
        return _Verdict(CellResult(cell, Status.FAIL, f"{state.summary}; {losses.summary}",
                                   "\n".join(state.problems)), drift)
    if not hf and target["step"] != STEPS:
        return _Verdict(CellResult(cell, Status.FAIL, f"loaded step {target['step']!r}, saved {STEPS}"))
    status = Status.PASS if losses.ok else Status.FAIL
    return _Verdict(CellResult(cell, status, f"{state.summary}; {losses.summary}"), drift, state_ok=True)


def _with_control(verdict: _Verdict, control: Control | BaseException) -> CellResult:
    """The cell's result once its torch-only control has run: ``torch`` only where its bytes loaded exactly
    and the control drifts as much."""
    result = verdict.result
    if isinstance(control, BaseException):
        return dataclasses.replace(result, reason=f"{result.reason}; torch-only control failed: {_message(control)}",
                                   detail="\n".join(filter(None, (result.detail, str(control)))))
    status = Status.TORCH if verdict.state_ok and control.blames_torch else Status.FAIL
    return dataclasses.replace(result, status=status, reason=f"{result.reason}; {control.summary}",
                               detail="\n".join(filter(None, (result.detail, control.detail()))), control=control)


def _pinning_refused() -> str | None:
    """torch's reason for refusing pinned host memory in this process, or None where it pins."""
    try:
        torch.empty(1).pin_memory()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


def _skip_reason(cell: Cell, pinning_refused: str | None, device: str = "cpu") -> str | None:
    if pinning_refused and any(c.wrapper is Wrapper.FSDP1 and c.cpu_offload for c in (cell.source, cell.target)):
        return ("FSDP1 CPUOffload(offload_params=True) pins the offloaded shards (torch 2.13 fsdp/_flat_param.py, "
                f"FlatParamHandle.init_flat_param_attributes: pin_memory()), which torch refuses here: "
                f"{pinning_refused}")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    shared = [c for c in (cell.source, cell.target) if c.wrapper is Wrapper.FSDP2 and c.world_size > gpus]
    if device == "cuda" and shared and os.environ.get("CKPTKIT_HARNESS_STAGE_FSDP2") != "1":
        # Seen on one H100 with torch 2.11 (bin/gpu-check, 2026-11-22): FSDP1 and DDP ranks sharing a GPU over
        # gloo pass; FSDP2's die in its collectives. NCCL, one GPU a rank, is what FSDP2 runs on.
        return (f"FSDP2 on {shared[0].world_size} ranks needs a GPU per rank (NCCL); this machine has {gpus}, and "
                "FSDP2 ranks sharing GPUs over gloo die with SIGSEGV (CKPTKIT_HARNESS_STAGE_FSDP2=1 tries them with "
                "CPU-staged collectives)")
    return None


def run_cells(cells: tuple[Cell, ...], *, device: str = "cpu", workdir: Path | None = None,
              say: Callable[[str], None] = lambda line: None, controls: bool = True) -> list[CellResult]:
    """Run ``cells`` and judge each; results in the order of ``cells``. ``say`` receives progress lines.

    ``workdir`` keeps every checkpoint, reference and outcome (default: a temporary directory, removed).
    ``controls=False`` leaves out the torch-only controls: a cell whose losses drift is ``FAIL``, undecided
    between ckptkit and torch (``bin/gpu-check`` runs the controls as a step of their own).
    """
    check_device(device)
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ckptkit-harness-"))
    try:
        return _run(cells, device, root, say, controls)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _fail(cell: Cell, what: str, error: BaseException) -> CellResult:
    return CellResult(cell, Status.FAIL, f"{what}: {_message(error)}", str(error))


def _run(cells: tuple[Cell, ...], device: str, root: Path, say: Callable[[str], None],
         controls: bool) -> list[CellResult]:
    results: dict[int, CellResult] = {}
    pinning_refused = _pinning_refused()
    runnable = []
    for i, cell in enumerate(cells):
        reason = _skip_reason(cell, pinning_refused, device)
        if reason:
            results[i] = CellResult(cell, Status.SKIP, reason)
        else:
            runnable.append(i)

    sources, source_out = _source_runs([cells[i].source for i in runnable], device, root, say)

    say(f"[2/4] ckptkit converts {len(runnable)} checkpoints")
    assets = _fresh(root / "hf-assets")
    (assets / "config.json").write_text(json.dumps(MODEL.hf_config(), indent=2))
    targets: dict[int, tuple[_Job, dict]] = {}  # cell index: its target job, and its source run's outcome
    for i in runnable:
        cell, source = cells[i], sources[cells[i].source]
        source_outcome = source_out[source]
        if isinstance(source_outcome, BaseException):
            results[i] = _fail(cell, "source run failed", source_outcome)
            continue
        job = _Job(cell.target, str(_fresh(root / "cells" / f"c{i:03d}")))
        try:
            finding = _convert(cell, source.checkpoint, job.checkpoint, assets)
        except Exception as e:  # a ckptkit bug is a cell's failure, not the harness's
            results[i] = _fail(cell, f"ckptkit {cell.operation}", e)
            continue
        if finding:
            results[i] = CellResult(cell, Status.FAIL, finding)
        else:
            targets[i] = (job, source_outcome)

    say(f"[3/4] {len(targets)} target runs: load, capture, train {RESUME_STEPS} steps")
    target_out = _run_jobs(_target_rank, [job for job, _ in targets.values()], device, say)
    drifting: dict[int, tuple[_Verdict, dict]] = {}  # cell index: its verdict, and its source run's outcome
    for i, (job, source_outcome) in targets.items():
        cell, source = cells[i], sources[cells[i].source]
        target_outcome = target_out[job]
        if isinstance(target_outcome, BaseException):
            results[i] = _fail(cell, "target run failed", target_outcome)
            continue
        verdict = _judge(cell, source_outcome, target_outcome, Path(source.directory) / REFERENCE,
                         Path(job.directory) / LOADED)
        results[i] = verdict.result
        if verdict.drift is not None:
            drifting[i] = (verdict, source_outcome)

    if drifting and controls:
        results.update(_controlled(cells, drifting, device, root, say))
    return [results[i] for i in range(len(cells))]


def _source_runs(configs: list[TrainConfig], device: str, root: Path, say: Callable[[str], None]) -> tuple[
        dict[TrainConfig, _Job], dict[_Job, dict | BaseException]]:
    """One source run per configuration (trained, saved, trained on), and each run's outcome or error."""
    sources: dict[TrainConfig, _Job] = {}
    for config in configs:
        if config not in sources:
            sources[config] = _Job(config, str(_fresh(root / "sources" / f"s{len(sources):03d}")))
    say(f"[1/4] {len(sources)} source runs: train {STEPS} steps, save, train {RESUME_STEPS} more")
    source_out = _run_jobs(_source_rank, list(sources.values()), device, say)
    for job in sources.values():
        if job.config.form is Format.LOCAL and not isinstance(source_out[job], BaseException):
            try:
                write_flat_layout(job.config, job.checkpoint)
            except Exception as e:  # a ckptkit bug in deriving the layout fails this source's cells
                source_out[job] = e
    return sources, source_out


def _controlled(cells: tuple[Cell, ...], drifting: dict[int, tuple[_Verdict, dict]], device: str, root: Path,
                say: Callable[[str], None]) -> dict[int, CellResult]:
    """Phase 4: the drifting cells' results once each target configuration's torch-only control has run."""
    configs = list(dict.fromkeys(cells[i].target for i in drifting))
    say(f"[4/4] {len(configs)} torch-only controls for {len(drifting)} drifting cells: train, save with torch, "
        "resume")
    runs = _run_controls(configs, device, root, say)
    results = {}
    for i, (verdict, source_outcome) in drifting.items():
        run = runs[cells[i].target]
        control = run if isinstance(run, BaseException) else _control(cells[i], verdict, source_outcome, *run)
        results[i] = _with_control(verdict, control)
    return results


def _run_controls(configs: list[TrainConfig], device: str, root: Path,
                  say: Callable[[str], None]) -> dict[TrainConfig, tuple[_Job, dict, _Job, dict] | BaseException]:
    """Each target configuration trained, saved by torch and resumed from that checkpoint by fresh ranks: its
    save job and uninterrupted run, its resume job and resumed run; or the error either died of."""
    saves = {c: _Job(control_config(c), str(_fresh(root / "controls" / f"k{n:03d}" / "save")))
             for n, c in enumerate(configs)}
    saved = _run_jobs(_source_rank, list(saves.values()), device, say)
    resumes = {c: _Job(job.config, str(_fresh(Path(job.directory).parent / "resume")), reads=job.directory)
               for c, job in saves.items() if not isinstance(saved[job], BaseException)}
    resumed = _run_jobs(_target_rank, list(resumes.values()), device, say)
    runs: dict[TrainConfig, tuple[_Job, dict, _Job, dict] | BaseException] = {}
    for c, job in saves.items():
        first = saved[job]
        second = resumed[resumes[c]] if c in resumes else first
        if isinstance(first, BaseException):
            runs[c] = first
        elif isinstance(second, BaseException):
            runs[c] = second
        else:
            runs[c] = (job, first, resumes[c], second)
    return runs


def _control(cell: Cell, verdict: _Verdict, cell_source: dict, save_job: _Job, saved: dict, resume_job: _Job,
             resumed: dict) -> Control:
    """Weigh a control's run against the cell's uninterrupted run, and against its own."""
    state = compare_states(torch.load(Path(save_job.directory) / REFERENCE, weights_only=True),
                           torch.load(Path(resume_job.directory) / LOADED, weights_only=True))
    return Control(cell_drift=verdict.drift or 0.0,
                   drift=_compared_losses(cell, cell_source["losses"], resumed["losses"]).worst,
                   own_drift=_compared_losses(cell, saved["losses"], resumed["losses"]).worst,
                   rtol=loss_rtol(cell), state=state.summary)


def _fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory

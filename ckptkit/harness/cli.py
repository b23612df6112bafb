"""``ckptkit harness``: run a matrix of save -> convert -> load cells on real ranks and print the table.

Exit codes: 0 every cell passed, was skipped or drifts as torch alone does (``torch``: listed in the summary
and the JSON), 1 a cell failed, 2 bad usage (no cell matches, say).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

__all__ = ["harness"]


def _render(results) -> str:
    """The results as a plain-text table: cell, ckptkit operation, result, reason."""
    rows = [("#", "source -> target", "ckptkit", "result", "reason")]
    rows += [(str(i + 1), r.cell.name, r.cell.operation, r.status.value, r.reason) for i, r in enumerate(results)]
    widths = [max(len(row[c]) for row in rows) for c in range(4)]
    # widths stops short of the last column, the reason, which is appended unpadded.
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)) + "  " + row[4] for row in rows)


def _torch_lines(results) -> list[str]:
    """The ``torch`` cells, each with the cell's drift, its control's and the torch version."""
    lines = []
    for r in results:
        if r.control is not None and r.status.value == "torch":
            c = r.control
            lines.append(f"  {r.cell.name}: cell {c.cell_drift:.1e}, torch-only control {c.drift:.1e} "
                         f"(its own uninterrupted run {c.own_drift:.1e}; torch {c.torch_version})")
    if not lines:
        return []
    return ["torch: these cells drift, and so does torch resuming the target configuration from its own "
            "checkpoint with no ckptkit:", *lines]


@click.command()
@click.option("--matrix", "matrix_name", type=click.Choice(["quick", "full"]), default="quick", show_default=True,
              help="quick: a handful of representative cells (CI). full: every option as source and as target.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu runs gloo ranks; cuda runs NCCL ranks with a GPU each, or gloo ranks sharing the GPUs where "
                   "a cell needs more ranks than there are GPUs.")
@click.option("--cells", "pattern", default=None, metavar="PATTERN",
              help="Only cells whose name matches this shell-style pattern anywhere, e.g. 'fsdp1(hybrid*'.")
@click.option("--only", "only", multiple=True, metavar="NAME",
              help="Only the cell of either matrix with exactly this name (repeatable); --matrix and --cells are "
                   "then ignored. bin/gpu-check re-runs failed cells with it.")
@click.option("--controls/--no-controls", default=True, show_default=True,
              help="Run a torch-only control for every cell whose losses drift: status torch (exit 0) where torch "
                   "alone drifts as much, else FAIL. Without, a drifting cell is FAIL.")
@click.option("--list", "list_only", is_flag=True, help="Print the selected cells and exit without running them.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep checkpoints, references and outcomes here (default: a temporary directory, removed).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable results on stdout (progress goes to stderr).")
def harness(matrix_name: str, device: str, pattern: str | None, only: tuple[str, ...], controls: bool,
            list_only: bool, workdir: Path | None, as_json: bool) -> None:
    """Prove on real FSDP / DDP ranks that ckptkit's conversions load back bit for bit and training goes on.

    Each cell trains a small transformer under a source configuration, saves, has ckptkit convert or
    re-shard the checkpoint for the target, loads it on fresh ranks, compares every parameter and optimizer
    tensor with the state before saving, and compares the losses of the next steps with the uninterrupted run.
    """
    from .matrix import MATRICES, named, select

    try:
        cells = named(only) if only else select(MATRICES[matrix_name](), pattern)
    except KeyError as e:
        raise click.UsageError(e.args[0]) from e
    if not cells:
        raise click.UsageError(f"no {matrix_name} cell matches --cells {pattern!r}; --list shows the names")
    if list_only:
        click.echo("\n".join(f"{c.name}  [{c.operation}]" for c in cells))
        return
    from .runner import Status, check_device, run_cells

    try:
        check_device(device)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    start = time.perf_counter()
    results = run_cells(cells, device=device, workdir=workdir, say=lambda line: click.echo(line, err=True),
                        controls=controls)
    seconds = time.perf_counter() - start
    counts = {s: sum(r.status is s for r in results) for s in Status}
    if as_json:
        click.echo(json.dumps({"matrix": matrix_name, "device": device, "seconds": round(seconds, 1),
                               "counts": {s.value: n for s, n in counts.items()},
                               "torch": [r.cell.name for r in results if r.status is Status.TORCH],
                               "cells": [r.to_json() for r in results]}, indent=2))
    else:
        click.echo(_render(results))
        for line in _torch_lines(results):
            click.echo(line)
        click.echo(f"{counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, {counts[Status.TORCH]} torch, "
                   f"{counts[Status.SKIP]} skipped in {seconds:.0f} s ({device})")
    sys.exit(1 if counts[Status.FAIL] else 0)

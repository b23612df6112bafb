"""The tables the bench prints: per row the median wall time, throughput, the largest peak RSS of its runs, and
its ratio to the ``cp -r`` of its own input measured in the same run."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import click

from .runner import Row

__all__ = ["cores", "load", "median", "table"]


def cores() -> int:
    """The cores this benchmark's commands may run on (its CPU affinity, as ``taskset`` sets it)."""
    from ckptkit.io.parallel import cores as affinity

    return affinity()


def load() -> str:
    """The machine's load averages (1, 5, 15 minutes), as ``uptime`` shows them: what else was running."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def median(row: Row) -> float:
    return statistics.median(w for w, _ in row.runs)


def table(rows: list[Row], total: int, repeat: int, what: str, page_cache: str = "warm") -> None:
    """Print ``rows`` (of ``total`` bytes each) with their ratios to the first row of the same source."""
    click.echo(f"checkpoint: {what}; {cores()} cores, load {load()}; median of {repeat} runs, {page_cache} page "
               "cache; x cp: against the cp -r of the same input")
    click.echo(f"{'what':<52} {'wall s':>7} {'GB/s':>6} {'peak RSS MB':>12} {'x cp':>6}")
    cp: dict[Path, float] = {}
    for row in rows:
        wall = median(row)
        rss = max(r for _, r in row.runs)
        cp.setdefault(row.source, wall)
        click.echo(f"{row.name:<52} {wall:7.2f} {total / wall / 1e9:6.2f} {rss / 2**20:12.0f} "
                   f"{wall / cp[row.source]:6.2f}")

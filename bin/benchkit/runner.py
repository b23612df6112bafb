"""The runner: each contender a process of its own, timed by wall clock, its peak RSS from ``wait4``, every row
``--repeat`` times, interleaved (one round runs each row once, so a change of load touches every row alike).

Two page-cache modes: ``warm`` (the default) removes each output after its run, so the next run writes into a
page cache with room; ``full`` leaves the previous output of the same row on disk while the next run writes, as
on a training node whose page cache holds the last checkpoint: the new bytes then take pages from the old.
Either way the dirty pages of the previous run are written back (``sync``) before the next starts.
"""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

import ckptkit

__all__ = ["PAGE_CACHE", "Row", "ckptkit_command", "compiled", "cp", "remove", "run", "time_rows", "warm"]

PAGE_CACHE = ("warm", "full")

# Runs one command and prints "wall_seconds peak_rss_bytes exit_code". A process inherits, as its RSS high-water
# mark, the RSS of whoever exec'd it; this runner is a bare interpreter (~9 MB), so every row carries that floor
# rather than the ~100 MB of the bench's own process.
_RUNNER = """
import os, sys, time
t = time.perf_counter()
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ, file_actions=[
    (os.POSIX_SPAWN_OPEN, 1, sys.argv[1] + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
    (os.POSIX_SPAWN_OPEN, 2, sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)])
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - t, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status))
"""


def run(cmd: list[str], log: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS in bytes of ``cmd`` as a child process; its stdout goes to ``log``.out.

    Raises:
        click.ClickException: the command failed (the end of its stderr says why).
    """
    out = subprocess.run([sys.executable, "-S", "-c", _RUNNER, str(log), *cmd], capture_output=True, text=True,
                         check=True)
    wall, rss, code = out.stdout.split()
    if int(code) != 0:
        raise click.ClickException(f"{' '.join(cmd)} failed: {log.read_text()[-2000:]}")
    return float(wall), float(rss)


def ckptkit_command(*args: str) -> list[str]:
    """``python -m ckptkit ARGS``, as a row runs it."""
    return [sys.executable, "-m", "ckptkit", *args]


def compiled() -> None:
    """Compile ckptkit's bytecode, as an install does: without it, a PYTHONDONTWRITEBYTECODE environment makes every
    run compile ckptkit's modules again, a tenth of a second or more of each row."""
    compileall.compile_dir(Path(ckptkit.__file__).parent, quiet=1)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def warm(path: Path) -> None:
    """Read every file of ``path`` once, so that the rows read it from the page cache."""
    subprocess.run(["cat", *map(str, path.iterdir())], stdout=subprocess.DEVNULL, check=True)


@dataclass
class Row:
    """A contender: a command writing to the path it is given, timed against the ``cp -r`` of ``source``.

    ``keep``: where its first output is kept, for checks after the timing."""

    name: str
    cmd: Callable[[Path], list[str]]
    source: Path
    keep: Path | None = None
    runs: list[tuple[float, float]] = field(default_factory=list)


def cp(source: Path) -> Row:
    """``cp -r`` of ``source``: the same bytes, read and written by the kernel."""
    return Row(f"cp -r {source.name}", lambda out: ["cp", "-r", str(source), str(out)], source)


def time_rows(rows: list[Row], repeat: int, root: Path, page_cache: str = "warm") -> None:
    """Run every row ``repeat`` times, interleaved; with ``page_cache="full"``, each run writes while the previous
    output of the same row is still on disk (an untimed run makes the first)."""
    previous = [root / f"previous-{i}" for i in range(len(rows))]
    if page_cache == "full":
        for row, prev in zip(rows, previous, strict=True):
            os.sync()
            run(row.cmd(prev), root / "stderr.log")
    try:
        for _ in range(repeat):
            for row, prev in zip(rows, previous, strict=True):
                out = root / "out"
                os.sync()  # the previous run's dirty pages written back now, not during this one
                row.runs.append(run(row.cmd(out), root / "stderr.log"))
                if row.keep is not None and not row.keep.exists():
                    if page_cache == "full":  # (the output stays as the next run's previous one)
                        shutil.copytree(out, row.keep) if out.is_dir() else shutil.copy(out, row.keep)
                    else:
                        out.rename(row.keep)
                if page_cache == "full":
                    remove(prev)
                    out.rename(prev)
                remove(out)
                (root / "tmp.pt").unlink(missing_ok=True)
    finally:
        for prev in previous:
            remove(prev)

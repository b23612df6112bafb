"""``bin/bench`` (the ``bin/benchkit`` package): its modes run, and ``--page-cache full`` writes each run while the
previous output of the same row is still on disk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(__file__).resolve().parents[1] / "bin"


@pytest.fixture
def runner():
    sys.path.insert(0, str(BIN))
    try:
        from benchkit import runner

        yield runner
    finally:
        sys.path.remove(str(BIN))


@pytest.mark.parametrize("page_cache, previous", [("warm", False), ("full", True)])
def test_time_rows_leaves_the_previous_output_on_disk_with_a_full_page_cache(runner, tmp_path, page_cache, previous):
    # Each run lists the working directory into its output: what was on disk while it wrote.
    row = runner.Row("ls", lambda out: ["sh", "-c", f"ls {tmp_path} > {out}"], tmp_path, keep=tmp_path / "kept")
    runner.time_rows([row], 2, tmp_path, page_cache)
    assert len(row.runs) == 2 and all(wall > 0 for wall, _ in row.runs)
    assert ("previous-0" in (tmp_path / "kept").read_text().split()) is previous
    assert not (tmp_path / "previous-0").exists() and not (tmp_path / "out").exists()


def test_bench_runs_its_per_chunk_mode_as_bin_bench_starts_it(tmp_path):
    proc = subprocess.run([sys.executable, str(BIN / "benchkit"), "chunks", "1000", "--repeat", "1", "--workdir",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "reshard: read + plan + execute" in proc.stdout and list(tmp_path.iterdir()) == []

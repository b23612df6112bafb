"""ckptkit.io.parallel: the output files split over worker processes (``--workers``) or over torchrun's ranks,
written byte for byte as one process writes them, and complete or absent when any process fails."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckptkit
from _checks import leftovers, load_dcp, load_full, load_hf
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Chunk, Span, TensorEntry
from ckptkit.core.plan import Bytes, FilePlan, Region
from ckptkit.core.split import split_work
from ckptkit.errors import UsageError
from ckptkit.harness.launch import run_ranks

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def ckptkit_cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptkit", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def torchrun(ranks: int, *args, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), "-m", "ckptkit", *map(str, args)], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=timeout)


def truncated_copy(dcp: Path, where: Path) -> Path:
    """``dcp`` with its second rank's data file cut short: planning (which reads ``.metadata``) passes,
    writing the output files that need that rank's bytes fails."""
    shutil.copytree(dcp, where)
    os.truncate(where / "__1_0.distcp", 1000)
    return where


@pytest.mark.parametrize("sizes, n, shares", [
    ((5, 4, 3, 2, 1), 2, [[0, 3, 4], [1, 2]]),  # largest first to the lighter share; a tie goes to share 0
    ((1, 1, 1), 5, [[0], [1], [2], [], []]),  # more processes than files: some write nothing
    ((10, 0, 0), 2, [[0], [1, 2]]),  # empty files count as nothing, and go where there is least
    ((3, 9, 3, 3), 2, [[1], [0, 2, 3]]),  # the largest alone in share 0; a share keeps the plan's order
])
def test_split_work_balances_bytes_and_keeps_plan_order(sizes, n, shares):
    files = tuple(FilePlan(f"f{i}", (Bytes(b"x" * size),)) for i, size in enumerate(sizes))
    got = split_work(files, n, min_piece=1)
    assert [[int(s.relpath[1:]) for s in share] for share in got] == shares
    assert all(s.start == 0 for share in got for s in share)  # framing bytes are never cut


def test_split_work_cuts_a_large_file_into_byte_ranges_that_cover_it_once():
    # One file: eight 10-byte framing parts and a 4 x 10 uint8 tensor (40 bytes), over 3 writers.
    entry = TensorEntry("w", ("w",), by_name("uint8"), (4, 10), (Chunk((0, 0), (4, 10), Span("/src", 0, 40)),))
    fp = FilePlan("one.bin", (*(Bytes(b"h" * 10),) * 4, Region.whole(entry), *(Bytes(b"t" * 10),) * 4))
    shares = split_work((fp,), 3, min_piece=1)
    ranges = sorted((s.start, s.start + s.nbytes) for share in shares for s in share)
    assert ranges[0][0] == 0 and ranges[-1][1] == fp.nbytes == 120
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # no gap, no overlap
    assert all(share for share in shares) and max(sum(s.nbytes for s in share) for share in shares) <= 50
    regions = [p for share in shares for s in share for p in s.parts if isinstance(p, Region)]
    assert sum(r.sizes[0] for r in regions) == 4 and len(regions) > 1  # the tensor cut into whole rows


def fp8_export_plan(rows: tuple[int, ...], cols: int = 256):
    """The HF plan of ``export-hf --dtype fp8`` of bf16 linear weights of ``rows`` x ``cols``, and the weights."""
    from ckptkit.core.reshape import quantized_fp8
    from ckptkit.formats.hf import HfIO, HfOptions

    weights, tensors, offset = [], [], 0
    for i, r in enumerate(rows):
        w = TensorEntry(f"l{i}.q_proj.weight", (f"l{i}.q_proj.weight",), by_name("bfloat16"), (r, cols),
                        (Chunk((0, 0), (r, cols), Span("/src", offset, 2 * r * cols)),))
        offset += 2 * r * cols
        weights.append(w)
        tensors += quantized_fp8(w, w.key, by_name("float8_e4m3fn"), by_name("float32"))
    norm = TensorEntry("norm.weight", ("norm.weight",), by_name("bfloat16"), (cols,),
                       (Chunk((0,), (cols,), Span("/src", offset, 2 * cols)),))
    from ckptkit.core.manifest import Format, Manifest

    plan = HfIO().plan(Manifest(Format.SHARDED, "/src", (*tensors, norm)), HfOptions(max_shard_size=None))
    return plan, weights


def test_split_work_shares_an_fp8_export_by_weight_each_with_its_scales_after_its_values():
    plan, weights = fp8_export_plan((384, 256, 128) * 6)
    shares = split_work(plan.files, 2)
    ranges = sorted((s.relpath, s.start, s.start + s.nbytes) for share in shares for s in share)
    for fp in plan.files:  # every byte of every file written once
        mine = [(a, b) for rel, a, b in ranges if rel == fp.relpath]
        assert mine[0][0] == 0 and mine[-1][1] == fp.nbytes and all(x[1] == y[0] for x, y in itertools.pairwise(mine))
    for w in weights:
        owners = [(i, j, p.entry.derived.op) for i, share in enumerate(shares) for j, s in enumerate(share)
                  for p in s.parts if isinstance(p, Region) and p.entry.derived is not None
                  and p.entry.derived.inputs[0] is w]
        assert len({i for i, _, _ in owners}) == 1, w.key  # one process reads the weight
        assert [op for _, _, op in sorted(owners)] == ["quant_fp8", "fp8_scale"], w.key  # values, then scales
    elements = [sum(p.entry.derived.inputs[0].numel for s in share for p in s.parts if isinstance(p, Region)
                    and p.entry.derived is not None and p.entry.derived.op == "quant_fp8") for share in shares]
    assert elements == [3 * (384 + 256 + 128) * 256] * 2  # the largest first, to the lighter share


def test_choose_writers_counts_the_quantization_of_an_fp8_export():
    from ckptkit.core.split import Work, choose_writers

    plan, _ = fp8_export_plan((8192,) * 16, cols=4096)  # 0.5 GB of values: a copy's 0.3 s, a quantization's 2 s
    copy_only = Work(sum(f.nbytes for f in plan.files), 48, len(plan.files), 17)
    assert choose_writers(copy_only, 2)[0] == 1
    n, why = choose_writers(Work.of(plan.files), 2)
    assert n == 2, why


def test_reshard_with_workers_writes_what_one_process_writes(tmp_path, dcp_ckpt, training_state):
    ckptkit.reshard(dcp_ckpt, tmp_path / "one", world_size=3)
    ckptkit.reshard(dcp_ckpt, tmp_path / "two", world_size=3, workers=2)
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")
    assert load_dcp(tmp_path / "two", tmp_path / "scratch.pt").keys() == training_state.keys()
    assert leftovers(tmp_path) == []


def test_export_hf_with_workers_casts_in_them_as_one_process_does(tmp_path, full_ckpt):
    one = ckptkit.export_hf(full_ckpt, tmp_path / "one", dtype="bf16", max_shard_size=100)
    ckptkit.export_hf(full_ckpt, tmp_path / "two", dtype="bf16", max_shard_size=100, workers=2)
    assert one.files > 3
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")
    assert load_hf(tmp_path / "two").keys() == load_hf(tmp_path / "one").keys()


def test_cli_workers_failure_in_one_worker_is_one_line_and_leaves_no_dst(tmp_path, dcp_ckpt):
    src = truncated_copy(dcp_ckpt, tmp_path / "cut")
    proc = ckptkit_cli("reshard", src, tmp_path / "out", "--world-size", "3", "--workers", "2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("ckptkit: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "__1_0.distcp" in proc.stderr and "truncated" in proc.stderr
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


_SIGNALLED_WORKERS = """
import os, signal
from ckptkit import cli
import multiprocessing.connection as connection
real_wait = connection.wait
def wait(*args, **kwargs):  # the workers are running: the signal comes while the parent first waits for them
    connection.wait = real_wait
    os.kill(os.getpid(), getattr(signal, {how!r}))
    return real_wait(*args, **kwargs)
connection.wait = wait
cli.main(["reshard", {src!r}, {dst!r}, "--world-size", "3", "--workers", "2", "-q"])
"""


@pytest.mark.parametrize("how, code, line", [("SIGINT", 130, "ckptkit: interrupted\n"),
                                             ("SIGTERM", 143, "ckptkit: terminated\n")])
def test_cli_workers_signal_stops_them_with_one_line_and_leaves_nothing(tmp_path, dcp_ckpt, how, code, line):
    script = _SIGNALLED_WORKERS.format(how=how, src=str(dcp_ckpt), dst=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=120)
    assert (proc.returncode, proc.stderr) == (code, line)  # the parent's line alone: workers say nothing
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_convert_distributed_without_a_process_group_is_refused(tmp_path, full_ckpt):
    with pytest.raises(UsageError, match="no.*process group|none: call torch.distributed.init_process_group"):
        ckptkit.convert(full_ckpt, tmp_path / "out", to="sharded", distributed=True)


# ------------------------------------------------------------------------------------------ torchrun


def test_torchrun_two_ranks_reshard_byte_identical_to_one_process(tmp_path, dcp_ckpt):
    ckptkit.reshard(dcp_ckpt, tmp_path / "one", world_size=3)
    # A machine's CKPTKIT_WORKERS does not apply under torchrun, whose ranks split the files.
    proc = torchrun(2, "reshard", dcp_ckpt, tmp_path / "two", "--world-size", "3", env={"CKPTKIT_WORKERS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("(sharded for 3 ranks)") == 1  # rank 0 reports, alone
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")
    assert leftovers(tmp_path) == []


def test_torchrun_three_ranks_export_hf_byte_identical_to_one_process(tmp_path, full_ckpt):
    ckptkit.export_hf(full_ckpt, tmp_path / "one", dtype="bf16", max_shard_size=100)
    proc = torchrun(3, "export-hf", full_ckpt, tmp_path / "three", "--dtype", "bf16", "--max-shard-size", "100",
                    "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert files_of(tmp_path / "three") == files_of(tmp_path / "one")
    model = load_full(full_ckpt)["model"]
    assert load_hf(tmp_path / "three").keys() == model.keys()


def test_torchrun_failure_on_a_rank_fails_every_rank_with_one_line(tmp_path, dcp_ckpt):
    src = truncated_copy(dcp_ckpt, tmp_path / "cut")
    proc = torchrun(2, "reshard", src, tmp_path / "out", "--world-size", "3")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ckptkit: error: ")]
    assert len(errors) == 2 and all("__1_0.distcp" in e for e in errors), proc.stderr[-3000:]
    # torchrun's own report of the failed ranks, but no traceback through ckptkit's code (wherever the clone is)
    package = Path(ckptkit.__file__).resolve().parent
    frames = [Path(f).resolve() for f in re.findall(r'File "([^"]+)", line \d+', proc.stderr)]
    assert not [f for f in frames if f.is_relative_to(package)], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------ save hooks


def _failures_on_one_rank(rank: int, world: int, good: str, cut: str, tmp: str) -> list[str]:
    """Two jobs on every rank; rank 1 fails in each, once while writing, once before. What each rank raised."""
    out = []
    jobs = [lambda: ckptkit.reshard(good if rank == 0 else cut, Path(tmp) / "resharded", world_size=3,
                                    distributed=True),
            lambda: ckptkit.export_hf(good if rank == 0 else Path(tmp) / "missing", Path(tmp) / "hf",
                                      distributed=True)]
    for job in jobs:
        try:
            job()
            out.append("no error")
        except ckptkit.CheckpointError as e:
            out.append(str(e))
    return out


def test_export_hf_distributed_error_on_one_rank_fails_every_rank(tmp_path, dcp_ckpt):
    cut = truncated_copy(dcp_ckpt, tmp_path / "cut")
    rank0, rank1 = run_ranks(_failures_on_one_rank, 2, str(dcp_ckpt), str(cut), str(tmp_path), timeout=120)
    # Writing: rank 0 wrote its share, then failed with rank 1.
    assert "__1_0.distcp" in rank1[0] and rank0[0].startswith("rank 1: ") and "__1_0.distcp" in rank0[0]
    # Before writing: rank 1 could not read its source; rank 0 did not wait for it.
    assert "missing" in rank1[1] and rank0[1].startswith("rank 1: ") and "missing" in rank0[1]
    assert not (tmp_path / "resharded").exists() and not (tmp_path / "hf").exists()
    assert leftovers(tmp_path) == []

"""--workers on a checkpoint of many small chunks (a mixture of experts with AdamW state) and on one large output
file: byte-identical output for every worker count, a file cut between writers (workers and torchrun ranks),
workers that plan nothing and import no torch, how ``auto`` chooses, and kills that leave DST absent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_tensor_identical, leftovers, load_dcp, load_hf, random_bits
from ckptkit.core import split
from ckptkit.core.split import Work, choose_writers
from ckptkit.harness.launch import run_ranks
from ckptkit.io import parallel
from ckptkit.io.storage.local import writer

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
SMALL_PIECE = 4096  # bytes: files of a few hundred KiB are then cut between writers


def moe_model(layers: int = 2, experts: int = 8, dim: int = 32, ffn: int = 8, vocab: int = 64) -> dict:
    """A mixture-of-experts model, flat keys, bf16 random bits (each expert its own three matrices)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, dim), "lm_head.weight": (vocab, dim), "model.norm.weight": (dim,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + f"self_attn.{n}_proj.weight": (dim, dim) for n in "qkvo"}
        shapes[p + "mlp.gate.weight"] = (experts, dim)
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": (ffn, dim), q + "up_proj.weight": (ffn, dim),
                       q + "down_proj.weight": (dim, ffn)}
    return {k: random_bits(s, torch.bfloat16, g) for k, s in shapes.items()}


def with_adamw(model: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    state = dict(model)
    for k, t in model.items():
        state |= {f"optim.{k}.exp_avg": random_bits(t.shape, torch.bfloat16, g),
                  f"optim.{k}.exp_avg_sq": random_bits(t.shape, torch.bfloat16, g),
                  f"optim.{k}.step": torch.tensor(3.0)}
    return state


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    """The MoE model as one ``torch.save`` file, and model + AdamW state as a 4-rank DCP (saved once)."""
    root = tmp_path_factory.mktemp("moe")
    model = moe_model()
    state = with_adamw(model)
    torch.save(model, root / "model.pt")
    torch.save(state, root / "state.pt")
    ckptkit.convert(root / "state.pt", root / "dcp4", to="sharded", world_size=4)
    return {"model": model, "state": state, "model.pt": root / "model.pt", "dcp": root / "dcp4"}


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def packed(monkeypatch) -> list[tuple[str, int, int]]:
    """Files are cut from SMALL_PIECE bytes; the (file, start, bytes) of each slice handed to a worker process."""
    monkeypatch.setattr(split, "MIN_PIECE", SMALL_PIECE)
    seen: list[tuple[str, int, int]] = []
    real = parallel.pack
    monkeypatch.setattr(parallel, "pack", lambda s, cap: seen.append((s.relpath, s.start, s.nbytes)) or real(s, cap))
    return seen


def test_reshard_moe_is_byte_identical_for_every_workers_value(tmp_path, moe, packed):
    ckptkit.reshard(moe["dcp"], tmp_path / "w1", world_size=3, workers=1)
    want = files_of(tmp_path / "w1")
    for workers in (2, 3, "auto"):
        report = ckptkit.reshard(moe["dcp"], tmp_path / f"w{workers}", world_size=3, workers=workers)
        assert files_of(tmp_path / f"w{workers}") == want, workers
        assert report.workers >= 1 and report.workers_why
    assert packed and all(start == 0 for _, start, _ in packed)  # whole rank files, each in one writer's hands
    got = load_dcp(tmp_path / "w3", tmp_path / "scratch.pt")
    assert got.keys() == moe["state"].keys()
    for k, t in moe["state"].items():
        assert_tensor_identical(got[k], t, k)
    assert leftovers(tmp_path) == []


def test_export_hf_cast_of_one_file_split_across_workers_is_byte_identical(tmp_path, moe, packed):
    # A cast is work outside the write, which writers of one file share; the writes themselves take turns.
    ckptkit.export_hf(moe["model.pt"], tmp_path / "one", dtype="fp16", workers=1)
    report = ckptkit.export_hf(moe["model.pt"], tmp_path / "three", dtype="fp16", workers=3)
    assert sorted(files_of(tmp_path / "three")) == ["model.safetensors"] and report.workers == 3  # one output file...
    assert any(start > 0 for name, start, _ in packed if name == "model.safetensors")  # ...in several writers' hands
    assert files_of(tmp_path / "three") == files_of(tmp_path / "one")
    got = load_hf(tmp_path / "three")
    assert got.keys() == moe["model"].keys()
    for k, t in moe["model"].items():
        assert_tensor_identical(got[k], t.half(), k)


def test_export_hf_of_one_file_of_copied_bytes_is_written_by_one_process_whatever_workers_asks(tmp_path, moe,
                                                                                                packed):
    # Two processes writing one file take turns at its lock, each paying its start: one writes it alone.
    report = ckptkit.export_hf(moe["model.pt"], tmp_path / "two", workers=2)
    assert packed == [] and report.workers == 1, report.workers_why  # no share handed to a worker process
    assert report.workers_why == ("--workers 2: 1 file of copied bytes, and a file is written by one process (two "
                                  "would take turns at its lock)")
    ckptkit.export_hf(moe["model.pt"], tmp_path / "one", workers=1)
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")


def _export_on_rank(rank: int, world: int, src: str, dst: str) -> list[int]:
    """One rank of a distributed export-hf whose single output file is cut between the ranks; the byte offsets
    of the slices this rank wrote."""
    split.MIN_PIECE = SMALL_PIECE
    starts: list[int] = []
    real = writer.write_descriptors
    writer.write_descriptors = lambda share, *a, **k: starts.extend(s.start for s in share) or real(share, *a, **k)
    ckptkit.export_hf(src, dst, distributed=True)
    return starts


def test_export_hf_distributed_cuts_one_file_between_ranks_byte_identical(tmp_path, moe):
    ckptkit.export_hf(moe["model.pt"], tmp_path / "one")
    starts = run_ranks(_export_on_rank, 2, str(moe["model.pt"]), str(tmp_path / "two"), timeout=120)
    assert all(starts) and min(starts[0] + starts[1]) == 0 and max(starts[0] + starts[1]) > 0  # both wrote the file
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("nbytes, regions, cores, n", [
    (8 * 10**9, 100, 16, 16),  # 4 s of copying: every core writes, 0.65 s in all
    (2 * 10**9, 588, 16, 5),  # 1 s (a dense 2 GB model): five writers of a fifth of a second each
    (2 * 10**9, 588, 2, 1),  # the same on two cores: 0.9 s against 1 s is within the margin
    (6 * 10**9, 200, 2, 2),  # capped by the cores
    (10**8, 50, 16, 1),  # 0.05 s: a second process would cost more than it saves
    (13 * 10**8, 20_000, 16, 1),  # a MoE of many small chunks: their planning stays with the packer
    (8 * 10**9, 100, 1, 1),  # one core
])
def test_choose_writers_weighs_bytes_regions_and_cores(nbytes, regions, cores, n):
    got, why = choose_writers(Work(nbytes, regions, files=2, pieces=1000), cores)
    assert got == n, why
    assert f"{nbytes / 1e9:.2f} GB in 2 files, {regions} tensor regions" in why


def test_choose_writers_never_more_than_the_pieces_to_write():
    assert choose_writers(Work(4 * 10**9, 0, files=2, pieces=2), 16)[0] == 2


def test_choose_writers_gives_copied_bytes_one_writer_when_they_do_not_fit_in_free_memory():
    # A page cache full of earlier outputs: every page written is reclaimed first, and writers take turns at it.
    copies = Work(8 * 10**9, 100, files=8, pieces=8, copies=True)
    n, why = choose_writers(copies, 16, free=10**9)
    assert n == 1 and "page cache is full (1.00 GB of memory free)" in why, why
    assert choose_writers(copies, 16, free=16 * 10**9)[0] == 8  # room for them: as many writers as pay
    assert choose_writers(copies, 16)[0] == 8  # free memory unknown
    assert choose_writers(Work(8 * 10**9, 100, files=8, pieces=8), 16, free=10**9)[0] == 8  # a cast: CPU work


# ------------------------------------------------------------------------------------------ worker processes


_SPIED_WORKERS = """
import json, multiprocessing, os, sys
from ckptkit.io.storage.local import writer
OUT, SRC, DST, HOW = {out!r}, {src!r}, {dst!r}, {how!r}
opened = []
real_open, real_write = os.open, writer.write_descriptors
def spy_open(path, *args, **kwargs):
    opened.append(str(path))
    return real_open(path, *args, **kwargs)
def write_slices(share, *args, **kwargs):
    worker = multiprocessing.current_process().name
    if HOW == "kill the parent" and worker == "MainProcess":
        os.kill(os.getpid(), 9)  # the workers are started and writing
    if HOW == "kill a worker" and worker == "ckptkit-worker-2":  # once it has written a slice
        kwargs["progress"] = lambda n: os.kill(os.getpid(), 9)
    os.open = spy_open
    real_write(share, *args, **kwargs)
    os.open = real_open
    if worker != "MainProcess":
        with open(OUT + "." + worker.removeprefix("ckptkit-"), "w") as f:
            json.dump({{"torch": "torch" in sys.modules, "opened": opened}}, f)
writer.write_descriptors = write_slices
if __name__ == "__main__":
    from ckptkit import cli
    cli.main(["reshard", SRC, DST, "--world-size", "3", "--workers", "3", "-q"])
"""


def spied_reshard(tmp_path: Path, src: Path, dst: Path, how: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / f"spied{len(how)}.py"  # a file, which spawned workers import as their __mp_main__
    script.write_text(_SPIED_WORKERS.format(out=str(tmp_path / "spy"), src=str(src), dst=str(dst), how=how))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=180)


def test_workers_plan_nothing_read_no_metadata_and_import_no_torch(tmp_path, moe):
    proc = spied_reshard(tmp_path, moe["dcp"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    seen = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("spy.worker-*"))]
    assert len(seen) == 2  # the parent writes the first share itself
    for worker in seen:
        assert worker["torch"] is False
        assert str(moe["dcp"] / ".metadata") not in worker["opened"]
        assert any(p.startswith(str(moe["dcp"])) for p in worker["opened"])  # it did read the rank files
    ckptkit.reshard(moe["dcp"], tmp_path / "one", world_size=3)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "one")


def test_worker_killed_mid_run_fails_with_one_line_and_leaves_nothing(tmp_path, moe):
    proc = spied_reshard(tmp_path, moe["dcp"], tmp_path / "out", "kill a worker")
    assert proc.returncode == 2
    assert proc.stderr == "ckptkit: error: worker process ckptkit-worker-2 died (exit code -9) before writing its " \
                          "files\n"
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_parent_killed_mid_run_leaves_dst_absent_and_the_next_run_cleans_up(tmp_path, moe):
    proc = spied_reshard(tmp_path, moe["dcp"], tmp_path / "out", "kill the parent")
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "out").exists()
    again = spied_reshard(tmp_path, moe["dcp"], tmp_path / "out")
    assert again.returncode == 0, again.stderr
    assert leftovers(tmp_path) == []
    ckptkit.reshard(moe["dcp"], tmp_path / "one", world_size=3)
    assert files_of(tmp_path / "out") == files_of(tmp_path / "one")

"""``bin/bench chunks`` and ``bin/bench metadata``: ckptkit's costs per chunk and per ``.metadata`` byte, timed
in this process (reading, planning and executing a DCP of many tiny chunks; the unpickler's opcode guard)."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import click

from ckptkit.formats.dcp import DcpOptions

from .shapes import write_dcp
from .table import cores

__all__ = ["bench_chunks", "bench_metadata"]


def bench_chunks(chunks: int, repeat: int, root: Path) -> None:
    """Read, plan and execute a DCP of about ``chunks`` chunks of 16 bytes each, timed in this process."""
    from ckptkit.formats.dcp import DcpIO
    from ckptkit.formats.hf import HfIO, HfOptions
    from ckptkit.io.storage.local.writer import write_files

    ranks = 64
    tensors = [(f"model.layers.{i // 9}.{_PARTS[i % 9]}.weight", (ranks, 8), "bfloat16")
               for i in range(max(1, chunks // ranks))]
    write_dcp(root, tensors, world_size=ranks)
    src = root / "dcp"
    n = len(tensors) * ranks
    reads, plans, runs = [], {"export-hf": [], "reshard": []}, {"export-hf": [], "reshard": []}
    for _ in range(repeat):
        t = time.perf_counter()
        manifest = DcpIO().read(src)
        reads.append(time.perf_counter() - t)
        assert sum(len(e.chunks) for e in manifest.tensors) == n
        for name, fmt, options in (("export-hf", HfIO(), HfOptions()),
                                   ("reshard", DcpIO(), DcpOptions(world_size=ranks))):
            t = time.perf_counter()
            plan = fmt.plan(manifest, options)
            plans[name].append(time.perf_counter() - t)
            out = root / "out"
            out.mkdir()
            t = time.perf_counter()
            write_files(plan.files, out)
            runs[name].append(time.perf_counter() - t)
            shutil.rmtree(out)
    meta_mb = (src / ".metadata").stat().st_size / 1e6
    click.echo(f"DCP of {len(tensors)} tensors x {ranks} ranks = {n} chunks of 16 bytes (.metadata {meta_mb:.1f} MB); "
               f"{cores()} cores; median of {repeat} runs, in-process")
    click.echo(f"{'step':<46} {'s':>8} {'us/chunk':>9} {'s per 1M chunks':>16}")

    def line(name: str, times: list[float]) -> None:
        m = statistics.median(times)
        click.echo(f"{name:<46} {m:8.2f} {m * 1e6 / n:9.2f} {m * 1e6 / n:16.1f}")

    line("read (.metadata + every chunk's archive)", reads)
    for name in plans:
        line(f"{name}: plan", plans[name])
        line(f"{name}: execute", runs[name])
        line(f"{name}: read + plan + execute",
             [r + p + e for r, p, e in zip(reads, plans[name], runs[name], strict=True)])


_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def bench_metadata(tensors: int, repeat: int, root: Path) -> None:
    """The cost of reading a large DCP ``.metadata`` and of the opcode walk that guards the unpickler in it.

    ckptkit's own DCP writer lays out ``tensors`` LLaMA-named tensors for 4 ranks (shape 8 x 4, so each has
    4 chunks; the tensor bytes are tiny, the metadata is what a real model's would be); then the opcode walk
    alone and the whole allow-list unpickle (which runs the walk first) are timed, median of ``repeat``.
    """
    from ckptkit.codecs.pickle_read import SafeUnpickler, check_opcodes
    from ckptkit.formats.dcp import METADATA_GLOBALS

    write_dcp(root, [(f"model.layers.{i // len(_PARTS)}.{_PARTS[i % len(_PARTS)]}.weight", (8, 4), "bfloat16")
                     for i in range(tensors)])
    data = (root / "dcp" / ".metadata").read_bytes()
    chunks = 4 * tensors
    walk, load = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        check_opcodes(data, "bench")
        walk.append(time.perf_counter() - t)
        t = time.perf_counter()
        SafeUnpickler(data, METADATA_GLOBALS, where="bench").load_checked()
        load.append(time.perf_counter() - t)
    mb = len(data) / 1e6
    click.echo(f".metadata of {tensors} tensors x 4 ranks ({chunks} chunks), {mb:.1f} MB; {cores()} cores; "
               f"median of {repeat} runs")
    for name, times in (("opcode walk (the guard)", walk), ("allow-list unpickle, guard included", load)):
        m = statistics.median(times)
        click.echo(f"{name:<38} {m * 1e3:8.1f} ms {m * 1e3 / mb:7.1f} ms/MB {m * 1e6 / chunks:7.2f} us/chunk")

"""The ``bin/bench`` command line: one subcommand per mode, each in a temporary directory of its own."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from ckptkit.ops.convert import parse_size

from .runner import PAGE_CACHE

__all__ = ["main"]


@contextlib.contextmanager
def _workdir(workdir: Path | None) -> Iterator[Path]:
    """A fresh directory for one run (under ``workdir`` if given), removed afterwards."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckptkit-bench-", dir=workdir))
    # transformers' answers (the class check) are cached by the untimed first run, in the bench's own directory
    os.environ["CKPTKIT_CACHE_DIR"] = str(root / "cache")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _common(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--repeat`` and ``--workdir``; the command gets ``root``, its working directory."""
    @click.option("--repeat", default=3, show_default=True, type=click.IntRange(min=1),
                  help="Runs per contender (median).")
    @click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
                  help="Where to write (default: a temp dir).")
    @functools.wraps(f)
    def run(*args: Any, workdir: Path | None, **kwargs: Any) -> None:
        with _workdir(workdir) as root:
            f(*args, root=root, **kwargs)

    return run


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    return parse_size(value, f"--{param.name}")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Time ckptkit against cp of the same bytes (and torch's own path) on synthetic checkpoints."""


@main.command()
@click.option("--shape", type=click.Choice(["dense", "moe", "moe-titan", "tp", "megatron", "megatron-moe", "fp8"]),
              default="dense", show_default=True, help="Which checkpoint (see benchkit/convert.py).")
@click.option("--size", default="2GB", show_default=True, callback=_size,
              help="Approximate size of the dense, tp, megatron and fp8 checkpoints.")
@click.option("--layers", default=8, show_default=True, type=click.IntRange(min=1), help="MoE shapes: layers.")
@click.option("--world-size", default=3, show_default=True, type=click.IntRange(min=1),
              help="Ranks reshard writes; at 8 or more the export from that output is timed and checked too.")
@click.option("--workers", default="1,auto", show_default=True,
              help="Time ckptkit with each of these --workers values (a count or auto), e.g. 1,2,auto.")
@click.option("--skip-torch", is_flag=True, help="Leave out the torch path (it needs ~1.1x the size in RAM).")
@click.option("--fsync", "with_fsync", is_flag=True, help="Also time export-hf --fsync.")
@click.option("--checksums", is_flag=True,
              help="Give the checkpoint a ckptkit.json (as ckptkit.save does) and also time export-hf "
                   "--no-verify-checksums: the cost of checking it.")
@click.option("--page-cache", type=click.Choice(PAGE_CACHE), default="warm", show_default=True,
              help="full: each run writes while the previous output of the same row is still on disk.")
@_common
def convert(shape: str, size: int, layers: int, world_size: int, workers: str, skip_torch: bool, with_fsync: bool,
            checksums: bool, page_cache: str, repeat: int, root: Path) -> None:
    """export-hf and reshard (and the way back, for some shapes) against cp -r and torch."""
    from .convert import convert as run

    run(shape, size, layers, world_size, workers, repeat, skip_torch, with_fsync, checksums, page_cache, root)


@main.command()
@click.option("--size", default="1GB", show_default=True, callback=_size,
              help="Bytes of the training state (float32 weights and AdamW's two moments).")
@click.option("--saves", default=3, show_default=True, type=click.IntRange(min=1),
              help="Saves timed in each training process (after an untimed first).")
@_common
def save(size: int, saves: int, repeat: int, root: Path) -> None:
    """ckptkit.save in a training loop against dcp.save of the same state."""
    from .save import bench_save

    bench_save(size, saves, repeat, root)


@main.command()
@click.option("--size", default="2GB", show_default=True, callback=_size, help="The dense checkpoint's size.")
@click.option("--save-size", default="1GB", show_default=True, callback=_size, help="The save rows' state.")
@_common
def targets(size: int, save_size: int, repeat: int, root: Path) -> None:
    """Every row the speed targets are stated for, each against its baseline, and a summary."""
    from .targets import targets as run

    run(size, save_size, repeat, root)


@main.command()
@click.argument("count", type=click.IntRange(min=1000))
@_common
def chunks(count: int, repeat: int, root: Path) -> None:
    """Per-chunk costs: read, plan and execute a DCP of about COUNT chunks, in this process."""
    from .inprocess import bench_chunks

    bench_chunks(count, repeat, root)


@main.command()
@click.argument("tensors", type=click.IntRange(min=1))
@_common
def metadata(tensors: int, repeat: int, root: Path) -> None:
    """The read of a .metadata of TENSORS tensors x 4 ranks, and its opcode guard."""
    from .inprocess import bench_metadata

    bench_metadata(tensors, repeat, root)


@main.command()
@click.option("--size", default="512MB", show_default=True, callback=_size, help="The dense checkpoint's size.")
@_common
def s3(size: int, repeat: int, root: Path) -> None:
    """From and to S3 (moto's server on loopback) against local paths and s3fs."""
    from .shapes import llama_shapes, write_dcp
    from .storage import bench_storage

    total = write_dcp(root, [(k, s, "bfloat16") for k, s in llama_shapes(size)])
    bench_storage(root / "dcp", total, repeat, root)

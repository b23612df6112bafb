"""``bin/bench targets``: the rows the speed targets of ``docs/benchmarks.md`` are stated for, each against its
baseline measured in the same run, and a summary of the ratios beside the targets.

1. ``ckptkit.save`` in a training loop against ``dcp.save`` of the same state (:mod:`.save`);
2. the MoE reshard (8 layers of 64 experts with AdamW: 6,380 tensors, 20,735 chunks) against ``cp -r``;
3. the dense LLaMA-shaped DCP (``--size``), ``export-hf --workers 2`` and ``auto`` against ``--workers 1``, each
   run writing while the previous output of the same row is still on disk (``--page-cache full``);
4. ``export-hf --dtype fp8 --workers auto`` of that DCP (its ``config.json`` as ``--hf-assets``) against ``cp -r``;
5. the import of that FP8 folder (``convert --to sharded``, dequantizing; ``--dtype bf16`` where ``convert``
   takes it) against ``cp -r`` of the folder;
6. ``export-hf`` of the dense DCP with a ``ckptkit.json`` (its checksums checked as it streams) against the same
   with ``--no-verify-checksums``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click

from . import shapes as S
from .runner import Row, ckptkit_command, compiled, cp, remove, run, time_rows, warm
from .save import save_ratio
from .table import load, median, table

__all__ = ["targets"]


def targets(size: int, save_size: int, repeat: int, root: Path) -> None:
    compiled()
    summary: list[tuple[str, str, str, bool]] = []
    rows, ratio = save_ratio(save_size, 3, repeat, root)
    click.echo(f"1. ckptkit.save {rows[1][1]:.2f} s against dcp.save {rows[0][1]:.2f} s a save: {ratio:.2f}x")
    summary.append(("ckptkit.save against dcp.save", f"{ratio:.2f}x", "<= 1.15x", ratio <= 1.15))
    summary.append(_moe(repeat, root / "moe"))
    summary += _dense(size, repeat, root / "dense")
    click.echo(f"\nsummary (load {load()})")
    click.echo(f"{'what':<52} {'measured':>18} {'target':>24}  met")
    for what, measured, target, met in summary:
        click.echo(f"{what:<52} {measured:>18} {target:>24}  {'yes' if met else 'no'}")


def _moe(repeat: int, root: Path) -> tuple[str, str, str, bool]:
    root.mkdir()
    tensors = S.with_adamw(S.moe_shapes(8))
    total = S.write_dcp(root, tensors)
    src = root / "dcp"
    rows = [cp(src), Row("ckptkit reshard -> 3", lambda out: ckptkit_command(
        "reshard", str(src), str(out), "--world-size", "3", "-q"), src)]
    warm(src)
    time_rows(rows, repeat, root)
    table(rows, total, repeat, f"2. {total / 1e9:.2f} GB MoE, 8 layers x 64 experts with AdamW, {len(tensors)} tensors")
    ratio = median(rows[1]) / median(rows[0])
    return "MoE reshard -> 3 against cp -r", f"{ratio:.2f}x, {_rss(rows[1])} MB", "<= 1.5x, < 100 MB", \
        ratio <= 1.5 and _rss(rows[1]) < 100


def _dense(size: int, repeat: int, root: Path) -> list[tuple[str, str, str, bool]]:
    root.mkdir()
    shapes = S.llama_shapes(size)
    total = S.write_dcp(root, [(k, s, "bfloat16") for k, s in shapes])
    src, assets, fp8 = root / "dcp", root / "assets", root / "fp8"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(S.llama_config(shapes)))
    what = f"{total / 1e9:.2f} GB bf16, LLaMA-shaped, 4-rank DCP"
    out: list[tuple[str, str, str, bool]] = []
    rows = [cp(src)] + [Row(f"ckptkit export-hf --workers {w}", lambda o, w=w: ckptkit_command(
        "export-hf", str(src), str(o), "-q", "--workers", w), src) for w in ("1", "2", "auto")]
    warm(src)
    time_rows(rows, repeat, root, "full")
    table(rows, total, repeat, f"3. {what}", "full")
    for row in rows[2:]:
        ratio = median(row) / median(rows[1])
        out.append((f"export-hf {row.name.rsplit(' ', 1)[-1]} against 1, page cache full", f"{ratio:.2f}x",
                    "<= 1.10x", ratio <= 1.10))
    rows = [cp(src), Row("ckptkit export-hf --dtype fp8 --workers auto", lambda o: ckptkit_command(
        "export-hf", str(src), str(o), "-q", "--dtype", "fp8", "--workers", "auto", "--hf-assets", str(assets)), src,
        keep=fp8)]
    run(rows[1].cmd(root / "first"), root / "stderr.log")  # untimed: caches transformers' answer for the class
    remove(root / "first")  # check, which a first export of a model pays once (see "FP8 both ways")
    time_rows(rows, repeat, root)
    table(rows, total, repeat, f"4. {what} -> FP8 HF")
    out.append(_against_cp("FP8 export-hf against cp -r", rows, "<= 4x, < 100 MB", 4))
    dtype = ["--dtype", "bf16"] if "--dtype" in _help("convert") else []
    rows = [cp(fp8), Row(f"ckptkit convert --to sharded {' '.join(dtype)}".rstrip(), lambda o: ckptkit_command(
        "convert", str(fp8), str(o), "-q", "--to", "sharded", "--world-size", "4", *dtype), fp8)]
    warm(fp8)
    time_rows(rows, repeat, root)
    table(rows, sum(p.stat().st_size for p in fp8.iterdir()), repeat, "5. that FP8 HF folder -> 4-rank DCP")
    out.append(_against_cp(f"FP8 import{' to bf16' if dtype else ' (float32)'} against cp -r", rows,
                           "<= 4x, < 100 MB", 4))
    S.with_checksums(src)
    rows = [cp(src)] + [Row(f"ckptkit export-hf {how}".rstrip(), lambda o, h=how: ckptkit_command(
        "export-hf", str(src), str(o), "-q", *h.split()), src) for how in ("", "--no-verify-checksums")]
    time_rows(rows, repeat, root)
    table(rows, total, repeat, f"6. {what}, with ckptkit.json")
    ratio = median(rows[1]) / median(rows[2])
    out.append(("export-hf checking checksums against not", f"{ratio:.2f}x", "(the cost of the checks)", True))
    return out


def _against_cp(what: str, rows: list[Row], target: str, most: float) -> tuple[str, str, str, bool]:
    ratio = median(rows[1]) / median(rows[0])
    return what, f"{ratio:.2f}x, {_rss(rows[1])} MB", target, ratio <= most and _rss(rows[1]) < 100


def _rss(row: Row) -> int:
    return round(max(r for _, r in row.runs) / 2**20)


def _help(command: str) -> str:
    return subprocess.run([sys.executable, "-m", "ckptkit", command, "--help"], capture_output=True, text=True).stdout

"""``bin/bench s3``: throughput from and to S3 (moto's server on loopback) against local paths and against s3fs
moving the same bytes."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import click

from .runner import run
from .table import cores

__all__ = ["bench_storage"]


# What the S3 rows compare with: s3fs moving the same objects, with nothing between it and the server.
_S3FS_COPY = """
import sys, s3fs
how, src, dst = sys.argv[1:]
getattr(s3fs.S3FileSystem(), how)(src, dst, recursive=True)
"""


def bench_storage(src: Path, total: int, repeat: int, root: Path) -> None:
    """Throughput from and to S3 against local: moto's S3 server on loopback, started in this process (so its
    CPU is not in the rows' RSS, but shares the machine's cores), s3fs as every row's client. Each contender runs
    as its own process ``repeat`` times; the table shows the median, and ratios against the local run of the
    same command and against s3fs moving the same bytes the same way."""
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise click.ClickException(f"--storage s3 needs s3fs and moto[server] (the test extras): {e}") from None
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://{host}:{port}")
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("bench")
        fs.put(str(src), "bench/dcp", recursive=True)
        remote, out_url, out = "s3://bench/dcp", "s3://bench/out", root / "out"
        ckptkit = [sys.executable, "-m", "ckptkit"]
        copy = [sys.executable, "-c", _S3FS_COPY]
        contenders = {  # name: (command, the same command on local paths or None, s3fs's row to compare with)
            "local: ckptkit export-hf": ([*ckptkit, "export-hf", str(src), str(out), "-q"], None, None),
            "local: ckptkit reshard -> 3": ([*ckptkit, "reshard", str(src), str(out), "--world-size", "3", "-q"],
                                            None, None),
            "S3 -> local: s3fs get -r (same bytes)": ([*copy, "get", remote, str(out)], None, None),
            "S3 -> local: ckptkit export-hf": ([*ckptkit, "export-hf", remote, str(out), "-q"],
                                               "local: ckptkit export-hf", "S3 -> local: s3fs get -r (same bytes)"),
            "local -> S3: s3fs put -r (same bytes)": ([*copy, "put", str(src), out_url], None, None),
            "local -> S3: ckptkit export-hf": ([*ckptkit, "export-hf", str(src), out_url, "-q"],
                                               "local: ckptkit export-hf", "local -> S3: s3fs put -r (same bytes)"),
            "S3 -> S3: ckptkit reshard -> 3": ([*ckptkit, "reshard", remote, out_url, "--world-size", "3", "-q"],
                                               "local: ckptkit reshard -> 3", None),
        }
        subprocess.run(["cat", *map(str, src.iterdir())], stdout=subprocess.DEVNULL, check=True)  # warm the cache
        walls = {}
        click.echo(f"checkpoint: {total / 1e9:.2f} GB bf16, LLaMA-shaped, 4-rank DCP; {cores()} cores; "
                   f"S3 is moto on loopback; median of {repeat} runs")
        click.echo(f"{'what':<40} {'wall s':>7} {'GB/s':>6} {'peak RSS MB':>12} {'x local':>8} {'x s3fs':>7}")
        for name, (cmd, local, same_bytes) in contenders.items():
            runs = []
            for _ in range(repeat):
                runs.append(run(cmd, root / "stderr.log"))
                shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
                if fs.exists(out_url):
                    fs.rm(out_url, recursive=True)
            walls[name] = wall = statistics.median(w for w, _ in runs)
            vs_local = f"{wall / walls[local]:.2f}" if local else "-"
            vs_s3fs = f"{wall / walls[same_bytes]:.2f}" if same_bytes else "-"
            click.echo(f"{name:<40} {wall:7.2f} {total / wall / 1e9:6.2f} {max(r for _, r in runs) / 2**20:12.0f} "
                       f"{vs_local:>8} {vs_s3fs:>7}")
    finally:
        server.stop()

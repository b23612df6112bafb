"""``bin/bench``: ckptkit against ``cp`` and against the path users take today, on one synthetic checkpoint.

A LLaMA-shaped bf16 state dict of about ``--size`` bytes (random bits; the shapes are what matter) is
written as a 4-rank DCP checkpoint, FSDP2-style ``Shard(0)``. Each contender then runs as its own process,
``--repeat`` times on a warm page cache; the table shows median wall time and the peak RSS of that
process (``os.wait4``; every row includes a ~9 MB floor, see ``_RUNNER``), and ratios against ``cp`` and the torch path.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Chunk, Format, Manifest, Span, TensorEntry
from ckptkit.formats import io_for
from ckptkit.formats.dcp import DcpOptions
from ckptkit.io.execute import execute
from ckptkit.ops.convert import parse_size

__all__ = ["main"]

_TORCH_PATH = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, tmp, out = sys.argv[1:]
dcp_to_torch_save(src, tmp)
save_file(torch.load(tmp, weights_only=True), out)
"""


def llama_shapes(target: int, dim: int = 2048, ffn: int = 5632,
                 vocab: int = 32000) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a LLaMA with as many layers as fit in ``target`` bf16 bytes."""
    per_layer = 2 * (4 * dim * dim + 3 * dim * ffn + 2 * dim)
    layers = max(1, (target - 2 * 2 * vocab * dim) // per_layer)
    shapes = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{n}_proj.weight", (dim, dim)) for n in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (ffn, dim)), (p + "mlp.up_proj.weight", (ffn, dim)),
                   (p + "mlp.down_proj.weight", (dim, ffn))]
        shapes += [(p + "input_layernorm.weight", (dim,)), (p + "post_attention_layernorm.weight", (dim,))]
    return shapes + [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]


def make_checkpoint(root: Path, size: int, world_size: int = 4) -> int:
    """Write the synthetic checkpoint as DCP under ``root / 'dcp'``; return its tensor bytes."""
    bf16 = by_name("bfloat16")
    shapes = llama_shapes(size)
    total = sum(2 * _numel(s) for _, s in shapes)
    raw = root / "random.bin"
    block = os.urandom(64 << 20)
    with open(raw, "wb") as f:
        for start in range(0, total, len(block)):
            f.write(block[: min(len(block), total - start)])
    tensors, pos = [], 0
    for key, shape in shapes:
        n = 2 * _numel(shape)
        chunk = Chunk((0,) * len(shape), shape, Span(str(raw), pos, n))
        tensors.append(TensorEntry(key, (key,), bf16, shape, (chunk,)))
        pos += n
    manifest = Manifest(Format.FULL, str(raw), tuple(tensors))
    execute(io_for(Format.SHARDED).plan(manifest, DcpOptions(world_size=world_size)), root / "dcp", fsync=False)
    raw.unlink()
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# Runs one command and prints "wall_seconds peak_rss_bytes". A process inherits, as its RSS high-water mark,
# the RSS of whoever exec'd it; this runner is a bare interpreter (~9 MB), so every row carries that floor
# rather than the ~100 MB of this benchmark process.
_RUNNER = """
import os, sys, time
t = time.perf_counter()
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ, file_actions=[
    (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
    (os.POSIX_SPAWN_OPEN, 2, sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)])
_, status, usage = os.wait4(pid, 0)
print(time.perf_counter() - t, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status))
"""


def _run(cmd: list[str], log: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS in bytes of ``cmd`` as a child process."""
    out = subprocess.run([sys.executable, "-S", "-c", _RUNNER, str(log), *cmd], capture_output=True, text=True,
                         check=True)
    wall, rss, code = out.stdout.split()
    if int(code) != 0:
        raise click.ClickException(f"{' '.join(cmd)} failed: {log.read_text()[-2000:]}")
    return float(wall), float(rss)


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

    bf16, shape = by_name("bfloat16"), (8, 4)
    raw = root / "random.bin"
    raw.write_bytes(os.urandom(64 * tensors))
    entries = []
    for i in range(tensors):
        key = f"model.layers.{i // len(_PARTS)}.{_PARTS[i % len(_PARTS)]}.weight"
        entries.append(TensorEntry(key, (key,), bf16, shape, (Chunk((0, 0), shape, Span(str(raw), 64 * i, 64)),)))
    manifest = Manifest(Format.FULL, str(raw), tuple(entries))
    execute(io_for(Format.SHARDED).plan(manifest, DcpOptions(world_size=4)), root / "dcp", fsync=False)
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
    click.echo(f".metadata of {tensors} tensors x 4 ranks ({chunks} chunks), {mb:.1f} MB; median of {repeat} runs")
    for name, times in (("opcode walk (the guard)", walk), ("allow-list unpickle, guard included", load)):
        m = statistics.median(times)
        click.echo(f"{name:<38} {m * 1e3:8.1f} ms {m * 1e3 / mb:7.1f} ms/MB {m * 1e6 / chunks:7.2f} us/chunk")


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
        ckptkit = [sys.executable, "-m", "ckptkit.cli"]
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
        click.echo(f"checkpoint: {total / 1e9:.2f} GB bf16, LLaMA-shaped, 4-rank DCP; S3 is moto on loopback; "
                   f"median of {repeat} runs")
        click.echo(f"{'what':<40} {'wall s':>7} {'GB/s':>6} {'peak RSS MB':>12} {'x local':>8} {'x s3fs':>7}")
        for name, (cmd, local, same_bytes) in contenders.items():
            runs = []
            for _ in range(repeat):
                runs.append(_run(cmd, root / "stderr.log"))
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


@click.command()
@click.option("--size", default="2GB", show_default=True, help="Approximate checkpoint size.")
@click.option("--repeat", default=3, show_default=True, type=click.IntRange(min=1), help="Runs per contender (median).")
@click.option("--skip-torch", is_flag=True, help="Leave out the torch path (it needs ~1.1x the size in RAM).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write (default: a temp dir).")
@click.option("--metadata-tensors", type=click.IntRange(min=1), default=None,
              help="Instead: time reading the .metadata of a DCP with this many tensors x 4 ranks, and its guard.")
@click.option("--storage", type=click.Choice(["local", "s3"]), default="local", show_default=True,
              help="s3: instead, throughput from and to S3 (moto's server on loopback) against local.")
def main(size: str, repeat: int, skip_torch: bool, workdir: Path | None, metadata_tensors: int | None,
         storage: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="ckptkit-bench-", dir=workdir))
    try:
        if metadata_tensors:
            bench_metadata(metadata_tensors, repeat, root)
            return
        total = make_checkpoint(root, parse_size(size, "--size"))
        src = root / "dcp"
        if storage == "s3":
            bench_storage(src, total, repeat, root)
            return
        ckptkit = [sys.executable, "-m", "ckptkit.cli"]
        contenders = {
            "cp -r (same bytes)": lambda out: ["cp", "-r", str(src), str(out)],
            "ckptkit export-hf": lambda out: [*ckptkit, "export-hf", str(src), str(out), "-q"],
            "ckptkit reshard -> 3": lambda out: [*ckptkit, "reshard", str(src), str(out), "--world-size", "3", "-q"],
            "ckptkit export-hf --fsync": lambda out: [*ckptkit, "export-hf", str(src), str(out), "-q", "--fsync"],
        }
        if not skip_torch:
            contenders["torch dcp_to_torch_save + save_file"] = lambda out: [
                sys.executable, "-c", _TORCH_PATH, str(src), str(root / "tmp.pt"), str(out)]
        subprocess.run(["cat", *map(str, src.iterdir())], stdout=subprocess.DEVNULL, check=True)  # warm the cache
        results = {}
        for name, cmd in contenders.items():
            runs = []
            for _ in range(repeat):
                out = root / "out"
                runs.append(_run(cmd(out), root / "stderr.log"))
                shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
                (root / "tmp.pt").unlink(missing_ok=True)
            results[name] = (statistics.median(w for w, _ in runs), max(r for _, r in runs))
        _table(results, total, repeat)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _table(results: dict[str, tuple[float, float]], total: int, repeat: int) -> None:
    cp = results["cp -r (same bytes)"][0]
    torch_path = results.get("torch dcp_to_torch_save + save_file", (None,))[0]
    click.echo(f"checkpoint: {total / 1e9:.2f} GB bf16, LLaMA-shaped, 4-rank DCP; median of {repeat} runs, warm cache")
    click.echo(f"{'what':<38} {'wall s':>7} {'GB/s':>6} {'peak RSS MB':>12} {'x cp':>6} {'x torch':>8}")
    for name, (wall, rss) in results.items():
        vs_torch = f"{wall / torch_path:.2f}" if torch_path else "-"
        click.echo(f"{name:<38} {wall:7.2f} {total / wall / 1e9:6.2f} {rss / 2**20:12.0f} {wall / cp:6.2f} "
                   f"{vs_torch:>8}")


if __name__ == "__main__":
    main()

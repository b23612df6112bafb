"""``bin/bench``: ckptkit against ``cp`` and against the path users take today, on synthetic checkpoints.

Shapes (``--shape``), each a bf16 checkpoint of random bits (the shapes are what matter), saved as 4-rank DCP:

- ``dense``: LLaMA-shaped (dim 2048, ffn 5632, vocab 32000), as many layers as fit in ``--size``, FSDP2-style
  ``Shard(0)`` chunks, laid out by ckptkit's own DCP writer.
- ``moe``: ``--layers`` layers of 64 experts (dim 1024, expert ffn 96, vocab 16000) with AdamW state (exp_avg,
  exp_avg_sq, and a float32 scalar step per parameter), ``Shard(0)`` chunks: tens of thousands of chunks.
- ``moe-titan``: a torchtitan 0.3 Qwen3-MoE, ``--layers`` layers (default 8) of 64 experts stacked per projection
  (``[experts, 512, 1536]``), model only, ``Shard(0)`` chunks, about 2.6 GB: ``export-hf`` splits the experts
  (``--preset auto``), and the reverse, ``convert --to sharded --preset torchtitan-qwen3-moe``, joins them back;
  each timed against the ``cp -r`` of its own input.
- ``megatron``: megatron-core's GPT names for a Llama (dim 2048, 16 heads in 4 query groups, ffn 5632, vocab
  32000), layer-stacked as ``torch_dist`` holds them, with ``common.pt`` (Megatron-LM's args) and
  ``metadata.json``, ``Shard(0)`` chunks laid out by ckptkit's writer; export-hf maps it with
  ``--preset megatron-llama`` (per-layer split, q/k/v per query group, gate/up).
- ``megatron-moe``: megatron-core's names for a Mixtral-shaped MoE, ``--layers`` layers (default 8) of 64
  experts (dim 1024, expert ffn 512, 16 heads in 4 query groups), written per layer as megatron-core writes a
  model whose layers differ (``decoder.layers.{n}.mlp.experts.experts.linear_fc1.weight``, ``[experts, 2 x
  ffn, dim]``, expert-parallel ``Shard(0)`` chunks), with ``common.pt`` and ``metadata.json``: ``export-hf
  --preset megatron-mixtral`` splits each layer's experts, and ``reshard`` re-lays it for 3 ranks.
- ``fp8``: a DeepSeek-V3-shaped model (MLA attention, dense MLPs; dim 2048, 16 heads, ffn 5632, vocab 32000) in
  bf16 under HF names, as many layers as fit in ``--size``: ``export-hf --dtype fp8`` writes it in the release's
  FP8 form (block scales computed), and ``convert --to sharded --preset torchtitan-deepseek-v3 --dtype bf16``
  imports that back, dequantizing into bf16; each timed against the ``cp -r`` of its own input.
- ``tp``: the dense shapes on a 2 x 2 (dp x tp) mesh, saved by torch's own ``dcp.save`` from DTensors placed as
  tensor parallelism places them (``Shard(1)`` for the row-parallel o_proj/down_proj, ``Shard(0)`` for the rest,
  norms replicated over tp).

Each contender then runs as its own process, ``--repeat`` times on a warm page cache; the table shows median
wall time and the peak RSS of that process (``os.wait4``; every row includes a ~9 MB floor, see ``_RUNNER``),
and each row's ratio against the ``cp -r`` of its own input, measured in the same run. ``--world-size N`` is
the reshard target; at N >= 8 the bench also exports from the N-rank output and checks that the export equals
the one from 4 ranks byte for byte. The ``tp`` export is checked against torch's ``dcp_to_torch_save``.

``--chunks N`` instead times ckptkit's per-chunk costs in this process: reading a DCP of about N chunks
(``.metadata`` and every chunk's archive header), and planning plus executing an export and a reshard of it.
"""

from __future__ import annotations

import compileall
import filecmp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click

import ckptkit as ckptkit_package
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Chunk, Format, Manifest, Span, TensorEntry
from ckptkit.formats import io_for
from ckptkit.formats.dcp import DcpOptions
from ckptkit.io.execute import execute
from ckptkit.io.options import WriteOptions
from ckptkit.io.storage.local import LOCAL
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

Shapes = list[tuple[str, tuple[int, ...]]]


def llama_shapes(target: int, dim: int = 2048, ffn: int = 5632, vocab: int = 32000) -> Shapes:
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


def megatron_shapes(target: int, dim: int = 2048, heads: int = 16, groups: int = 4, ffn: int = 5632,
                    vocab: int = 32000) -> Shapes:
    """megatron-core's layer-stacked tensors of a Llama with as many layers as fit in ``target`` bf16 bytes."""
    hd = dim // heads
    layer = [("self_attention.linear_qkv.weight", ((heads + 2 * groups) * hd, dim)),
             ("self_attention.linear_proj.weight", (dim, dim)), ("mlp.linear_fc1.weight", (2 * ffn, dim)),
             ("mlp.linear_fc2.weight", (dim, ffn)), ("self_attention.linear_qkv.layer_norm_weight", (dim,)),
             ("mlp.linear_fc1.layer_norm_weight", (dim,))]
    n = max(1, (target // 2 - 2 * vocab * dim - dim) // sum(_numel(s) for _, s in layer))
    return [("embedding.word_embeddings.weight", (vocab, dim)),
            *((f"decoder.layers.{k}", (n, *s)) for k, s in layer),
            ("decoder.final_layernorm.weight", (dim,)), ("output_layer.weight", (vocab, dim))]


def write_megatron(root: Path, size: int) -> int:
    """:func:`megatron_shapes` as a 4-rank ``torch_dist`` checkpoint under ``root / 'dcp'``: the DCP files, and
    megatron-core's ``common.pt`` (Megatron-LM's args: the head counts the preset needs) and ``metadata.json``."""
    import argparse

    import torch

    from ckptkit.formats.megatron import CONFIG, CONFIG_BYTES

    shapes = megatron_shapes(size)
    total = write_dcp(root, [(k, s, "bfloat16") for k, s in shapes])
    layers = shapes[1][1][0]
    args = argparse.Namespace(num_layers=layers, hidden_size=2048, num_attention_heads=16, group_query_attention=True,
                              num_query_groups=4, kv_channels=128, ffn_hidden_size=5632,
                              untie_embeddings_and_output_weights=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0}, root / "dcp" / "common.pt")
    (root / "dcp" / CONFIG).write_bytes(CONFIG_BYTES)
    return total


def megatron_moe_shapes(layers: int, experts: int = 64, dim: int = 1024, heads: int = 16, groups: int = 4,
                        ffn: int = 512, vocab: int = 16000) -> tuple[Shapes, dict]:
    """megatron-core's per-layer tensors of a Mixtral-shaped MoE, and its HF config.json."""
    hd = dim // heads
    shapes: Shapes = [("embedding.word_embeddings.weight", (vocab, dim))]
    for n in range(layers):
        p = f"decoder.layers.{n}."
        shapes += [(p + "self_attention.linear_qkv.layer_norm_weight", (dim,)),
                   (p + "self_attention.linear_qkv.weight", ((heads + 2 * groups) * hd, dim)),
                   (p + "self_attention.linear_proj.weight", (dim, dim)), (p + "pre_mlp_layernorm.weight", (dim,)),
                   (p + "mlp.router.weight", (experts, dim)),
                   (p + "mlp.experts.experts.linear_fc1.weight", (experts, 2 * ffn, dim)),
                   (p + "mlp.experts.experts.linear_fc2.weight", (experts, dim, ffn))]
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": dim,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": groups,
              "head_dim": hd, "num_local_experts": experts, "num_experts_per_tok": 2, "intermediate_size": ffn,
              "vocab_size": vocab, "tie_word_embeddings": False}
    return shapes + [("decoder.final_layernorm.weight", (dim,)), ("output_layer.weight", (vocab, dim))], config


def bench_megatron_moe(layers: int, repeat: int, root: Path) -> None:
    """export-hf and reshard of megatron-core's per-layer MoE names, against cp."""
    import json

    import torch

    from ckptkit.formats.megatron import CONFIG, CONFIG_BYTES

    shapes, config = megatron_moe_shapes(layers)
    total = write_dcp(root, [(k, s, "bfloat16") for k, s in shapes])
    src = root / "dcp"
    torch.save({"checkpoint_version": 3.0, "iteration": 0}, src / "common.pt")
    (src / CONFIG).write_bytes(CONFIG_BYTES)
    assets = root / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(config))
    compileall.compile_dir(Path(ckptkit_package.__file__).parent, quiet=1)
    ckptkit = [sys.executable, "-m", "ckptkit"]
    rows = [_cp(src), Row("ckptkit export-hf --preset megatron-mixtral", lambda out: [
        *ckptkit, "export-hf", str(src), str(out), "-q", "--preset", "megatron-mixtral", "--hf-assets", str(assets)],
        src), Row("ckptkit reshard -> 3", lambda out: [*ckptkit, "reshard", str(src), str(out), "--world-size", "3",
                                                        "-q"], src)]
    _warm(src)
    _time_rows(rows, repeat, root)
    _table(rows, total, repeat, f"{total / 1e9:.2f} GB bf16, megatron-core Mixtral-shaped MoE, {layers} layers x 64 "
                                f"experts, per-layer keys, 4-rank torch_dist, {_chunks(src)} chunks")


def moe_shapes(layers: int, experts: int = 64, dim: int = 1024, ffn: int = 96, vocab: int = 16000) -> Shapes:
    """Parameter names and shapes of a mixture-of-experts model (each expert its own three matrices)."""
    shapes = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{n}_proj.weight", (dim, dim)) for n in "qkvo"]
        shapes += [(p + "mlp.gate.weight", (experts, dim))]
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes += [(q + "gate_proj.weight", (ffn, dim)), (q + "up_proj.weight", (ffn, dim)),
                       (q + "down_proj.weight", (dim, ffn))]
        shapes += [(p + "input_layernorm.weight", (dim,)), (p + "post_attention_layernorm.weight", (dim,))]
    return shapes + [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))]


def titan_moe_shapes(layers: int, experts: int = 64, dim: int = 1536, ffn: int = 512, vocab: int = 16000,
                     heads: int = 12, kv_heads: int = 4, head_dim: int = 128) -> tuple[Shapes, dict]:
    """torchtitan 0.3 Qwen3-MoE parameter names and shapes (stacked experts), and the HF config.json of it."""
    inner = "moe.routed_experts.inner_experts."
    shapes: Shapes = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [(p + "attention.qkv_linear.wq.weight", (heads * head_dim, dim)),
                   (p + "attention.qkv_linear.wk.weight", (kv_heads * head_dim, dim)),
                   (p + "attention.qkv_linear.wv.weight", (kv_heads * head_dim, dim)),
                   (p + "attention.wo.weight", (dim, heads * head_dim)),
                   (p + "attention.q_norm.weight", (head_dim,)), (p + "attention.k_norm.weight", (head_dim,)),
                   (p + "moe.router.gate.weight", (experts, dim)), (p + inner + "w1_EFD", (experts, ffn, dim)),
                   (p + inner + "w3_EFD", (experts, ffn, dim)), (p + inner + "w2_EDF", (experts, dim, ffn)),
                   (p + "attention_norm.weight", (dim,)), (p + "ffn_norm.weight", (dim,))]
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": dim,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_experts": experts, "moe_intermediate_size": ffn, "vocab_size": vocab,
              "tie_word_embeddings": False}
    return shapes + [("norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))], config


def _there_and_back(shapes: Shapes, config: dict, there: tuple[str, list[str]], back: tuple[str, list[str]],
                    repeat: int, root: Path) -> tuple[list[Row], int]:
    """``shapes`` in bf16 as a 4-rank DCP with ``config`` as its config.json; ``there`` (a row's name and its
    ckptkit arguments after SRC OUT) converts it, and ``back`` converts that output again; each timed against
    the ``cp -r`` of its own input. The rows and the DCP's size."""
    import json

    total = write_dcp(root, [(k, s, "bfloat16") for k, s in shapes])
    assets = root / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(config))
    src, mid = root / "dcp", root / "mid"
    compileall.compile_dir(Path(ckptkit_package.__file__).parent, quiet=1)
    ckptkit = [sys.executable, "-m", "ckptkit"]
    first = Row(there[0], lambda out: [*ckptkit, there[1][0], str(src), str(out), "-q", *there[1][1:],
                                       "--hf-assets", str(assets)], src, keep=mid)
    _warm(src)
    _time_rows([_cp(src), first], 1, root)  # makes the output the way back reads
    second = Row(back[0], lambda out: [*ckptkit, back[1][0], str(mid), str(out), "-q", *back[1][1:],
                                       "--hf-assets", str(assets)], mid)
    rows = [_cp(src), first, _cp(mid), second]
    for row in rows:
        row.runs.clear()
    _warm(mid)
    _time_rows(rows, repeat, root)
    return rows, total


def bench_titan_moe(layers: int, repeat: int, root: Path) -> None:
    """export-hf of a torchtitan Qwen3-MoE DCP (experts split) and the reverse (experts joined), against cp."""
    shapes, config = titan_moe_shapes(layers)
    rows, total = _there_and_back(shapes, config, ("ckptkit export-hf (experts split)", ["export-hf"]), (
        "ckptkit convert --to sharded (joined)",
        ["convert", "--to", "sharded", "--world-size", "4", "--preset", "torchtitan-qwen3-moe"]), repeat, root)
    _table(rows, total, repeat, f"{total / 1e9:.2f} GB bf16, torchtitan Qwen3-MoE, {layers} layers x 64 stacked "
                                f"experts, 4-rank DCP, {_chunks(root / 'dcp')} chunks")


def deepseek_shapes(target: int, dim: int = 2048, heads: int = 16, ffn: int = 5632,
                    vocab: int = 32000) -> tuple[Shapes, dict]:
    """HF names and shapes of a DeepSeek-V3 of dense layers (MLA: q_proj, kv_a_proj_with_mqa with its norm,
    kv_b_proj) with as many layers as fit in ``target`` bf16 bytes, and its config.json."""
    nope, rope, v, kv_lora = 128, 64, 128, 512
    layer = [("self_attn.q_proj.weight", (heads * (nope + rope), dim)),
             ("self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, dim)),
             ("self_attn.kv_a_layernorm.weight", (kv_lora,)),
             ("self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora)),
             ("self_attn.o_proj.weight", (dim, heads * v)), ("mlp.gate_proj.weight", (ffn, dim)),
             ("mlp.up_proj.weight", (ffn, dim)), ("mlp.down_proj.weight", (dim, ffn)),
             ("input_layernorm.weight", (dim,)), ("post_attention_layernorm.weight", (dim,))]
    layers = max(1, (target // 2 - 2 * vocab * dim) // sum(_numel(s) for _, s in layer))
    shapes = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        shapes += [(f"model.layers.{i}.{k}", s) for k, s in layer]
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": dim,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": heads, "q_lora_rank": None, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope,
              "qk_rope_head_dim": rope, "v_head_dim": v, "head_dim": rope, "first_k_dense_replace": layers,
              "n_routed_experts": 8, "vocab_size": vocab, "tie_word_embeddings": False}
    return shapes + [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))], config


def bench_fp8(size: int, repeat: int, root: Path) -> None:
    """export-hf --dtype fp8 of a bf16 DeepSeek-V3 (block scales computed) and the FP8 import back, against cp."""
    shapes, config = deepseek_shapes(size)
    rows, total = _there_and_back(shapes, config, ("ckptkit export-hf --dtype fp8", ["export-hf", "--dtype", "fp8"]), (
        "ckptkit convert --to sharded --dtype bf16 (dequantized)",
        ["convert", "--to", "sharded", "--world-size", "4", "--preset", "torchtitan-deepseek-v3", "--dtype", "bf16"]),
        repeat, root)
    _table(rows, total, repeat, f"{total / 1e9:.2f} GB bf16, DeepSeek-V3-shaped (MLA, dense MLPs), "
                                f"{config['num_hidden_layers']} layers, 4-rank DCP -> FP8 HF -> 4-rank DCP")


def with_adamw(shapes: Shapes) -> list[tuple[str, tuple[int, ...], str]]:
    """A training state's tensors: the model under ``model.``, and AdamW's per-parameter state."""
    out = [(f"model.{k}", s, "bfloat16") for k, s in shapes]
    for k, s in shapes:
        out += [(f"optim.state.{k}.exp_avg", s, "bfloat16"), (f"optim.state.{k}.exp_avg_sq", s, "bfloat16"),
                (f"optim.state.{k}.step", (), "float32")]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_dcp(root: Path, tensors: list[tuple[str, tuple[int, ...], str]], world_size: int = 4) -> int:
    """``tensors`` (key, shape, dtype) of random bits as a ``world_size``-rank DCP under ``root / 'dcp'``, laid
    out by ckptkit's writer; returns the tensor bytes."""
    sizes = [by_name(d).itemsize * _numel(s) for _, s, d in tensors]
    total = sum(sizes)
    raw = root / "random.bin"
    block = os.urandom(64 << 20)
    with open(raw, "wb") as f:
        for start in range(0, total, len(block)):
            f.write(block[: min(len(block), total - start)])
    entries, pos = [], 0
    for (key, shape, dtype), n in zip(tensors, sizes, strict=True):
        chunk = Chunk((0,) * len(shape), shape, Span(str(raw), pos, n))
        entries.append(TensorEntry(key, tuple(key.split(".")) if key.startswith("optim.") else (key,), by_name(dtype),
                                   shape, (chunk,)))
        pos += n
    manifest = Manifest(Format.FULL, str(raw), tuple(entries))
    plan = io_for(Format.SHARDED).plan(manifest, DcpOptions(world_size=world_size))
    execute(plan, root / "dcp", LOCAL, WriteOptions())
    raw.unlink()
    return total


def _tp_rank(rank: int, world: int, root: str, shapes: Shapes) -> None:
    """One rank of a 2 x 2 (dp x tp) mesh saving its DTensors with torch's DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(rank)
    state = {}
    for key, shape in shapes:
        if len(shape) == 1:
            placements = (Shard(0), Replicate())
        elif key.endswith(("o_proj.weight", "down_proj.weight")):
            placements = (Shard(0), Shard(1))
        else:
            placements = (Shard(0), Shard(0))
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        local = torch.randint(-(2**15), 2**15, local_shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)
        state[key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                        stride=torch.empty(shape, device="meta").stride())
    dcp.save(state, checkpoint_id=root)


def write_tp(root: Path, size: int) -> int:
    from ckptkit.harness.launch import run_ranks

    shapes = llama_shapes(size)
    run_ranks(_tp_rank, 4, str(root / "dcp"), shapes, timeout=600, deadline=1800)
    return sum(2 * _numel(s) for _, s in shapes)


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


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Row:
    """A contender: a command writing to ``out``, timed against the ``cp -r`` of ``source``."""

    def __init__(self, name: str, cmd: Callable[[Path], list[str]], source: Path, keep: Path | None = None) -> None:
        self.name, self.cmd, self.source, self.keep = name, cmd, source, keep
        self.runs: list[tuple[float, float]] = []


def _time_rows(rows: list[Row], repeat: int, root: Path) -> None:
    """Run every row ``repeat`` times, interleaved (one round runs each row once), so that a change of load
    during the run touches every row alike."""
    for _ in range(repeat):
        for row in rows:
            out = root / "out"
            os.sync()  # the previous run's dirty pages written back now, not during this one
            row.runs.append(_run(row.cmd(out), root / "stderr.log"))
            if row.keep is not None and not row.keep.exists():
                out.rename(row.keep)
            _remove(out)
            (root / "tmp.pt").unlink(missing_ok=True)


def _cp(source: Path) -> Row:
    return Row(f"cp -r {source.name}", lambda out: ["cp", "-r", str(source), str(out)], source)


def _chunks(path: Path) -> int:
    from ckptkit.formats.dcp import DcpIO

    return sum(len(t.chunks) for t in DcpIO().read(path).tensors)


@click.command()
@click.option("--shape", type=click.Choice(["dense", "moe", "moe-titan", "tp", "megatron", "megatron-moe", "fp8"]),
              default="dense",
              show_default=True, help="Which checkpoint (see the module docstring).")
@click.option("--size", default="2GB", show_default=True, help="Approximate size of the dense and tp checkpoints.")
@click.option("--layers", default=8, show_default=True, type=click.IntRange(min=1), help="moe: layers.")
@click.option("--world-size", default=3, show_default=True, type=click.IntRange(min=1),
              help="Ranks reshard writes; at 8 or more the export from that output is timed and checked too.")
@click.option("--workers", default="1,auto", show_default=True,
              help="Time ckptkit with each of these --workers values (a count or auto), e.g. 1,2,auto.")
@click.option("--repeat", default=3, show_default=True, type=click.IntRange(min=1), help="Runs per contender (median).")
@click.option("--skip-torch", is_flag=True, help="Leave out the torch path (it needs ~1.1x the size in RAM).")
@click.option("--fsync", "with_fsync", is_flag=True, help="Also time export-hf --fsync.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write (default: a temp dir).")
@click.option("--chunks", type=click.IntRange(min=1000), default=None,
              help="Instead: per-chunk costs of reading, planning and executing a DCP of about this many chunks.")
@click.option("--metadata-tensors", type=click.IntRange(min=1), default=None,
              help="Instead: time reading the .metadata of a DCP with this many tensors x 4 ranks, and its guard.")
@click.option("--storage", type=click.Choice(["local", "s3"]), default="local", show_default=True,
              help="s3: instead, throughput of the dense checkpoint from and to S3 (moto's server on loopback) "
                   "against local.")
def main(shape: str, size: str, layers: int, world_size: int, workers: str | None, repeat: int, skip_torch: bool,
         with_fsync: bool, workdir: Path | None, chunks: int | None, metadata_tensors: int | None,
         storage: str) -> None:
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ckptkit-bench-", dir=workdir))
    # transformers' answers (the class check) are cached by the untimed first run, in the bench's own directory
    os.environ["CKPTKIT_CACHE_DIR"] = str(root / "cache")
    try:
        if metadata_tensors:
            bench_metadata(metadata_tensors, repeat, root)
        elif chunks:
            bench_chunks(chunks, repeat, root)
        elif shape == "moe-titan":
            bench_titan_moe(layers, repeat, root)
        elif shape == "fp8":
            bench_fp8(parse_size(size, "--size"), repeat, root)
        elif shape == "megatron-moe":
            bench_megatron_moe(layers, repeat, root)
        elif storage == "s3":
            total = write_dcp(root, [(k, s, "bfloat16") for k, s in llama_shapes(parse_size(size, "--size"))])
            bench_storage(root / "dcp", total, repeat, root)
        else:
            bench_commands(shape, parse_size(size, "--size"), layers, world_size, workers, repeat, skip_torch,
                           with_fsync, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bench_commands(shape: str, size: int, layers: int, world_size: int, workers: str | None, repeat: int,
                   skip_torch: bool, with_fsync: bool, root: Path) -> None:
    if shape == "tp":
        total = write_tp(root, size)
        what = f"{total / 1e9:.2f} GB bf16, LLaMA-shaped, 2 x 2 (dp x tp) DCP saved by torch"
    elif shape == "moe":
        tensors = with_adamw(moe_shapes(layers))
        total = write_dcp(root, tensors)
        what = (f"{total / 1e9:.2f} GB, {layers}-layer 64-expert MoE with AdamW state, {len(tensors)} tensors, "
                "4-rank DCP")
    elif shape == "megatron":
        total = write_megatron(root, size)
        what = f"{total / 1e9:.2f} GB bf16, megatron-core GPT (Llama), 4-rank torch_dist"
    else:
        total = write_dcp(root, [(k, s, "bfloat16") for k, s in llama_shapes(size)])
        what = f"{total / 1e9:.2f} GB bf16, LLaMA-shaped, 4-rank DCP"
    src = root / "dcp"
    mapping = ["--preset", "megatron-llama"] if shape == "megatron" else []
    what += f", {_chunks(src)} chunks"
    # As an installed package has it (pip compiles on install): without, a PYTHONDONTWRITEBYTECODE environment
    # makes every run compile ckptkit's modules again, a tenth of a second or more of each row.
    compileall.compile_dir(Path(ckptkit_package.__file__).parent, quiet=1)
    ckptkit = [sys.executable, "-m", "ckptkit"]
    extra = [["--workers", w] for w in workers.split(",")] if workers else [[]]

    def label(name: str, args: list[str]) -> str:
        return f"{name} {' '.join(args)}".rstrip()

    rows = [_cp(src)]
    hf4 = root / "hf-from-4"
    for args in extra:
        rows.append(Row(label("ckptkit export-hf", args),
                        lambda out, a=args: [*ckptkit, "export-hf", str(src), str(out), "-q", *mapping, *a], src,
                        keep=hf4 if args == extra[0] else None))
        rows.append(Row(label(f"ckptkit reshard -> {world_size}", args), lambda out, a=args: [
            *ckptkit, "reshard", str(src), str(out), "--world-size", str(world_size), "-q", *a], src,
            keep=root / "resharded" if args == extra[0] else None))
    if with_fsync:
        rows.append(Row("ckptkit export-hf --fsync", lambda out: [*ckptkit, "export-hf", str(src), str(out), "-q",
                                                                   "--fsync"], src))
    if not skip_torch:
        rows.append(Row("torch dcp_to_torch_save + save_file", lambda out: [
            sys.executable, "-c", _TORCH_PATH, str(src), str(root / "tmp.pt"), str(out)], src))
    _warm(src)
    _time_rows(rows, repeat, root)
    results = list(rows)
    checks = []
    if world_size >= 8:
        many = root / "resharded"
        more = [_cp(many)]
        hf_many = root / "hf-from-many"
        for args in extra:
            more.append(Row(label(f"ckptkit export-hf from {world_size} ranks", args),
                            lambda out, a=args: [*ckptkit, "export-hf", str(many), str(out), "-q", *mapping, *a],
                            many,
                            keep=hf_many if args == extra[0] else None))
        _warm(many)
        _time_rows(more, repeat, root)
        results += more
        same = _same_tree(hf4, hf_many)
        checks.append(f"export from {world_size} ranks equals the export from 4 ranks byte for byte: {same}")
    if shape == "tp":
        checks.append(f"export-hf equals torch's dcp_to_torch_save, tensor by tensor: {_same_as_torch(src, hf4, root)}")
    _table(results, total, repeat, what)
    for line in checks:
        click.echo(line)


def _warm(path: Path) -> None:
    subprocess.run(["cat", *map(str, path.iterdir())], stdout=subprocess.DEVNULL, check=True)


def _same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def _same_as_torch(src: Path, hf: Path, root: Path) -> bool:
    """Whether the safetensors export holds, bit for bit, what torch's ``dcp_to_torch_save`` gathers."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = root / "torch.pt"
    dcp_to_torch_save(src, ref)
    want = torch.load(ref, mmap=True, weights_only=True)
    got: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            got.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118 (safe_open is no dict)
    same = set(want) == set(got) and all(
        want[k].dtype == got[k].dtype and want[k].shape == got[k].shape
        and torch.equal(want[k].view(torch.int16), got[k].view(torch.int16)) for k in want)
    ref.unlink()
    return same


def _cores() -> int:
    """The cores this benchmark's commands may run on (its CPU affinity, as ``taskset`` sets it)."""
    from ckptkit.io.parallel import cores

    return cores()


def _table(rows: list[Row], total: int, repeat: int, what: str) -> None:
    click.echo(f"checkpoint: {what}; {_cores()} cores; median of {repeat} runs, warm cache; x cp: against the cp -r "
               "of the same input")
    click.echo(f"{'what':<44} {'wall s':>7} {'GB/s':>6} {'peak RSS MB':>12} {'x cp':>6}")
    cp: dict[Path, float] = {}
    for row in rows:
        wall = statistics.median(w for w, _ in row.runs)
        rss = max(r for _, r in row.runs)
        cp.setdefault(row.source, wall)
        click.echo(f"{row.name:<44} {wall:7.2f} {total / wall / 1e9:6.2f} {rss / 2**20:12.0f} "
                   f"{wall / cp[row.source]:6.2f}")


# ------------------------------------------------------------------------------------------ per-chunk costs


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
               f"{_cores()} cores; median of {repeat} runs, in-process")
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
    click.echo(f".metadata of {tensors} tensors x 4 ranks ({chunks} chunks), {mb:.1f} MB; {_cores()} cores; "
               f"median of {repeat} runs")
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
        click.echo(f"checkpoint: {total / 1e9:.2f} GB bf16, LLaMA-shaped, 4-rank DCP; {_cores()} cores; "
                   f"S3 is moto on loopback; median of {repeat} runs")
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


if __name__ == "__main__":
    main()

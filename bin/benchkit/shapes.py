"""The checkpoints the bench times: parameter names and shapes of each model (random bits; the shapes are
what matter), and the writers that lay them out as a 4-rank DCP (ckptkit's own DCP writer, or torch's
``dcp.save`` for tensor parallelism, or megatron-core's ``torch_dist`` files around ckptkit's DCP).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Chunk, Format, Manifest, Span, TensorEntry
from ckptkit.formats import io_for
from ckptkit.formats.dcp import DcpOptions
from ckptkit.io.execute import execute
from ckptkit.io.options import WriteOptions
from ckptkit.io.storage.local import LOCAL

__all__ = ["Shapes", "deepseek_shapes", "llama_config", "llama_shapes", "megatron_moe_shapes", "megatron_shapes",
           "moe_shapes", "numel", "titan_moe_shapes", "with_adamw", "with_checksums", "write_dcp", "write_megatron",
           "write_tp"]

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
    n = max(1, (target // 2 - 2 * vocab * dim - dim) // sum(numel(s) for _, s in layer))
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
    layers = max(1, (target // 2 - 2 * vocab * dim) // sum(numel(s) for _, s in layer))
    shapes = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        shapes += [(f"model.layers.{i}.{k}", s) for k, s in layer]
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": dim,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": heads, "q_lora_rank": None, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope,
              "qk_rope_head_dim": rope, "v_head_dim": v, "head_dim": rope, "first_k_dense_replace": layers,
              "n_routed_experts": 8, "vocab_size": vocab, "tie_word_embeddings": False}
    return shapes + [("model.norm.weight", (dim,)), ("lm_head.weight", (vocab, dim))], config


def with_adamw(shapes: Shapes) -> list[tuple[str, tuple[int, ...], str]]:
    """A training state's tensors: the model under ``model.``, and AdamW's per-parameter state."""
    out = [(f"model.{k}", s, "bfloat16") for k, s in shapes]
    for k, s in shapes:
        out += [(f"optim.state.{k}.exp_avg", s, "bfloat16"), (f"optim.state.{k}.exp_avg_sq", s, "bfloat16"),
                (f"optim.state.{k}.step", (), "float32")]
    return out


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_dcp(root: Path, tensors: list[tuple[str, tuple[int, ...], str]], world_size: int = 4) -> int:
    """``tensors`` (key, shape, dtype) of random bits as a ``world_size``-rank DCP under ``root / 'dcp'``, laid
    out by ckptkit's writer; returns the tensor bytes."""
    sizes = [by_name(d).itemsize * numel(s) for _, s, d in tensors]
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
    """:func:`llama_shapes` on a 2 x 2 (dp x tp) mesh, saved by torch's own ``dcp.save`` under ``root / 'dcp'``."""
    from ckptkit.harness.launch import run_ranks

    shapes = llama_shapes(size)
    run_ranks(_tp_rank, 4, str(root / "dcp"), shapes, timeout=600, deadline=1800)
    return sum(2 * numel(s) for _, s in shapes)


def llama_config(shapes: Shapes, dim: int = 2048, ffn: int = 5632, vocab: int = 32000) -> dict:
    """The HF config.json of :func:`llama_shapes`' model."""
    layers = sum(1 for k, _ in shapes if k.endswith("self_attn.q_proj.weight"))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": dim,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def with_checksums(dcp: Path) -> None:
    """Record the CRC-32 of every chunk of the DCP at ``dcp`` in a ``ckptkit.json``, as ``ckptkit.save`` does, so
    that a command reading it checks them (the cost of the checks is timed against ``--no-verify-checksums``)."""
    from ckptkit.formats.dcp import DcpIO
    from ckptkit.ops.checksums import Recorder, write_record

    manifest = DcpIO().read(dcp)
    recorder = Recorder()
    for t in manifest.tensors:
        boxes = []
        for c in t.chunks:
            with open(c.span.file, "rb") as f:
                f.seek(c.span.offset)
                crc, left = 0, c.span.length
                while left:
                    data = f.read(min(left, 8 << 20))
                    crc, left = zlib.crc32(data, crc), left - len(data)
            boxes.append((c.offsets, c.sizes, crc))
        recorder.tensors[t.key] = (t.dtype.name, t.shape, boxes)
    write_record(dcp, recorder, form="sharded", world_size=manifest.world_size or 1, step=None, save=1)

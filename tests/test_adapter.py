"""ckptkit.models.apply: a table's rows applied to stored tensors, both ways, written by the executor and compared
with torch's own views. The table here is Megatron-core's layout (layer-stacked ``decoder.layers.*``, a fused
``linear_qkv`` holding per query group its q rows, then its k rows, then its v rows, ``linear_fc1`` holding gate
rows then up rows), which no shipped preset has: the engine serves any family that a table can say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptkit.codecs.safetensors_header import read_header
from ckptkit.core.plan import FilePlan, Region
from ckptkit.errors import UsageError
from ckptkit.io.storage.local.writer import write_files
from ckptkit.models.apply import apply_preset
from ckptkit.models.completeness import Source
from ckptkit.models.preset import Preset, Row
from ckptkit.models.shape import ModelShape

LAYERS, HEADS, GROUPS, HEAD_DIM, DIM, FFN = 3, 4, 2, 2, 5, 6
SHAPE = ModelShape(HEAD_DIM, HEADS, GROUPS, LAYERS, False, "config.json")
HF = "model.layers.{n}."
MEGATRON = Preset("megatron-test", "Megatron-core's stacked, fused layout", "Megatron", (
    Row(tuple(HF + f"self_attn.{p}_proj.weight" for p in "qkv"), ("decoder.layers.self_attention.linear_qkv.weight",),
        stacked="n", split=(("heads_per_group", "head_dim"), ("head_dim",), ("head_dim",)), groups="n_kv_heads"),
    Row((HF + "mlp.gate_proj.weight", HF + "mlp.up_proj.weight"), ("decoder.layers.mlp.linear_fc1.weight",),
        stacked="n"),
    Row(HF + "input_layernorm.weight", ("decoder.layers.self_attention.linear_qkv.layer_norm_weight",), stacked="n"),
))


def stored(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> list[Source]:
    save_file(tensors, tmp_path / "src.safetensors")
    return [Source(e.key, e) for e in read_header(tmp_path / "src.safetensors")[0]]


def written(tmp_path: Path, sources, max_memory: int = 64) -> dict[str, torch.Tensor]:
    out = tmp_path / "out"
    out.mkdir()
    entries = [s.entry for s in sources]
    write_files(tuple(FilePlan(f"{i}.bin", (Region.whole(e),)) for i, e in enumerate(entries)), out,
                max_memory=max_memory)
    return {e.key: torch.frombuffer(bytearray((out / f"{i}.bin").read_bytes()), dtype=torch.float32)
            .reshape(e.shape) for i, e in enumerate(entries)}


def megatron(g: torch.Generator) -> dict[str, torch.Tensor]:
    rows = (HEADS + 2 * GROUPS) * HEAD_DIM
    return {"decoder.layers.self_attention.linear_qkv.weight": torch.randn(LAYERS, rows, DIM, generator=g),
            "decoder.layers.mlp.linear_fc1.weight": torch.randn(LAYERS, 2 * FFN, DIM, generator=g),
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(LAYERS, DIM, generator=g)}


def test_a_conversion_towards_megatron_names_refuses_keys_that_are_megatrons_already(tmp_path):
    """``convert --to megatron`` of a megatron-core checkpoint: mapping its names "towards HF" would write HF
    names into the megatron-core output and exit 0."""
    sources = stored(tmp_path, megatron(torch.Generator().manual_seed(0)))
    with pytest.raises(UsageError, match=r"the keys are Megatron names already \(e\.g\. 'decoder\.layers\..*reshard "
                                         r"re-lays a checkpoint as it is"):
        apply_preset(sources, MEGATRON, SHAPE, to_hf=False)


def test_stacked_fused_rows_split_per_layer_and_query_group_and_join_back(tmp_path):
    src = megatron(torch.Generator().manual_seed(0))
    hf = written(tmp_path, apply_preset(stored(tmp_path, src), MEGATRON, SHAPE, to_hf=True).tensors)
    per_group = (HEADS // GROUPS + 2) * HEAD_DIM
    for n in range(LAYERS):
        qkv = src["decoder.layers.self_attention.linear_qkv.weight"][n].view(GROUPS, per_group, DIM)
        q, k, v = qkv.split([HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=1)
        assert torch.equal(hf[f"model.layers.{n}.self_attn.q_proj.weight"], q.reshape(-1, DIM))
        assert torch.equal(hf[f"model.layers.{n}.self_attn.k_proj.weight"], k.reshape(-1, DIM))
        assert torch.equal(hf[f"model.layers.{n}.self_attn.v_proj.weight"], v.reshape(-1, DIM))
        gate, up = src["decoder.layers.mlp.linear_fc1.weight"][n].chunk(2)
        assert torch.equal(hf[f"model.layers.{n}.mlp.gate_proj.weight"], gate)
        assert torch.equal(hf[f"model.layers.{n}.mlp.up_proj.weight"], up)
    back_dir = tmp_path / "back"
    back_dir.mkdir()
    back = written(back_dir, apply_preset(stored(back_dir, hf), MEGATRON, SHAPE, to_hf=None).tensors)
    assert set(back) == set(src) and all(torch.equal(back[k], src[k]) for k in src)


@pytest.mark.parametrize("drop, shape, message", [
    # a layer's k part missing on the way back
    ("model.layers.1.self_attn.k_proj.weight", SHAPE,
     r"'decoder.layers.self_attention.linear_qkv.weight' is made of 9 tensors; the checkpoint lacks "
     r"'model.layers.1.self_attn.k_proj.weight'"),
    # the config's layer count disagrees with the stack
    (None, ModelShape(HEAD_DIM, HEADS, GROUPS, 4, False, "config.json"),
     r"is made of 4 tensors; the checkpoint lacks 'model.layers.3."),
])
def test_joins_refuse_missing_parts_and_counts_that_disagree(tmp_path, drop, shape, message):
    src = megatron(torch.Generator().manual_seed(1))
    hf = written(tmp_path, apply_preset(stored(tmp_path, src), MEGATRON, SHAPE, to_hf=True).tensors)
    hf.pop(drop, None)
    back_dir = tmp_path / "back"
    back_dir.mkdir()
    with pytest.raises(UsageError, match=message):
        apply_preset(stored(back_dir, hf), MEGATRON, shape, to_hf=None)

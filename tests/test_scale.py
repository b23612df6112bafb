"""Checkpoints of many ranks and of 2-D (dp x tp) meshes, at tiny sizes (``bin/bench`` times them at size).

torch is the oracle: exports are loaded by safetensors and compared with the state torch saved or with what
torch's own ``dcp_to_torch_save`` gathers.
"""

from __future__ import annotations

import filecmp

import torch

from _checks import assert_same_tree, load_dcp, load_hf
from ckptkit.harness.launch import run_ranks
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.export import export_hf
from ckptkit.ops.inspect import inspect


def test_export_hf_from_512_ranks_equals_export_from_4_ranks(tmp_path, full_ckpt, training_state):
    # 512 ranks of a tiny model: most ranks hold no rows of most tensors, the rest a row or a few.
    convert(full_ckpt, tmp_path / "dcp4", to="sharded", world_size=4)
    reshard(tmp_path / "dcp4", tmp_path / "dcp512", world_size=512)
    assert len(list((tmp_path / "dcp512").glob("*.distcp"))) == 512
    export_hf(tmp_path / "dcp4", tmp_path / "hf4")
    export_hf(tmp_path / "dcp512", tmp_path / "hf512")
    names = sorted(p.name for p in (tmp_path / "hf4").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "hf512").iterdir())
    assert all(filecmp.cmp(tmp_path / "hf4" / n, tmp_path / "hf512" / n, shallow=False) for n in names)
    assert_same_tree(load_hf(tmp_path / "hf512"), training_state["model"])
    assert_same_tree(load_dcp(tmp_path / "dcp512", tmp_path / "dcp512.pt"), training_state)


TP_SHAPES = {"embed_tokens.weight": (10, 6), "layers.0.self_attn.q_proj.weight": (6, 6),
             "layers.0.self_attn.o_proj.weight": (6, 6),
             "layers.0.mlp.down_proj.weight": (24, 9),  # 48 pieces of rows: the executor gathers them in memory
             "layers.0.input_layernorm.weight": (6,), "lm_head.weight": (10, 6)}


def _save_dp_tp(rank: int, world: int, root: str) -> None:
    """DTensors placed as tensor parallelism places them on a 2 x 2 (dp x tp) mesh, saved by torch's DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)  # every rank makes the same full tensors; each keeps its part
    state = {}
    for key, shape in TP_SHAPES.items():
        full = torch.randn(shape, generator=gen).to(torch.bfloat16)
        if len(shape) == 1:
            placements = (Shard(0), Replicate())
        elif key.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: columns split over tp
            placements = (Shard(0), Shard(1))
        else:
            placements = (Shard(0), Shard(0))
        state[f"model.{key}"] = distribute_tensor(full, mesh, placements)
    dcp.save(state, checkpoint_id=root)


def test_export_hf_of_dp_tp_checkpoint_equals_torch_gather(tmp_path):
    run_ranks(_save_dp_tp, 4, str(tmp_path / "dcp"))
    chunks = {t.key: sorted(c.offsets for c in t.chunks) for t in inspect(tmp_path / "dcp").tensors}
    assert chunks["model.layers.0.self_attn.o_proj.weight"] == [(0, 0), (0, 3), (3, 0), (3, 3)]  # a 2 x 2 grid
    export_hf(tmp_path / "dcp", tmp_path / "hf")
    gathered = load_dcp(tmp_path / "dcp", tmp_path / "torch.pt")
    assert_same_tree(load_hf(tmp_path / "hf"), gathered)  # flat HF names (model.layers...), as torch saved them

"""Megatron-LM's checkpoints around megatron-core's models, written by megatron-core 0.16.1's own code on gloo
ranks (``_megatron_layouts.py``), read by ckptkit, and checked against megatron-core's own
``dist_checkpointing.load`` and its own declaration of how its tensors are split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_dcp
from _megatron import assemble, tokens
from _megatron_layouts import LEGACY_LAYERS, loaded_objects, saved_legacy
from ckptkit.cli import cli

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron-layouts")


@pytest.fixture(scope="module")
def legacy(tmp) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Llama at TP=2 x PP=2 in Megatron-LM's legacy torch format, the same model as torch_dist, and
    megatron-core's global tensors assembled from what each rank's sharded state dict declares."""
    return saved_legacy(tmp)


@pytest.fixture(scope="module")
def with_objects(legacy, tmp) -> Path:
    """Llama at TP=2 with Megatron-LM's rng_state and TE-style _extra_state ShardedObjects (saved by the same
    ranks as ``legacy``)."""
    return tmp / "objects-tp2"


def _run(*args) -> tuple[int, str]:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def _object_keys(ckpt: Path) -> set[str]:
    """The ShardedObjects' keys, as torch's own DCP metadata names them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    return {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}


def test_megatron_inspect_lists_sharded_objects_under_their_own_keys(with_objects):
    keys = {e.key for e in ckptkit.inspect(with_objects).entries if not e.sidecar}
    objects = _object_keys(with_objects)
    assert {"rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2",
            "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"} <= objects
    assert objects <= keys
    assert not any(k.startswith("rng_state/") and k not in objects for k in keys)


@pytest.fixture(scope="module")
def objects_moved(with_objects, tmp) -> dict[str, tuple[Path, list[dict]]]:
    """with_objects resharded to 3 ranks, and converted to sharded at 3 ranks on the command line; and
    megatron-core's own load of each at TP=2 (each rank's result)."""
    ckptkit.reshard(with_objects, tmp / "reshard", world_size=3)
    code, text = _run("convert", with_objects, tmp / "convert", "--to", "sharded", "--world-size", "3")
    assert code == 0, text
    outs = [tmp / "reshard", tmp / "convert"]
    return {out.name: (out, ranks) for out, ranks in zip(outs, loaded_objects(tmp, 2, outs), strict=True)}


@pytest.mark.parametrize("how", ["reshard", "convert"])
def test_megatron_reshard_keeps_sharded_objects_and_megatron_loads_them(with_objects, objects_moved, tmp_path, how):
    out, ranks = objects_moved[how]
    assert _object_keys(out) == _object_keys(with_objects)
    for rank, result in enumerate(ranks):
        assert set(result["objects"]) == set(result["expected"])
        assert_same_tree(result["objects"], result["expected"], f"rank {rank}")
        assert result["common"]["iteration"] == 5
    oracle = load_dcp(with_objects, tmp_path / "oracle.pt")
    params = assemble([r["params"] for r in ranks])
    assert params and set(params) <= set(oracle)
    assert_same_tree(params, {k: oracle[k] for k in params})


def test_megatron_reshard_copies_sharded_objects_byte_for_byte(with_objects, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    ckptkit.reshard(with_objects, tmp_path / "out", world_size=1)

    def blobs(ckpt: Path) -> dict[str, bytes]:
        md = FileSystemReader(str(ckpt)).read_metadata()
        out = {}
        for index, info in md.storage_data.items():
            if index.fqn in _object_keys(ckpt):
                with open(ckpt / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    out[index.fqn] = f.read(info.length)
        return out

    assert blobs(tmp_path / "out") == blobs(with_objects)


def test_megatron_convert_full_holds_sharded_objects_as_torch_reads_them(with_objects, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from _megatron_layouts import _plain

    ckptkit.convert(with_objects, tmp_path / "full.pt", to="full")
    # (weights_only=False: numpy's RNG state; these files are the test's own.)
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    dcp_to_torch_save(str(with_objects), str(tmp_path / "oracle.pt"))
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=False)
    objects = _object_keys(with_objects)
    assert objects <= set(full)
    assert_same_tree(_plain({k: full[k] for k in objects}), _plain({k: oracle[k] for k in objects}))
    assert full["rng_state/shard_0.1_1.2"][0][0]["np_rng_state"][0] == "MT19937"


# ------------------------------------------------------------------------------- Megatron-LM's legacy format


# The local spec's norms: their own modules in a state dict, named after the layer they precede in torch_dist.
_TORCH_DIST_NAME = {
    "decoder.layers.input_layernorm.weight": "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "decoder.layers.pre_mlp_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight"}


def _llama_assets(path: Path) -> Path:
    import transformers

    from _megatron import SEQ, VOCAB

    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LEGACY_LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                             rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=SEQ * 2,
                             attention_bias=False).save_pretrained(path)
    return path


@pytest.mark.parametrize("where", ["top", "iter"])
def test_megatron_legacy_convert_full_joins_tp_and_pp_shards_as_megatron_core_declares_them(legacy, tmp_path, where):
    ckpt, _, oracle = legacy
    src = ckpt if where == "top" else ckpt / "iter_0000010"
    ckptkit.convert(src, tmp_path / "full.pt", to="full")
    # (weights_only=False: Megatron-LM's args are an argparse.Namespace; these files are the test's own.)
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    tensors = {_TORCH_DIST_NAME.get(k, k): v for k, v in full.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(oracle) - {"logits"}
    assert_same_tree(tensors, {k: oracle[k] for k in tensors})
    assert tensors["decoder.layers.self_attention.linear_qkv.weight"].shape == (LEGACY_LAYERS, 64, 32)
    assert full["iteration"] == 10 and full["args"].tensor_model_parallel_size == 2
    assert not any(k.startswith(("rng_state", "optimizer")) for k in full)
    left_out = dict(ckptkit.inspect(src).details)["left out"]
    assert "optimizer" in left_out and "rng_state" in left_out


def test_megatron_legacy_export_hf_equals_the_export_of_the_same_model_saved_as_torch_dist(legacy, tmp_path):
    import transformers

    from _checks import load_hf

    ckpt, torch_dist, _ = legacy
    assets = _llama_assets(tmp_path / "assets")
    code, text = _run("export-hf", ckpt, tmp_path / "hf", "--preset", "megatron-llama", "--hf-assets", assets)
    assert code == 0, text
    ckptkit.export_hf(torch_dist, tmp_path / "hf-dist", preset="megatron-llama", hf_assets=assets)
    ours, theirs = load_hf(tmp_path / "hf"), load_hf(tmp_path / "hf-dist")
    assert len(ours) == 3 + 9 * LEGACY_LAYERS
    assert_same_tree(ours, theirs)
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model(tokens()).logits
    difference = (logits - legacy[2]["logits"]).abs().max().item()
    print(f"legacy TP=2 x PP=2: largest logit difference, megatron-core vs transformers: {difference:.3g}")
    assert difference < 1e-5


def test_megatron_legacy_export_hf_without_assets_takes_the_counts_from_args(legacy, tmp_path):
    from _checks import load_hf

    ckpt, torch_dist, _ = legacy
    ckptkit.export_hf(ckpt / "iter_0000010", tmp_path / "hf", preset="megatron-llama")
    ckptkit.export_hf(torch_dist, tmp_path / "hf-dist", preset="megatron-llama")
    assert_same_tree(load_hf(tmp_path / "hf"), load_hf(tmp_path / "hf-dist"))


def test_megatron_legacy_one_rank_file_of_a_tensor_parallel_run_is_refused(legacy, tmp_path):
    ckpt, _, _ = legacy
    rank_file = ckpt / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    for command in (("export-hf", rank_file, tmp_path / "hf", "--preset", "megatron-llama"),
                    ("convert", rank_file, tmp_path / "full.pt", "--to", "full"), ("inspect", rank_file)):
        code, text = _run(*command)
        assert code == 2, text
        assert len(text.strip().splitlines()) == 1, text
        assert "tensor-parallel size 2" in text and str(ckpt / "iter_0000010") in text
    assert not (tmp_path / "hf").exists() and not (tmp_path / "full.pt").exists()


def test_megatron_run_directory_of_torch_dist_iterations_names_the_iteration_to_pass(with_objects, tmp_path):
    import shutil

    shutil.copytree(with_objects, tmp_path / "run" / "iter_0000005")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("5")
    code, text = _run("inspect", tmp_path / "run")
    assert code == 2 and f"pass {tmp_path / 'run' / 'iter_0000005'}" in text, text
    assert ckptkit.inspect(tmp_path / "run" / "iter_0000005").tensors


def test_megatron_legacy_missing_rank_file_is_refused(legacy, tmp_path):
    import shutil

    ckpt, _, _ = legacy
    shutil.copytree(ckpt, tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000010" / "mp_rank_01_001")
    code, text = _run("inspect", tmp_path / "ckpt")
    assert code != 0 and "missing mp_rank_01_001" in text, text


def _one_rank_run(root: Path, tp: int = 1, pp: int = 1, ranks: int = 1, **args) -> Path:
    """A legacy checkpoint of a run on one rank (``tp`` x ``pp`` as its args say), written with torch.save in
    Megatron-LM's layout: a 2-layer model's state dict, with ``release`` as the tracker's iteration; ``ranks``:
    that many tensor ranks' directories holding the same file."""
    import argparse
    import shutil

    g = torch.Generator().manual_seed(0)
    model = {"embedding.word_embeddings.weight": torch.randn(8, 4, generator=g),
             **{f"decoder.layers.{n}.{name}": torch.randn(shape, generator=g) for n in range(2)
                for name, shape in (("self_attention.linear_qkv.weight", (12, 4)), ("mlp.linear_fc1.weight", (16, 4)),
                                    ("input_layernorm.weight", (4,)))},
             "decoder.layers.0.mlp.linear_fc1._extra_state": None}
    unknown, te, dtype = args.pop("unknown", False), args.pop("te", False), args.pop("layer_1_dtype", None)
    if dtype is not None:  # one layer saved in another dtype than the others
        values = (torch.arange(48.0) / 2 - 10).reshape(12, 4)
        model["decoder.layers.1.self_attention.linear_qkv.weight"] = values.to(dtype)
    namespace = argparse.Namespace(num_layers=2, num_attention_heads=2, hidden_size=4, swiglu=True,
                                   tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **args)
    (root / "release" / "mp_rank_00").mkdir(parents=True)
    if te:  # Transformer Engine's FP8 metadata: a uint8 tensor, each tensor rank's own
        model["decoder.layers.0.mlp.linear_fc1._extra_state"] = torch.arange(5, dtype=torch.uint8)
    if unknown:
        model["decoder.layers.0.mlp.adapter.weight"] = torch.zeros(2, 2)
        model["decoder.layers.1.mlp.adapter.weight"] = torch.zeros(2, 2)
    torch.save({"args": namespace, "checkpoint_version": 3.0, "iteration": 0, "model": model},
               root / "release" / "mp_rank_00" / "model_optim_rng.pt")
    for t in range(1, ranks):
        shutil.copytree(root / "release" / "mp_rank_00", root / "release" / f"mp_rank_{t:02d}")
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    return root


def test_megatron_legacy_rank_file_of_a_one_rank_run_reads_as_its_checkpoint(tmp_path):
    root = _one_rank_run(tmp_path / "ckpt")
    rank_file = root / "release" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(rank_file, weights_only=False)["model"]
    for src in (root, rank_file):
        ckptkit.convert(src, tmp_path / f"{src.name}.pt", to="full")
        full = torch.load(tmp_path / f"{src.name}.pt", weights_only=False)
        assert torch.equal(full["decoder.layers.self_attention.linear_qkv.weight"],
                           torch.stack([saved[f"decoder.layers.{n}.self_attention.linear_qkv.weight"] for n in (0, 1)]))
        assert full["decoder.layers.0.mlp.linear_fc1._extra_state"] is None and full["iteration"] == 0


@pytest.mark.parametrize(("args", "where", "message"), [
    ({"pp": 2, "decoder_first_pipeline_num_layers": 1}, None, "decoder_first_pipeline_num_layers=1 at pipeline size 2"),
    ({"tp": 2}, "mp_rank_00_000_001", "expert-parallel rank file"),
    ({"tp": 2}, None, "missing mp_rank_01"),
    ({"tp": 2, "ranks": 2, "unknown": True}, None, "'decoder.layers.mlp.adapter.weight' has no known tensor-parallel"),
    # A layer in another dtype than the stack's: its bytes read as float32 would be other values.
    ({"layer_1_dtype": torch.float64}, None, "linear_qkv.weight' of layer 1 is float64 where layer 0's is float32"),
    ({"layer_1_dtype": torch.int32}, None, "linear_qkv.weight' of layer 1 is int32 where layer 0's is float32"),
    # Two directories of one rank: neither is read in place of the other.
    ({}, "both", "mp_rank_00 and mp_rank_00_000 are both tensor rank 0, pipeline rank 0"),
])
def test_megatron_legacy_layouts_it_cannot_join_are_refused_in_one_line(tmp_path, args, where, message):
    import shutil

    args = dict(args)
    tp, pp, ranks = args.pop("tp", 1), args.pop("pp", 1), args.pop("ranks", 1)
    root = _one_rank_run(tmp_path / "ckpt", tp=tp, pp=pp, ranks=ranks, **args)
    if where == "both":
        shutil.copytree(root / "release" / "mp_rank_00", root / "release" / "mp_rank_00_000")
    elif where is not None:
        (root / "release" / "mp_rank_00").rename(root / "release" / where)
    code, text = _run("inspect", root)
    assert code != 0 and message in text and len(text.strip().splitlines()) == 1, text


def test_megatron_legacy_te_extra_state_is_kept_as_tensor_rank_0s_object(tmp_path):
    root = _one_rank_run(tmp_path / "ckpt", tp=2, ranks=2, te=True)
    saved = torch.load(root / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)["model"]
    ckptkit.convert(root, tmp_path / "full.pt", to="full")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert torch.equal(full["decoder.layers.0.mlp.linear_fc1._extra_state"], torch.arange(5, dtype=torch.uint8))
    # Column-parallel: the two ranks' rows one after the other (here both ranks saved the same shard).
    qkv = saved["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert torch.equal(full["decoder.layers.self_attention.linear_qkv.weight"][1], torch.cat([qkv, qkv]))
    assert "decoder.layers.mlp.linear_fc1._extra_state" not in full


def test_megatron_legacy_reshard_output_is_read_back_whole_and_verifies_identical(tmp_path):
    """reshard of a Megatron-LM legacy checkpoint writes a DCP whose objects (the run's argparse.Namespace among
    them) torch loads as they were saved, and which ckptkit's own commands read back as data."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = _one_rank_run(tmp_path / "ckpt")
    saved = torch.load(root / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    ckptkit.reshard(root, tmp_path / "out", world_size=2)
    dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "out.pt"))
    assert torch.load(tmp_path / "out.pt", weights_only=False)["args"] == saved["args"]
    code, text = _run("inspect", tmp_path / "out")
    assert code == 0 and "argparse.Namespace" in text and "not readable" not in text, text
    code, text = _run("verify", root, tmp_path / "out")
    assert code == 0 and "identical" in text, text

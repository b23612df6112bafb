"""Megatron-LM's checkpoints around megatron-core's models, written by megatron-core 0.16.1's own code on 2 gloo
ranks (``_megatron_layouts.py``), read by ckptkit, and loaded back by megatron-core's own
``dist_checkpointing.load``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_dcp
from _megatron import assemble
from _megatron_layouts import loaded_objects, saved_objects
from ckptkit.cli import cli

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron-layouts")


@pytest.fixture(scope="module")
def with_objects(tmp) -> Path:
    """Llama at TP=2 with Megatron-LM's rng_state and TE-style _extra_state ShardedObjects."""
    return saved_objects(tmp)


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

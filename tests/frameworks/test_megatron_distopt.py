"""megatron-core's DistributedOptimizer, saved ``dp_reshardable``, split into per-parameter state by ckptkit
(:mod:`_megatron_distopt`), and joined back by ``convert --to megatron``.

megatron-core trains its tiny Llama (float32 parameters) with its DistributedOptimizer on 2 data-parallel gloo
ranks for 3 steps and saves as Megatron-LM does: the optimizer's state as flat per-bucket buffers (the resume
matrix's megatron-core source, :func:`matrix_sources`). ckptkit converts it with ``--preset megatron-llama``
into an HF-named FSDP2 DCP at 3 ranks, model and optimizer. The oracle is megatron-core's own per-parameter
state at the save (``_get_main_param_and_optimizer_states`` over each rank's range of each parameter), which
the converted moments equal exactly. The resumes of these conversions, in FSDP2 and in megatron-core itself,
are cells of the resume matrix (``test_resume_matrix.py``).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import cli
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Manifest
from ckptkit.formats import read
from ckptkit.formats.megatron import split_buckets

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
import _megatron_distopt as md  # noqa: E402  (imports megatron-core lazily, after the skip)


@pytest.fixture(scope="module")
def runs(matrix_sources, tmp_path_factory) -> tuple[Path, Path]:
    """megatron-core's saves (``step-3`` fully parallel, ``step-3-plain`` not, and its per-parameter states), and a
    directory with their HF-named conversions (``hf``, ``hf-plain``) and the model's ``assets``."""
    src, out = matrix_sources / "megatron", tmp_path_factory.mktemp("megatron-distopt")
    md.hf_config().save_pretrained(out / "assets")
    for name, dst in (("step-3", "hf"), ("step-3-plain", "hf-plain")):
        ckptkit.convert(src / name, out / dst, to="sharded", world_size=3, preset="megatron-llama",
                        hf_assets=out / "assets")
    return src, out


def _dcp_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, read by torch's own ``dcp.load`` (one process, no group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


@pytest.mark.parametrize("saved", ["hf", "hf-plain"], ids=["fully-parallel-save", "plain-save"])
def test_convert_splits_the_buckets_into_megatron_cores_own_per_parameter_state(runs, saved):
    src, out = runs
    converted = _dcp_tensors(out / saved)
    oracle = md.per_parameter_states(src)
    assert len(oracle) == 21
    for name, slots in oracle.items():
        for slot in ("exp_avg", "exp_avg_sq"):
            assert not slots[slot].isnan().any(), name
            assert torch.equal(converted[f"optimizer.state.{name}.{slot}"], slots[slot]), (name, slot)
        # The fp32 main parameters, left out, are the float32 weights themselves.
        assert torch.equal(converted[name], slots["param"]), name


def test_convert_reports_the_split_and_the_main_parameters_left_out(runs, tmp_path):
    src, out = runs
    report = ckptkit.convert(src / "step-3", tmp_path / "hf", to="sharded", preset="megatron-llama",
                             hf_assets=out / "assets", dry_run=True)
    assert "optimizer: DistributedOptimizer buckets (3) split into exp_avg, exp_avg_sq of 15 parameters" in report.notes
    assert any(n.startswith("left out: the DistributedOptimizer's fp32 main parameters")
               and n.endswith("they are the float32 weights") for n in report.notes), report.notes
    assert any(n.startswith("optimizer 'optimizer' carried under the mapped names: 9 parameters' state "
                            "(exp_avg, exp_avg_sq, step)") for n in report.notes), report.notes


def test_reshard_keeps_the_buckets_as_megatron_core_saved_them(runs, tmp_path):
    src, _ = runs
    ckptkit.convert(src / "step-3", tmp_path / "same", to="sharded", world_size=2)
    keys = set(read(tmp_path / "same").keys)
    assert {k for k in read(src / "step-3").keys if "bucket_idx_0" in k} <= keys
    assert not any(".state." in k for k in keys)


def _edited(manifest: Manifest, **replace) -> Manifest:
    return dataclasses.replace(manifest, **replace)


def test_split_refuses_the_buckets_of_a_tensor_parallel_run_by_name(runs):
    m = read(runs[0] / "step-3")
    other = [dataclasses.replace(t, key=t.key.replace("dp_group_idx_0", "dp_group_idx_1")) for t in m.tensors
             if "bucket_idx" in t.key]
    with pytest.raises(ckptkit.CheckpointError, match=r"dp_group_idx \[0, 1\].*TP or PP above 1"):
        split_buckets(_edited(m, tensors=(*m.tensors, *other)))


def test_split_refuses_another_sharding_type_by_name(runs):
    m = read(runs[0] / "step-3")
    objects = [dataclasses.replace(o, value="fully_sharded_bucket_space", blob=None)
               if o.key == "optimizer.param_state_sharding_type" else o for o in m.objects]
    with pytest.raises(ckptkit.CheckpointError,
                       match="'fully_sharded_bucket_space'; ckptkit splits .* 'dp_reshardable' only"):
        split_buckets(_edited(m, objects=tuple(objects)))


def test_split_refuses_when_the_parameter_order_cannot_be_recovered(runs):
    # The fully parallel save lists its tensors rank by rank: only megatron-core's module order fits its buckets.
    m = read(runs[0] / "step-3")
    renamed = tuple(dataclasses.replace(t, key=t.key.replace("linear_proj.", "linear_out."), path=None)
                    if t.key.endswith("linear_proj.weight") else t for t in m.tensors)
    with pytest.raises(ckptkit.CheckpointError, match=r"the model's parameter order \(its named_parameters\(\).*cannot "
                       r"be recovered from this checkpoint: the order the checkpoint lists its tensors in: .*; "
                       r"megatron-core's GPTModel order \(local spec\): it has tensors outside its tables"):
        split_buckets(_edited(m, tensors=renamed))
    # A model tensor missing: the buckets hold a parameter the checkpoint does not list.
    without = tuple(t for t in m.tensors if t.key != "output_layer.weight")
    with pytest.raises(ckptkit.CheckpointError, match=r"its 14 parameters do not fill buckets of \[8256, 9344, 5248\]"):
        split_buckets(_edited(m, tensors=without))


def test_split_refuses_param_groups_other_than_megatron_cores_default(runs):
    from ckptkit.formats import object_value

    m = read(runs[0] / "step-3")
    key = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    saved = object_value(m[key])  # type: ignore[arg-type]
    saved[0]["param_groups"][1]["lr_mult"] = 0.5  # a decoupled learning rate: membership not saved
    objects = [dataclasses.replace(o, value=saved, blob=None) if o.key == key else o for o in m.objects]
    with pytest.raises(ckptkit.CheckpointError, match=r"lr_mult=0\.5: which parameter is in which group is not saved"):
        split_buckets(_edited(m, objects=tuple(objects)))


def test_split_refuses_the_groups_of_a_run_that_decays_qk_layernorms(runs):
    import argparse

    from ckptkit.core.manifest import ObjectEntry

    m = read(runs[0] / "step-3")
    args = ObjectEntry("args", ("args",), argparse.Namespace(apply_wd_to_qk_layernorm=True), sidecar="common.pt")
    with pytest.raises(ckptkit.CheckpointError, match="apply_wd_to_qk_layernorm=True: which parameter is in which"):
        split_buckets(_edited(m, objects=(*m.objects, args)))



def test_convert_to_megatron_refuses_to_join_a_model_outside_megatron_cores_tables(runs, tmp_path):
    from ckptkit.formats.megatron import join_buckets

    out = runs[1]
    ckptkit.convert(out / "hf", tmp_path / "megatron", to="megatron", hf_assets=out / "assets")
    model = tuple(t for t in read(tmp_path / "megatron").tensors if not t.key.startswith("optimizer."))
    odd = tuple(dataclasses.replace(t, key=t.key.replace("linear_proj", "linear_out")) for t in model)
    with pytest.raises(ckptkit.CheckpointError, match="not all in megatron-core's GPTModel tables .* parameter order"):
        join_buckets(odd, (), "optimizer")
    halves = tuple(dataclasses.replace(t, dtype=by_name("bfloat16")) for t in model)
    with pytest.raises(ckptkit.CheckpointError, match="weights are not all float32"):
        join_buckets(halves, (), "optimizer")


def _saved_with(tmp_path: Path, groups) -> Path:
    """A one-process ``dcp.save`` of transformers' Llama and an AdamW over ``groups(model)`` after one step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(md.hf_config())
    opt = torch.optim.AdamW(groups(model), lr=md.LR)
    model(md.batch(1, 0, 1)).logits.sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "fsdp"), no_dist=True)
    return tmp_path / "fsdp"


@pytest.mark.parametrize(("groups", "message"), [
    # one group, AdamW's default weight decay on every parameter, norms included
    (lambda m: m.parameters(), r"'decoder\.layers\.self_attention\.linear_qkv\.layer_norm_weight' \(a 1-D parameter "
                               r"or bias\) trained with weight_decay=0\.01: megatron-core decays no 1-D parameter or "
                               r"bias"),
    # the embedding at a rate of its own
    (lambda m: [{"params": [m.model.embed_tokens.weight], "lr": 1e-3},
                {"params": [p for n, p in m.named_parameters() if n != "model.embed_tokens.weight"]}],
     r"'decoder\.layers\.self_attention\.linear_proj\.weight' has lr=0\.01 where 'embedding\.word_embeddings\."
     r"weight' has 0\.001: megatron-core keeps all decayed parameters in one param group"),
], ids=["norms-decayed", "embedding-lr"])
def test_convert_to_megatron_refuses_param_groups_megatron_cores_grouping_cannot_hold_naming_the_parameter(
        runs, tmp_path, groups, message):
    src = _saved_with(tmp_path, groups)
    result = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "megatron"), "--to", "megatron",
                                      "--hf-assets", str(runs[1] / "assets")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "megatron").exists()

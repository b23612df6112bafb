"""megatron-core's DistributedOptimizer, saved ``dp_reshardable``, resumes in plain FSDP2 through ckptkit
(:mod:`_megatron_distopt`).

megatron-core trains its tiny Llama (float32 parameters) with its DistributedOptimizer on 2 data-parallel gloo
ranks for 3 steps and saves as Megatron-LM does: the optimizer's state as flat per-bucket buffers. ckptkit
converts it with ``--preset megatron-llama`` into an HF-named FSDP2 DCP at 3 ranks, model and optimizer. Two
oracles: megatron-core's own per-parameter state at the save (``_get_main_param_and_optimizer_states`` over
each rank's range of each parameter), which the converted moments equal exactly; and the run itself, which
the conversion resumed in FSDP2 with transformers' Llama and torch's AdamW (steps 4-6) follows, losses,
weights and logits, where a fresh AdamW does not.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.core.dtypes import by_name
from ckptkit.core.manifest import Manifest
from ckptkit.formats import read
from ckptkit.formats.megatron import split_buckets

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
import _megatron_distopt as md  # noqa: E402  (imports megatron-core lazily, after the skip)
from _spawn import spawn  # noqa: E402

NOISE = 1e-5
"""megatron-core's and transformers' forwards differ in float rounding: the resumed run stays within 1e-6 of
the uninterrupted one."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    out = tmp_path_factory.mktemp("megatron-distopt")
    spawn(md.megatron_run, 2, str(out))
    md.hf_config().save_pretrained(out / "assets")
    for src, dst in (("step-3", "hf"), ("step-3-plain", "hf-plain")):
        ckptkit.convert(out / src, out / dst, to="sharded", world_size=3, preset="megatron-llama",
                        hf_assets=out / "assets")
    spawn(md.resume, 2, str(out / "hf"), str(out))
    return out, torch.load(out / "expected.pt", weights_only=True), torch.load(out / "resumed.pt", weights_only=True)


def _dcp_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, read by torch's own ``dcp.load`` (one process, no group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _megatron_states(out: Path, prefix: str = "states") -> dict[str, dict[str, torch.Tensor]]:
    """megatron-core's per-parameter state (``<prefix><rank>.pt``), every rank's range put in place, under HF
    names."""
    whole: dict[str, dict[str, torch.Tensor]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in range(2):
        for name, (shape, start, end, states) in torch.load(out / f"{prefix}{rank}.pt", weights_only=True).items():
            shapes[name] = shape
            for slot, value in states.items():
                numel = int(torch.tensor(shape).prod())
                whole.setdefault(name, {}).setdefault(slot, torch.full((numel,), float("nan")))[start:end] = value
    hf: dict[str, dict[str, torch.Tensor]] = {}
    for name, slots in whole.items():
        for slot, flat in slots.items():
            for key, value in md.to_hf(name, flat.reshape(shapes[name])).items():
                hf.setdefault(key, {})[slot] = value
    return hf


@pytest.mark.parametrize("saved", ["hf", "hf-plain"], ids=["fully-parallel-save", "plain-save"])
def test_convert_splits_the_buckets_into_megatron_cores_own_per_parameter_state(runs, saved):
    out, _, _ = runs
    converted = _dcp_tensors(out / saved)
    oracle = _megatron_states(out)
    assert len(oracle) == 21
    for name, slots in oracle.items():
        for slot in ("exp_avg", "exp_avg_sq"):
            assert not slots[slot].isnan().any(), name
            assert torch.equal(converted[f"optimizer.state.{name}.{slot}"], slots[slot]), (name, slot)
        # The fp32 main parameters, left out, are the float32 weights themselves.
        assert torch.equal(converted[name], slots["param"]), name


def test_convert_megatron_distributed_optimizer_resumes_in_fsdp2_on_the_trajectory(runs):
    _, expected, resumed = runs
    run = resumed["resumed"]
    assert run["losses"] == pytest.approx(expected["losses"][md.SAVED:], abs=NOISE)
    assert run["model"].keys() == expected["model"].keys()
    worst = max((run["model"][k] - expected["model"][k]).abs().max().item() for k in expected["model"])
    assert worst < NOISE, worst
    assert (run["logits"] - expected["logits"]).abs().max().item() < NOISE


def test_resume_with_a_fresh_adamw_leaves_the_megatron_trajectory_by_far_more_than_the_tolerance(runs):
    _, expected, resumed = runs
    control, oracle = resumed["fresh optimizer"]["model"], expected["model"]
    assert max((control[k] - oracle[k]).abs().max().item() for k in oracle) > 100 * NOISE


def test_convert_reports_the_split_and_the_main_parameters_left_out(runs, tmp_path):
    out, _, _ = runs
    report = ckptkit.convert(out / "step-3", tmp_path / "hf", to="sharded", preset="megatron-llama",
                             hf_assets=out / "assets", dry_run=True)
    assert "optimizer: DistributedOptimizer buckets (3) split into exp_avg, exp_avg_sq of 15 parameters" in report.notes
    assert any(n.startswith("left out: the DistributedOptimizer's fp32 main parameters")
               and n.endswith("they are the float32 weights") for n in report.notes), report.notes
    assert any(n.startswith("optimizer 'optimizer' carried under the mapped names: 9 parameters' state "
                            "(exp_avg, exp_avg_sq, step)") for n in report.notes), report.notes


def test_reshard_keeps_the_buckets_as_megatron_core_saved_them(runs, tmp_path):
    out, _, _ = runs
    ckptkit.convert(out / "step-3", tmp_path / "same", to="sharded", world_size=2)
    keys = set(read(tmp_path / "same").keys)
    assert {k for k in read(out / "step-3").keys if "bucket_idx_0" in k} <= keys
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



@pytest.fixture(scope="module")
def joined(runs) -> tuple[Path, dict]:
    """The run's conversion converted back with ``--to megatron``, and megatron-core's own resume of it."""
    out = runs[0]
    report = ckptkit.convert(out / "hf", out / "megatron", to="megatron", hf_assets=out / "assets")
    assert any("joined into megatron-core's DistributedOptimizer bucket" in n for n in report.notes), report.notes
    spawn(md.megatron_resume, 2, str(out / "megatron"), str(out))
    return out, torch.load(out / "megatron-resumed.pt", weights_only=True)


def test_convert_to_megatron_joins_the_state_megatron_cores_own_load_restores(joined):
    out, _ = joined
    loaded, saved = _megatron_states(out, "loaded"), _megatron_states(out)
    assert loaded.keys() == saved.keys()
    for name, slots in saved.items():
        for slot in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[name][slot], slots[slot]), (name, slot)


def test_convert_to_megatron_resumes_in_megatron_core_on_the_trajectory(runs, joined):
    _, expected, _ = runs
    _, resumed = joined
    assert resumed["losses"] == pytest.approx(expected["losses"][md.SAVED:], abs=NOISE)
    worst = max((resumed["model"][k] - expected["model"][k]).abs().max().item() for k in expected["model"])
    assert worst < NOISE, worst
    assert (resumed["logits"] - expected["logits"]).abs().max().item() < NOISE


def test_convert_to_megatron_refuses_to_join_a_model_outside_megatron_cores_tables(joined):
    from ckptkit.formats.megatron import join_buckets

    model = tuple(t for t in read(joined[0] / "megatron").tensors if not t.key.startswith("optimizer."))
    odd = tuple(dataclasses.replace(t, key=t.key.replace("linear_proj", "linear_out")) for t in model)
    with pytest.raises(ckptkit.CheckpointError, match="not all in megatron-core's GPTModel tables .* parameter order"):
        join_buckets(odd, (), "optimizer")
    halves = tuple(dataclasses.replace(t, dtype=by_name("bfloat16")) for t in model)
    with pytest.raises(ckptkit.CheckpointError, match="weights are not all float32"):
        join_buckets(halves, (), "optimizer")


def test_convert_to_megatron_refuses_plain_torch_param_groups_by_the_fields_megatron_core_needs(runs, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(md.hf_config())
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.dim() > 1]},
                             {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}])
    model(md.batch(1, 0, 1)).logits.sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "fsdp"), no_dist=True)
    with pytest.raises(ckptkit.CheckpointError, match=r"param group 0 .* needs the group's wd_mult, lr_mult, "
                                                      r"is_expert_parallel, is_decoupled_lr"):
        ckptkit.convert(tmp_path / "fsdp", tmp_path / "megatron", to="megatron", hf_assets=runs[0] / "assets")

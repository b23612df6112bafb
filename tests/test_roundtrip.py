"""Round trips between FULL (``torch.save``), SHARDED (DCP at 1-3 ranks) and HF safetensors, bit for bit.

Every result is read back by torch's own loaders; ``verify`` is checked as well, never alone.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from _checks import (
    assert_same_tree,
    flat_tensors,
    load_dcp,
    load_full,
    load_hf,
    make_training_state,
    make_zoo,
    random_bits,
)
from ckptkit.core.manifest import Format
from ckptkit.errors import UsageError
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.inspect import inspect
from ckptkit.ops.verify import verify

# form name -> (ckptkit format, world size)
FORMS = {
    "full": ("full", 1),
    "sharded1": ("sharded", 1),
    "sharded2": ("sharded", 2),
    "sharded3": ("sharded", 3),
    "hf": ("hf", 1),
}


def _dst_name(form: str) -> str:
    return "out.pt" if form == "full" else form


def read_with_torch(path: Path, form: str, scratch: Path):
    fmt = FORMS.get(form, ("sharded", 1))[0]
    if fmt == "full":
        return load_full(path)
    if fmt == "sharded":
        return load_dcp(path, scratch / f"{path.name}.consolidated.pt")
    return load_hf(path)


def make_source(form: str, root: Path):
    """(path, the state torch's own loader reads from it). ``torch-dcp`` is written by torch itself."""
    root.mkdir()
    state = make_training_state()
    if form == "hf":
        from safetensors.torch import save_file

        save_file(make_zoo(), root / "model.safetensors")
        return root, make_zoo()
    torch.save(state, root / "src.pt")
    if form == "full":
        return root / "src.pt", state
    if form == "torch-dcp":
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

        torch_save_to_dcp(str(root / "src.pt"), str(root / "dcp"))
        return root / "dcp", load_dcp(root / "dcp", root / "dcp.consolidated.pt")
    convert(root / "src.pt", root / form, to="sharded", world_size=FORMS[form][1])
    return root / form, state


@pytest.mark.parametrize("source", [
    "full",        # torch.save of a nested training state
    "torch-dcp",   # torch's own torch_save_to_dcp of it (one rank, torch's writer)
    "sharded1",    # ckptkit's DCP for 1 rank
    "sharded2",    # ckptkit's DCP for 2 ranks: 5, 7, 11 rows split unevenly
    "sharded3",    # ckptkit's DCP for 3 ranks: a 2-row tensor leaves rank 2 without rows
    "hf",          # safetensors.torch.save_file of the flat tensors
])
@pytest.mark.parametrize("target", [
    "full",        # one torch.save file
    "sharded1",    # DCP for 1 rank
    "sharded2",    # DCP for 2 ranks
    "sharded3",    # DCP for 3 ranks
    "hf",          # model.safetensors
])
def test_convert_round_trip_is_bit_exact(tmp_path, source, target):
    src, src_state = make_source(source, tmp_path / "src")
    fmt, ws = FORMS[target]
    dst1 = tmp_path / _dst_name(target)
    report = convert(src, dst1, to=fmt, world_size=ws)

    # HF holds the model part under its own names; FULL and SHARDED keep nesting and non-tensor entries.
    lossy = "hf" in (source, target)
    expected = make_zoo() if lossy else src_state
    assert_same_tree(read_with_torch(dst1, target, tmp_path), expected, f"{source}->{target}")
    assert report.tensors == len(flat_tensors(expected))

    back_form = "sharded1" if source == "torch-dcp" else source
    back_fmt, back_ws = FORMS[back_form]
    dst2 = tmp_path / ("back.pt" if back_fmt == "full" else "back")
    convert(dst1, dst2, to=back_fmt, world_size=back_ws)
    assert_same_tree(read_with_torch(dst2, back_form, tmp_path), expected, f"{source}->{target}->{source}")

    assert verify(dst1, dst2).ok
    if not lossy:
        assert verify(src, dst1).ok
        assert verify(src, dst2).ok
    else:
        assert verify(src, dst1, model_only=True).ok
        # Optimizer state and counters stay out of HF: against an HF side, the other's model part is compared.
        report = verify(src, dst1)
        assert report.ok and any("(as --model-only)" in n for n in report.notes) == (source != target)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_convert_sharded_lays_out_torch_chunk_rows(tmp_path, full_ckpt, world_size):
    dst = tmp_path / "dcp"
    report = convert(full_ckpt, dst, to="sharded", world_size=world_size)
    assert sorted(p.name for p in dst.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(world_size)),
                                                     "meta.pt"]
    assert report.world_size == world_size and report.files == world_size + 2
    # Lightning's meta.pt: what is neither model nor optimizer (also kept in the DCP, for DCP's own loaders)
    assert torch.load(dst / "meta.pt", weights_only=True) == {"step": 7, "name": "run-1"}

    manifest = inspect(dst)
    assert manifest.world_size == world_size
    for key, t in flat_tensors(make_training_state()).items():
        boxes = [(c.offsets, c.sizes) for c in manifest[key].chunks]
        if t.dim() == 0 or t.numel() == 0:
            expected = [((0,) * t.dim(), tuple(t.shape))]  # scalars and empty tensors live whole on rank 0
        else:  # FSDP2's Shard(0): torch.chunk rows, the last ranks may hold fewer or none
            starts = [0, *torch.tensor([p.shape[0] for p in torch.chunk(t, world_size)]).cumsum(0).tolist()]
            expected = [((begin, *[0] * (t.dim() - 1)), (end - begin, *t.shape[1:]))
                        for begin, end in itertools.pairwise(starts)]
        assert boxes == expected, key


def test_inspect_world_size_counts_ranks_without_rows(tmp_path):
    torch.save({"a": torch.randn(2, 3), "b": torch.tensor(1.0)}, tmp_path / "small.pt")
    report = convert(tmp_path / "small.pt", tmp_path / "dcp", to="sharded", world_size=3)
    assert report.world_size == 3 and (tmp_path / "dcp" / "__2_0.distcp").is_file()
    assert inspect(tmp_path / "dcp").world_size == 3


def test_convert_full_keeps_objects_and_nesting(tmp_path, full_ckpt, training_state):
    dcp = tmp_path / "dcp3"
    convert(full_ckpt, dcp, to="sharded", world_size=3)
    consolidated = load_dcp(dcp, tmp_path / "c.pt")
    assert consolidated["step"] == 7 and consolidated["name"] == "run-1"
    assert consolidated["optimizer"]["param_groups"] == [
        {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "foreach": None, "params": ["f32"]}]
    convert(dcp, tmp_path / "back.pt", to="full")
    assert_same_tree(load_full(tmp_path / "back.pt"), training_state)


@pytest.mark.parametrize("route", [
    ("full",),              # torch.save -> ckptkit FULL: int keys stay ints
    ("sharded", "full"),    # torch.save -> DCP -> FULL: DCP stores dict keys as str, as torch's own writer does
])
def test_convert_full_keeps_int_keyed_optimizer_state(tmp_path, route):
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}, 2: {"exp_avg": torch.zeros(3)}},
                           "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}}
    torch.save(state, tmp_path / "src.pt")
    src = tmp_path / "src.pt"
    for i, fmt in enumerate(route):
        dst = tmp_path / (f"step{i}.pt" if fmt == "full" else f"step{i}")
        convert(src, dst, to=fmt, world_size=2 if fmt == "sharded" else None)
        src = dst
    out = load_full(src)
    assert isinstance(out["optimizer"]["state"], dict), type(out["optimizer"]["state"])
    if "sharded" in route:
        state["optimizer"]["state"] = {str(k): v for k, v in state["optimizer"]["state"].items()}
    assert_same_tree(out, state)


def test_convert_sharded_int_keyed_dict_stays_a_dict_for_torch(tmp_path):
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}}
    torch.save(state, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "dcp", to="sharded")
    restored = load_dcp(tmp_path / "dcp", tmp_path / "c.pt")["optimizer"]["state"]
    assert isinstance(restored, dict), type(restored)


def test_convert_reads_strided_views_and_shared_storage(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    embed = torch.randn(5, 3)
    views = {
        "transposed": base.t(),                   # strides (1, 6)
        "row_slice": base[1:3],                   # storage offset 6
        "column_slice": base[:, 2:5],             # rows 6 apart, 3 elements each
        "every_other": base[::2, ::3],            # strides (12, 3)
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0 along dim 0
        "embed": embed,
        "tied_head": embed,                       # the same tensor twice, one storage in the file
        "half_int": torch.arange(10, dtype=torch.int16)[3:7],
    }
    torch.save(views, tmp_path / "views.pt")
    expected = {k: v.contiguous() for k, v in views.items()}
    for form in ("full", "sharded2", "sharded3", "hf"):
        fmt, ws = FORMS[form]
        dst = tmp_path / _dst_name(form)
        convert(tmp_path / "views.pt", dst, to=fmt, world_size=ws)
        assert_same_tree(read_with_torch(dst, form, tmp_path), expected, form)
        assert verify(tmp_path / "views.pt", dst).ok


@pytest.mark.parametrize("top", [
    pytest.param(torch.arange(12.0).reshape(3, 4), id="bare-tensor"),        # torch.save(tensor)
    pytest.param([torch.ones(2), torch.zeros(1)], id="top-level-list"),       # torch.save([t0, t1])
    pytest.param({}, id="empty-dict"),                                        # torch.save({})
])
def test_convert_full_keeps_non_dict_top_level(tmp_path, top):
    torch.save(top, tmp_path / "t.pt")
    convert(tmp_path / "t.pt", tmp_path / "out.pt", to="full")
    assert_same_tree(load_full(tmp_path / "out.pt"), top)


ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool, torch.complex64,
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_convert_every_dtype_bit_exact(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.rand(5, 3, generator=g) > 0.5 if dtype == torch.bool else random_bits((5, 3), dtype, g)
    # pickle protocol 4 (STACK_GLOBAL, frames) as some trainers save; a Parameter beside the plain tensor
    torch.save({"t": t, "p": torch.nn.Parameter(t.clone(), requires_grad=False)}, tmp_path / "src.pt",
               pickle_protocol=4)
    expected = {"t": t, "p": t}
    for form in ("full", "sharded2", "sharded3", "hf"):
        fmt, ws = FORMS[form]
        convert(tmp_path / "src.pt", tmp_path / _dst_name(form), to=fmt, world_size=ws)
        got = read_with_torch(tmp_path / _dst_name(form), form, tmp_path)
        plain = {key: value.data if isinstance(value, torch.nn.Parameter) else value for key, value in got.items()}
        assert_same_tree(plain, expected, form)


def test_convert_keeps_tensors_inside_objects(tmp_path):
    # A tensor inside a tuple (an RNG state, say) is part of a non-tensor entry and travels with it.
    state = {"rng": (torch.arange(3), 5), "mixed": [torch.ones(1, dtype=torch.bfloat16), "a"], "lst": [1, 2]}
    torch.save(state, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "dcp", to="sharded", world_size=2)
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "c.pt"), state)
    convert(tmp_path / "dcp", tmp_path / "back.pt", to="full")
    assert_same_tree(load_full(tmp_path / "back.pt"), state)
    assert verify(tmp_path / "src.pt", tmp_path / "back.pt").ok


def test_convert_full_to_directory_and_shards(tmp_path, hf_ckpt, zoo):
    # No file suffix: a directory holding pytorch_model.bin.
    convert(hf_ckpt, tmp_path / "fulldir", to="full")
    assert sorted(p.name for p in (tmp_path / "fulldir").iterdir()) == ["pytorch_model.bin"]
    assert_same_tree(load_full(tmp_path / "fulldir" / "pytorch_model.bin"), zoo)

    # A shard size: pytorch_model-0000i-of-0000n.bin files and their index, HF style.
    import json

    convert(hf_ckpt, tmp_path / "shards", to="full", max_shard_size=200)
    index = json.loads((tmp_path / "shards" / "pytorch_model.bin.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and set(index["weight_map"]) == set(zoo)
    merged = {}
    for name in files:
        part = load_full(tmp_path / "shards" / name)
        assert all(index["weight_map"][k] == name for k in part)
        merged.update(part)
    assert_same_tree(merged, zoo)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in zoo.values())

    # ...and ckptkit reads its sharded FULL output back.
    convert(tmp_path / "shards", tmp_path / "again", to="hf")
    assert_same_tree(load_hf(tmp_path / "again"), zoo)


def test_convert_full_shards_refuse_non_tensor_entries(tmp_path, full_ckpt):
    with pytest.raises(UsageError, match=r"holds model tensors only, but the checkpoint has 7 non-tensor entries"):
        convert(full_ckpt, tmp_path / "shards", to="full", max_shard_size="1KB")
    assert not (tmp_path / "shards").exists()


def test_reshard_changes_world_size_only(tmp_path, dcp_ckpt, training_state):
    report = reshard(dcp_ckpt, tmp_path / "dcp3", world_size=3)
    assert report.world_size == 3 and report.destination_format is Format.SHARDED
    assert inspect(tmp_path / "dcp3").world_size == 3
    assert_same_tree(load_dcp(tmp_path / "dcp3", tmp_path / "c.pt"), training_state)
    assert verify(dcp_ckpt, tmp_path / "dcp3").ok


@pytest.mark.parametrize("source", [
    "full",  # a torch.save file
    "hf",    # a safetensors directory
])
def test_reshard_refuses_unsharded_input(tmp_path, source, full_ckpt, hf_ckpt):
    src = full_ckpt if source == "full" else hf_ckpt
    article = "an" if source == "hf" else "a"
    with pytest.raises(UsageError, match=rf"is {article} {source} checkpoint, not a sharded one; use 'ckptkit convert"):
        reshard(src, tmp_path / "out", world_size=2)


def test_convert_report_counts(tmp_path, full_ckpt, training_state):
    report = convert(full_ckpt, tmp_path / "dcp", to="sharded", world_size=2)
    tensors = flat_tensors(training_state)
    # objects: 5 param-group fields, step, name; files: 2 ranks, .metadata, meta.pt
    assert (report.tensors, report.objects, report.files) == (len(tensors), 7, 4)
    assert report.source_format is Format.FULL
    assert report.bytes >= sum(t.numel() * t.element_size() for t in tensors.values())
    assert report.lines()[0] == f"{full_ckpt} (full) -> {tmp_path / 'dcp'} (sharded for 2 ranks)"


def test_verify_reports_each_difference(tmp_path, zoo):
    torch.save(zoo, tmp_path / "a.pt")
    changed = dict(zoo)
    changed["tall"] = zoo["tall"].clone()
    changed["tall"].view(torch.int32)[7, 2] ^= 1  # one bit of one element in row 7
    changed["i64"] = zoo["i64"].to(torch.int32)
    changed["f16"] = zoo["f16"][:3]
    del changed["single"]
    changed["new"] = torch.ones(1)
    torch.save(changed, tmp_path / "b.pt")
    report = verify(tmp_path / "a.pt", tmp_path / "b.pt", max_memory=64)
    assert not report.ok
    got = {d.key: d.what for d in report.differences}
    was, now = zoo["tall"][7, 2], changed["tall"][7, 2]
    assert got == {
        "single": f"only in {tmp_path / 'a.pt'}",
        "new": f"only in {tmp_path / 'b.pt'}",
        "i64": "dtype int64 vs int32",
        "f16": "shape [4] vs [3]",
        # 64 bytes of budget: the bytes compare in blocks of 2 rows; the element is named by its index
        "tall": f"1 of 44 elements differ bit for bit; max abs diff {abs(was - now):.6g}, max rel diff "
                f"{abs((was - now) / now):.6g}; first at [7, 2]: {was.item()!r} vs {now.item()!r}",
    }


def test_verify_compares_objects_and_nan_bits(tmp_path):
    a = {"x": torch.tensor([math.nan, 0.0]), "step": 7}
    b = {"x": torch.tensor([math.nan, -0.0]), "step": 8}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    got = {d.key: d.what for d in verify(tmp_path / "a.pt", tmp_path / "b.pt").differences}
    assert set(got) == {"x", "step"}  # +0.0 and -0.0 differ in bits; NaN equals the same NaN
    assert got["step"] == "value 7 vs 8"
    assert verify(tmp_path / "a.pt", tmp_path / "a.pt").ok


def test_convert_empty_containers_kept_in_every_form_with_a_note_on_the_dicts_torch_passes_over(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(3, 2)}, "scaler": {}, "hooks": []}
    torch.save(state, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "back.pt", to="full")
    assert_same_tree(load_full(tmp_path / "back.pt"), state)  # FULL -> FULL loses nothing
    report = convert(tmp_path / "src.pt", tmp_path / "dcp", to="sharded", world_size=2)
    # torch's DCP stores an empty list as an entry but no empty dict: ckptkit records that in .metadata's
    # planner data, which torch's loaders pass over, and says so.
    assert any("empty dicts recorded in .metadata's planner data" in n and "scaler" in n for n in report.notes)
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "c.pt"), {"model": state["model"], "hooks": []})
    convert(tmp_path / "dcp", tmp_path / "again.pt", to="full")
    assert_same_tree(load_full(tmp_path / "again.pt"), state)

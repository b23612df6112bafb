"""LOCAL checkpoints that FSDP1 saved under ``MixedPrecision`` (bf16 or fp16 parameters, fp32 reduction and
buffers), with ``use_orig_params`` on and off, at 2 and 3 ranks.

With ``use_orig_params`` FSDP aligns every parameter to 16 bytes of the low-precision dtype (8 elements, not
4), while the saved flat parameter stays float32: ``--param-dtype`` tells ckptkit. The ground truth is what
FSDP itself gathers under FULL_STATE_DICT, taken before the LOCAL save; LOCAL output re-laid for the other
world size is loaded into real FSDP1 ranks under the same MixedPrecision and gathered again. One spawned
group per world size saves every case of that size (and loads what was re-laid for it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from _checks import assert_same_tree, load_dcp, load_full, load_hf
from _fsdp1 import AUTO_WRAP, MODEL, load_and_gather, train_and_save
from ckptkit.cli import cli
from ckptkit.errors import FormatError, UsageError
from ckptkit.formats import LocalOptions
from ckptkit.formats.local.derive import derive_layout
from ckptkit.formats.local.layout import LAYOUT_FILE, FlatLayout, FlatParam, FlatUnit
from ckptkit.harness.launch import run_ranks
from ckptkit.ops.convert import convert, reshard
from test_local import expected_optim, joined_optim

# (param dtype, use_orig_params, world size): every combination the issue names.
CASES = [(dtype, uop, world) for dtype in ("bfloat16", "float16") for uop in (False, True) for world in (2, 3)]
IDS = [f"{dtype}-{'orig' if uop else 'flat'}-ws{world}" for dtype, uop, world in CASES]
OTHER = {2: 3, 3: 2}
"""The world size each case is re-laid for."""


def _ranks(rank: int, world: int, saves: list[tuple[str, bool, str]],
           loads: list[tuple[str, list[tuple[str, str, bool, bool, str]]]]) -> None:
    for out, use_orig_params, dtype in saves:
        train_and_save(rank, world, out, use_orig_params, dtype)
    for dtype, jobs in loads:
        load_and_gather(rank, world, jobs, dtype)


def _local(dtype: str | None, **kw) -> dict:
    return {"local": LocalOptions(model=MODEL, auto_wrap=AUTO_WRAP, param_dtype=dtype, **kw)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, bool, int], Path]:
    """Each case's directory: what ``_fsdp1.train_and_save`` writes, ``relaid/`` (its training checkpoint
    re-laid by ckptkit for the other world size) and ``relaid.pt`` (what FSDP1 loaded from that and gathered).

    Three groups: 2 ranks save, 3 ranks save and load what 2 saved, 2 ranks load what 3 saved."""
    root = tmp_path_factory.mktemp("fsdp1-mixed")
    dirs = {case: root / name for case, name in zip(CASES, IDS, strict=True)}
    for d in dirs.values():
        d.mkdir()

    def saves(world: int) -> list[tuple[str, bool, str]]:
        return [(str(d), uop, dtype) for (dtype, uop, w), d in dirs.items() if w == world]

    def relay_and_loads(world: int) -> list[tuple[str, list[tuple[str, str, bool, bool, str]]]]:
        """Re-lay the training checkpoints saved at ``world`` for the other size; the loads that check them."""
        loads: dict[str, list] = {}
        for (dtype, uop, w), d in dirs.items():
            if w == world:
                reshard(d / "train", d / "relaid", world_size=OTHER[world], **_local(dtype))
                loads.setdefault(dtype, []).append((str(d / "relaid"), "model_rank_{rank}.pt", uop, True,
                                                    str(d / "relaid.pt")))
        return list(loads.items())

    run_ranks(_ranks, 2, saves(2), [])
    run_ranks(_ranks, 3, saves(3), relay_and_loads(2))
    run_ranks(_ranks, 2, [], relay_and_loads(3))
    return dirs


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_local_mixed_precision_converts_to_every_form(runs, case, tmp_path):
    dtype, uop, world = case
    d, full = runs[case], load_full(runs[case] / "full.pt")
    convert(d / "model", tmp_path / "full.pt", to="full", **_local(dtype))
    assert_same_tree(load_full(tmp_path / "full.pt"), full)
    convert(d / "train", tmp_path / "train.pt", to="full", **_local(dtype))
    got = load_full(tmp_path / "train.pt")
    assert_same_tree(got["model"], full, "model")
    assert_same_tree(got["optim"], expected_optim(d, uop, world), "optim")
    convert(d / "model", tmp_path / "hf", to="hf", **_local(dtype))
    assert_same_tree(load_hf(tmp_path / "hf"), full)
    convert(d / "model", tmp_path / "dcp", to="sharded", world_size=OTHER[world], **_local(dtype))
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "scratch.pt"), full)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_local_mixed_precision_relaid_loads_into_fsdp1_at_the_other_world_size(runs, case):
    dtype, uop, world = case
    d = runs[case]
    assert FlatLayout.from_json((d / "relaid" / LAYOUT_FILE).read_bytes(), where="").param_dtype == dtype
    got = load_full(d / "relaid.pt")
    assert_same_tree(got["model"], load_full(d / "full.pt"), "model")
    if uop:  # each rank's own part of each parameter's state, joined (see test_local.expected_optim)
        state = joined_optim([Path(f"{d / 'relaid.pt'}.rank{r}") for r in range(OTHER[world])])
        assert_same_tree(state, expected_optim(d, uop, world)["state"], "optim")
    else:
        assert_same_tree(got["optim"], expected_optim(d, uop, world), "optim")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_derive_layout_with_param_dtype_is_the_live_models(runs, case):
    dtype, uop, world = case
    live = FlatLayout.from_json((runs[case] / "layout_of.json").read_bytes(), where="layout_of")
    derived = derive_layout(MODEL, AUTO_WRAP, world_size=world, use_orig_params=uop, param_dtype=dtype)
    assert (derived.units, derived.param_dtype) == (live.units, live.param_dtype) and live.param_dtype == dtype
    full_precision = derive_layout(MODEL, AUTO_WRAP, world_size=world, use_orig_params=uop)
    # Only use_orig_params aligns: there the 2-byte dtype moves the offsets.
    assert (full_precision.units != live.units) is uop


def test_local_mixed_precision_error_names_param_dtype(runs, tmp_path):
    d = runs[("bfloat16", True, 2)]
    with pytest.raises(UsageError, match=r"fit the layout FSDP1 gives fixtures_models:tiny .* with use_orig_params "
                                         r"under mixed precision, not in the model's own dtype; "
                                         r"pass --param-dtype bf16"):
        convert(d / "model", tmp_path / "out.pt", to="full", **_local(None))
    # Without use_orig_params FSDP does not align, and mixed precision changes nothing in the layout.
    flat = runs[("bfloat16", False, 2)]
    convert(flat / "model", tmp_path / "flat.pt", to="full", **_local(None))
    assert_same_tree(load_full(tmp_path / "flat.pt"), load_full(flat / "full.pt"))


def test_cli_param_dtype(runs, tmp_path):
    d = runs[("float16", True, 3)]
    args = ["convert", str(d / "model"), str(tmp_path / "l2"), "--to", "local", "--world-size", "2", "--model", MODEL,
            "--auto-wrap", AUTO_WRAP, "-q"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "pass --param-dtype bf16" in result.output, result.output
    result = CliRunner().invoke(cli, [*args, "--param-dtype", "float16", "--use-orig-params"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "l2")])
    assert "param dtype: float16" in result.output and "use_orig_params: true" in result.output, result.output
    result = CliRunner().invoke(cli, [*args, "--param-dtype", "int8"])
    assert result.exit_code == 2 and "'int8' is not one of 'bf16'" in result.output, result.output


def test_flat_layout_json_param_dtype_is_optional_and_checked():
    units = (FlatUnit("_flat_param", (FlatParam("w", (3,), 0), FlatParam("b", (2,), 8))),)
    old = FlatLayout(units, True).to_json()  # as ckptkit wrote it before the field: no key, version 1
    assert b"param_dtype" not in old and b'"version": 1' in old
    assert FlatLayout.from_json(old, where="old").param_dtype is None
    new = FlatLayout(units, True, param_dtype="bfloat16").to_json()
    assert FlatLayout.from_json(new, where="new") == FlatLayout(units, True, param_dtype="bfloat16")
    with pytest.raises(FormatError, match=r"bad: not a ckptkit flat layout \(TypeError: expected a floating dtype "
                                          r"name .*found 'int8'\)"):
        FlatLayout.from_json(new.replace(b'"bfloat16"', b'"int8"'), where="bad")

"""ckptkit.ops.verify: bit for bit, and by value within --atol/--rtol across dtypes, with numbers per differing
tensor. Expected numbers are computed here with torch on the whole tensors; ckptkit computes them block by block."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from ckptkit.cli import cli
from ckptkit.ops import verify as verify_module
from ckptkit.ops.export import export_hf
from ckptkit.ops.verify import SCHEMA_VERSION, verify


@pytest.fixture
def fp32_and_bf16(tmp_path):
    """A float32 checkpoint and its bfloat16 export."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g), "n": torch.arange(4)}
    torch.save(state, tmp_path / "a.pt")
    export_hf(tmp_path / "a.pt", tmp_path / "hf", dtype="bf16")
    return state, tmp_path / "a.pt", tmp_path / "hf"


def test_verify_bit_for_bit_names_the_dtypes_and_suggests_tolerances(fp32_and_bf16):
    _, a, hf = fp32_and_bf16
    report = verify(a, hf)
    assert {d.key: d.what for d in report.differences} == {"w": "dtype float32 vs bfloat16",
                                                           "b": "dtype float32 vs bfloat16"}
    assert report.lines()[-1] == "  (--atol/--rtol compare values across dtypes)"


def test_verify_within_tolerance_across_dtypes_is_equal(fp32_and_bf16):
    _, a, hf = fp32_and_bf16
    report = verify(a, hf, atol=1e-2, rtol=1e-2)
    assert report.ok and report.numeric
    assert report.lines()[-1] == "equal"
    assert "compared within atol 0.01, rtol 0.01" in report.lines()[0]


def test_verify_numbers_of_a_difference_are_torch_s(fp32_and_bf16):
    state, a, hf = fp32_and_bf16
    report = verify(a, hf, rtol=1e-3)  # atol 0: bf16 rounding puts most elements out
    d = {x.key: x for x in report.differences}["w"]
    w, bf = state["w"].double(), state["w"].to(torch.bfloat16).double()
    off = ~torch.isclose(w, bf, rtol=1e-3, atol=0.0)
    assert d.mismatched == int(off.sum()) and d.total == 30
    assert d.max_abs_diff == (w - bf).abs().max().item()
    assert d.max_rel_diff == ((w - bf).abs() / bf.abs()).max().item()
    first = tuple(torch.nonzero(off)[0].tolist())
    assert d.first_index == first
    assert (d.value_a, d.value_b) == (state["w"][first].item(), state["w"].to(torch.bfloat16)[first].item())
    assert d.what.startswith(f"{d.mismatched} of 30 elements outside atol 0 + rtol 0.001 (float32 vs bfloat16); ")


def test_verify_first_index_is_global_across_row_blocks(tmp_path, monkeypatch):
    # 10 rows of 4 float32 under a budget of 200 bytes: each element costs its bytes on both sides plus their
    # float64 copies, difference and mask (57 bytes), so a block is one 16-byte row. The differences in rows 7
    # and 9 are reported at their indices in the whole tensor.
    a = torch.zeros(10, 4)
    b = a.clone()
    b[7, 1] = 0.5
    b[9, 3] = -2.0
    torch.save({"w": a}, tmp_path / "a.pt")
    torch.save({"w": b}, tmp_path / "b.pt")
    sizes: list[int] = []
    real = verify_module.read_region
    monkeypatch.setattr(verify_module, "read_region", lambda r, f: sizes.append(r.nbytes) or real(r, f))
    d = verify(tmp_path / "a.pt", tmp_path / "b.pt", atol=0.1, max_memory=200).differences[0]
    assert (d.first_index, d.value_a, d.value_b, d.mismatched, d.max_abs_diff) == ((7, 1), 0.0, 0.5, 2, 2.0)
    assert d.max_rel_diff == 1.0  # |a - b| / |b| with a = 0
    assert set(sizes) == {16}


def test_verify_nan_and_signed_zero(tmp_path):
    torch.save({"x": torch.tensor([math.nan, 0.0, 1.0])}, tmp_path / "a.pt")
    torch.save({"x": torch.tensor([math.nan, -0.0, 1.0])}, tmp_path / "b.pt")
    torch.save({"x": torch.tensor([1.0, 0.0, 1.0])}, tmp_path / "c.pt")
    assert verify(tmp_path / "a.pt", tmp_path / "b.pt", atol=0).ok  # by value, -0.0 == 0.0 and NaN == NaN
    bits = verify(tmp_path / "a.pt", tmp_path / "b.pt").differences[0]  # bit for bit, the zeros differ
    assert (bits.mismatched, bits.first_index, bits.max_abs_diff) == (1, (1,), 0.0)
    nan = verify(tmp_path / "a.pt", tmp_path / "c.pt", atol=1.0).differences[0]
    assert (nan.mismatched, nan.first_index, nan.max_abs_diff) == (1, (0,), math.inf)
    assert math.isnan(nan.value_a) and nan.value_b == 1.0


def test_verify_cli_of_two_checkpoints_with_no_key_in_common_ends_with_a_hint(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"module.w": torch.ones(2)}, tmp_path / "b.pt")
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])
    assert result.exit_code == 1
    assert result.stdout.splitlines()[-1] == ("hint: no tensor key is on both sides: --model-only compares a training "
                                              "checkpoint's model with an export of it; --strip-prefix and --rename "
                                              "align other names")
    assert verify(tmp_path / "a.pt", tmp_path / "b.pt", strip_prefixes=("module.",)).hint is None


def test_verify_json_schema(tmp_path):
    torch.save({"x": torch.tensor([math.nan, 2.0]), "only_a": torch.ones(1), "step": 1}, tmp_path / "a.pt")
    torch.save({"x": torch.tensor([1.0, 2.0]), "step": 2}, tmp_path / "b.pt")
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--json",
                                      "--atol", "0.5"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)  # strict JSON: no NaN or Infinity literals
    assert set(report) == {"schema_version", "a", "b", "format_a", "format_b", "ok", "checksums", "tensors", "objects",
                           "bytes", "atol", "rtol", "notes", "differences", "hint"}
    assert (report["schema_version"], report["ok"], report["atol"], report["rtol"]) == (SCHEMA_VERSION, False, 0.5,
                                                                                        None)
    by_key = {d["key"]: d for d in report["differences"]}
    assert set(by_key["x"]) == {"key", "what", "max_abs_diff", "max_rel_diff", "mismatched", "total", "first_index",
                                "value_a", "value_b"}
    assert {k: by_key["x"][k] for k in ("max_abs_diff", "mismatched", "total", "first_index", "value_a", "value_b")} \
        == {"max_abs_diff": "inf", "mismatched": 1, "total": 2, "first_index": [0], "value_a": "nan", "value_b": 1.0}
    assert by_key["only_a"]["what"] == f"only in {tmp_path / 'a.pt'}" and by_key["only_a"]["mismatched"] is None
    assert by_key["step"]["what"] == "value 1 vs 2"


def test_verify_strip_prefix_and_rename_on_both_sides(tmp_path):
    w = torch.arange(6.0).reshape(2, 3)
    torch.save({"model.net.w": w, "model.step": 3}, tmp_path / "lightning.pt")
    torch.save({"net.w": w, "step": 3}, tmp_path / "plain.pt")
    assert not verify(tmp_path / "lightning.pt", tmp_path / "plain.pt").ok
    assert verify(tmp_path / "lightning.pt", tmp_path / "plain.pt", strip_prefixes=["model."]).ok
    renamed = verify(tmp_path / "lightning.pt", tmp_path / "plain.pt", renames=["^model\\.="])
    assert renamed.ok and "lightning.pt: --rename '^model\\.=' matched 2 keys" in renamed.notes
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "lightning.pt"), str(tmp_path / "plain.pt"),
                                      "--strip-prefix", "model."])
    assert result.exit_code == 0 and result.stdout.splitlines()[-1] == "identical"


def test_verify_model_only_with_renames(tmp_path):
    w = torch.ones(2, 2)
    torch.save({"model": {"encoder.w": w}, "optimizer": {"state": {}, "param_groups": []}}, tmp_path / "a.pt")
    torch.save({"enc.w": w}, tmp_path / "b.pt")
    assert verify(tmp_path / "a.pt", tmp_path / "b.pt", model_only=True, renames=["^encoder\\.=enc."]).ok


def test_verify_alone_refuses_the_options_of_a_comparison(tmp_path):
    from ckptkit.errors import UsageError

    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    with pytest.raises(UsageError, match=r"^--atol, --rename compare two checkpoints; with one, all of it is checked$"):
        verify(tmp_path / "a.pt", atol=0.1, renames=["a=b"])
    assert verify(tmp_path / "a.pt").ok  # read through: no ckptkit.json


def test_verify_reports_differing_zero_dim_float_tensors_with_exit_1(tmp_path):
    # AdamW's ``step`` is a 0-dim float tensor: two checkpoints at different steps differ there.
    torch.save({"s": torch.tensor(3.5)}, tmp_path / "a.pt")
    torch.save({"s": torch.tensor(4.5)}, tmp_path / "b.pt")
    found = verify(tmp_path / "a.pt", tmp_path / "b.pt").differences[0]
    assert (found.key, found.mismatched, found.first_index, found.value_a, found.value_b) == ("s", 1, (), 3.5, 4.5)
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "s: 1 of 1 elements differ bit for bit" in result.output

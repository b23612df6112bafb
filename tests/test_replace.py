"""``--overwrite`` of a model folder (:mod:`ckptkit.formats.replace`): the output takes over the weights, and
every other file the folder holds (configs, tokenizer, model card, folders of the user's) is kept as it was;
stale weights the output does not write again are removed; the folder is the old one or the new one, never a
mix, whenever the run dies. Checked with transformers' ``from_pretrained`` of the result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _checks import assert_same_tree, hash_tree, leftovers
from ckptkit.core.plan import Bytes, FilePlan, WritePlan
from ckptkit.errors import UsageError
from ckptkit.formats.replace import replacement
from ckptkit.io.storage.local import staging
from ckptkit.ops.export import export_hf

CLI = [sys.executable, "-m", "ckptkit"]
USERS = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"model_max_length": 64}',
         "README.md": "# llama-base\n", ".gitattributes": "*.safetensors filter=lfs\n",
         "original/params.json": '{"dim": 32}'}
"""The files a user keeps in a model folder beside what save_pretrained writes."""


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """An HF model folder as save_pretrained writes it in shards, with the user's files beside; and another model's
    weights as a torch.save file, with those weights."""
    root = tmp_path_factory.mktemp("replace")
    old, new = _tiny_llama(0), _tiny_llama(1)
    old.save_pretrained(root / "llama-base", max_shard_size="40KB")
    for rel, text in USERS.items():
        (root / "llama-base" / rel).parent.mkdir(exist_ok=True)
        (root / "llama-base" / rel).write_text(text)
    state = {k: v.clone() for k, v in new.state_dict().items()}
    torch.save(state, root / "new.pt")
    return root / "llama-base", root / "new.pt", state


@pytest.fixture
def folder(models, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(models[0], tmp_path / "llama-base"))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def _tree(folder: Path) -> dict[str, str]:
    """Each file under ``folder`` by its path there: its bytes' hash and mode."""
    return {k.split("/", 1)[1]: v for k, v in hash_tree(folder).items()}


def _shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


def test_export_hf_overwrite_of_a_model_folder_keeps_its_other_files_and_transformers_loads_the_new_weights(
        models, folder):
    from transformers import LlamaForCausalLM

    _, new, state = models
    shards = _shards(folder)
    assert len(shards) > 1 and (folder / "generation_config.json").is_file()
    before = _tree(folder)
    dry = _cli("export-hf", new, folder, "--overwrite", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would remove of the destination replaced: {', '.join(shards)}, model.safetensors.index.json" \
        in dry.stdout, dry.stdout
    assert ("would keep of the destination replaced: .gitattributes, README.md, config.json, "
            "generation_config.json, original/, tokenizer.json, tokenizer_config.json") in dry.stdout, dry.stdout
    assert _tree(folder) == before

    proc = _cli("export-hf", new, folder, "--overwrite", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["removed"] == [*shards, "model.safetensors.index.json"] and "original/" in report["kept"]
    after = _tree(folder)
    assert sorted(after) == sorted([*(k for k in before if k not in report["removed"]), "model.safetensors"])
    assert all(after[k] == before[k] for k in after if k != "model.safetensors")  # kept byte for byte
    model, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert_same_tree(model.state_dict(), state)
    assert leftovers(folder.parent) == []


def test_convert_full_over_a_model_folder_replaces_its_weights_and_transformers_loads_them(models, folder):
    from transformers import LlamaForCausalLM

    before = _tree(folder)
    proc = _cli("convert", models[1], folder, "--to", "full", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert sorted(_tree(folder)) == sorted([*(k for k in before if not k.startswith("model")), "pytorch_model.bin"])
    model, info = LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert_same_tree(model.state_dict(), models[2])


def test_replacement_of_a_model_folder_by_a_single_file_is_refused_naming_what_it_would_delete(folder):
    plan = WritePlan((FilePlan("model.pt", (Bytes(b"x"),)),), single_file=True)
    with pytest.raises(UsageError, match=rf"{folder} is a model folder holding \.gitattributes, README\.md, "
                                         r"config\.json, .* beside its weights; --overwrite .* by a single file"):
        replacement(folder, plan)


def test_overwrite_of_another_checkpoint_lists_what_it_removes(tmp_path, dcp_ckpt, full_ckpt):
    from ckptkit.ops.convert import reshard

    reshard(dcp_ckpt, tmp_path / "out", world_size=3)
    report = reshard(dcp_ckpt, tmp_path / "out", world_size=2, overwrite=True, dry_run=True)
    assert report.removed == ("__2_0.distcp",) and report.kept == ()
    assert "would remove of the destination replaced: __2_0.distcp" in str(report)


_KILLED = """
import os, signal
from ckptkit import cli
from ckptkit.core.plan import Bytes, FilePlan, WritePlan
from ckptkit.errors import UsageError
from ckptkit.formats.replace import replacement
from ckptkit.io.storage.local import staging
real = staging._swap_in
def swap(src, dst):
    if {after}:
        real(src, dst)
    os.kill(os.getpid(), signal.SIGKILL)
staging._swap_in = swap
cli.main(["export-hf", {src!r}, {dst!r}, "--overwrite", "-q"])
"""


@pytest.mark.parametrize("after", [False, True], ids=["before-the-swap", "after-the-swap"])
def test_overwrite_of_a_model_folder_killed_midway_leaves_the_old_folder_or_the_new_one_whole(models, folder,
                                                                                             after, capfd):
    if after and staging._renameat2 is None:
        pytest.skip("this system has no renameat2")
    _, new, state = models
    before = _tree(folder)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED.format(after=after, src=str(new),
                                                                                 dst=str(folder)))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert leftovers(folder.parent)  # the dead run's staging directory: the new output, or the old folder
    staging.recover(folder.parent)  # what the next run in that directory does first
    assert "cleaned up after runs that are gone" in capfd.readouterr().err and leftovers(folder.parent) == []
    after_kill = _tree(folder)
    if not after:
        assert after_kill == before
        return
    assert sorted(after_kill) == sorted([*(k for k in before if k in USERS or not k.startswith("model")),
                                         "model.safetensors"])
    assert all(after_kill[k] == before[k] for k in after_kill if k != "model.safetensors")
    from safetensors.torch import load_file

    assert_same_tree(load_file(folder / "model.safetensors"), state)


def test_commit_keep_carries_the_old_files_with_renameat2_and_without(tmp_path, monkeypatch):
    for mode in ("renameat2", "fallback"):
        if mode == "fallback":
            monkeypatch.setattr(staging, "_renameat2", None)
        dst = tmp_path / mode
        (dst / "sub").mkdir(parents=True)
        (dst / "old.bin").write_text("old")
        (dst / "keep.txt").write_text("mine")
        (dst / "sub" / "keep.txt").write_text("mine too")
        os.symlink("keep.txt", dst / "link")
        stage = staging.stage(dst, replace=True)
        (stage.path / "new.bin").write_text("new")
        stage.commit(replace=True, keep=("keep.txt", "sub/", "link", "gone.txt"))
        assert sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*")) == \
            ["keep.txt", "link", "new.bin", "sub", "sub/keep.txt"]
        assert (dst / "link").is_symlink() and (dst / "link").read_text() == "mine"
        assert leftovers(tmp_path) == []


def test_export_hf_overwrite_of_a_model_folder_in_memory_keeps_its_other_files(models, folder):
    from ckptkit.io.storage import memory

    for p in folder.rglob("*"):
        if p.is_file():
            memory.FILES[f"base/{p.relative_to(folder).as_posix()}"] = p.read_bytes()
    try:
        export_hf(models[1], "ckmem://base", overwrite=True)
        assert {k.removeprefix("base/") for k in memory.FILES} == \
            {*USERS, "config.json", "generation_config.json", "model.safetensors"}
    finally:
        memory.FILES.clear()

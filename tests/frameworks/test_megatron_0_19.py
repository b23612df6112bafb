"""megatron-core 0.19.2's ``torch_dist`` checkpoints, which hold no ``common.pt``: the common state (Megatron-LM's
``args``, ``iteration``) is a ``common_state`` object inside the DCP files. Saved by megatron-core 0.19.2's own
``dist_checkpointing.save`` of a tiny GPTModel on 2 gloo ranks (``_megatron.py``), read by ckptkit, and loaded back
by megatron-core 0.19.2's own ``dist_checkpointing.load`` and forward.

megatron-core 0.19 declares Python >= 3.12 but runs on this one; bin/_env installs it beside 0.16.1 in the
environment's ``megatron-core-0.19`` directory, which these tests put on the PYTHONPATH of a subprocess.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, load_hf

MCORE_0_19 = Path(sys.prefix) / "megatron-core-0.19"
HERE = Path(__file__).parent

pytestmark = pytest.mark.skipif(not (MCORE_0_19 / "megatron").is_dir(),
                                reason=f"megatron-core 0.19.2 is not in {MCORE_0_19} (bin/_env installs it)")


def _in_0_19(call: str, out: Path) -> Any:
    """``call``, an expression over ``_megatron`` (as ``m``) and ``Path``, run with megatron-core 0.19.2 in a
    subprocess; its value, passed back through ``out``."""
    code = ("import megatron.core, torch, _megatron as m\nfrom pathlib import Path\n"
            "assert megatron.core.__version__.startswith('0.19.2'), megatron.core.__file__\n"
            f"torch.save({call}, {str(out)!r})")
    path = os.pathsep.join(map(str, (MCORE_0_19, HERE, HERE.parent.parent)))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)  # the test's own file


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("megatron-0.19")


@pytest.fixture(scope="module")
def saved(tmp) -> tuple[Path, torch.Tensor]:
    """A Llama trained with ``rotary_interleaved=True`` (so its args say), saved with Megatron-LM's common state
    by megatron-core 0.19.2 at TP=2; and megatron-core 0.19.2's own load and forward of it."""
    return _in_0_19(f"m.saved_with_logits(Path({str(tmp)!r}), 'llama_interleaved', 2)", tmp / "saved.pt")


def _common_state(ckpt: Path) -> dict:
    """The common state as megatron-core 0.19's ``load_common_state_dict`` reads it: torch's DCP load of the
    ``common_state`` object alone (a list of one dict)."""
    import torch.distributed.checkpoint as dcp

    state = {"common_state/shard_0_1": io.BytesIO()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    [common] = state["common_state/shard_0_1"]
    return common


def test_megatron_0_19_inspect_reads_the_common_state_inside_the_dcp_files(saved):
    ckpt = saved[0]
    assert not (ckpt / "common.pt").exists()
    manifest = ckptkit.inspect(ckpt)
    common = {o.key: o.value for o in manifest.objects if o.sidecar == "common_state"}
    oracle = _common_state(ckpt)
    assert set(common) == set(oracle) == {"args", "checkpoint_version", "iteration"}
    assert set(vars(common["args"])) == set(vars(oracle["args"]))
    for name in ("num_layers", "num_query_groups", "kv_channels", "rotary_interleaved", "rotary_base"):
        assert getattr(common["args"], name) == getattr(oracle["args"], name), name
    assert (common["checkpoint_version"], common["iteration"]) == (oracle["checkpoint_version"], oracle["iteration"])
    assert not any(o.key.startswith("common_state") for o in manifest.objects)  # read as entries, not a blob
    assert dict(manifest.details)["common_state"].startswith("megatron-core's common state: 3 entries (args, ")


@pytest.fixture(scope="module")
def exported(saved, tmp) -> tuple[Path, ckptkit.Report]:
    """The checkpoint exported with no --hf-assets and --preset auto: the args say it all."""
    return tmp / "hf", ckptkit.export_hf(saved[0], tmp / "hf")


def test_megatron_0_19_export_hf_takes_args_from_the_common_state_and_matches_megatrons_forward(saved, exported):
    import transformers

    megatron_logits = saved[1]
    hf, report = exported
    assert any("made from" in n and "common_state/shard_0_1's args" in n for n in report.notes), report.notes
    assert any("rotary_interleaved True" in n for n in report.notes), report.notes
    model, info = transformers.AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True,
                                                                   dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    from _megatron import tokens

    with torch.no_grad():
        difference = (model.eval()(tokens()).logits - megatron_logits).abs().max().item()
    print(f"megatron-core 0.19.2 llama: largest logit difference, transformers vs megatron-core: {difference:.3g}")
    assert difference < 1e-5


def test_megatron_0_19_convert_full_holds_the_common_state_as_megatron_load_merges_it(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = saved[0]
    ckptkit.convert(ckpt, tmp_path / "full.pt", to="full")
    dcp_to_torch_save(str(ckpt), str(tmp_path / "oracle.pt"))
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=False)  # the test's own files
    del oracle["common_state/shard_0_1"]
    assert_same_tree(torch.load(tmp_path / "full.pt", weights_only=False), {**oracle, **_common_state(ckpt)})


def test_megatron_0_19_reshard_keeps_the_common_state_and_megatron_0_19_loads_it(saved, tmp, tmp_path):
    ckpt, megatron_logits = saved
    ckptkit.reshard(ckpt, tmp_path / "r3", world_size=3)
    assert sorted(p.name for p in (tmp_path / "r3").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "metadata.json"]
    assert (tmp_path / "r3" / "metadata.json").read_bytes() == (ckpt / "metadata.json").read_bytes()
    assert ckptkit.verify(ckpt, tmp_path / "r3").ok  # every tensor and common entry, ckptkit's reading of both
    result = _in_0_19(f"m.loaded(Path({str(tmp_path)!r}), 'llama_interleaved', 2, Path({str(tmp_path / 'r3')!r}), "
                      "forward=True)", tmp_path / "loaded.pt")
    assert torch.equal(result["logits"], megatron_logits)
    assert result["common"]["args"] == _common_state(ckpt)["args"] and result["common"]["iteration"] == 0
    ckptkit.export_hf(tmp_path / "r3", tmp_path / "hf")  # ckptkit reads its own output's args as the source's
    ckptkit.export_hf(ckpt, tmp_path / "hf-source")
    assert_same_tree(load_hf(tmp_path / "hf"), load_hf(tmp_path / "hf-source"))
    assert (tmp_path / "hf" / "config.json").read_bytes() == (tmp_path / "hf-source" / "config.json").read_bytes()


def test_megatron_0_19_loads_convert_to_megatron_output_with_its_common_pt(saved, exported, tmp_path):
    ckptkit.convert(exported[0], tmp_path / "mcore", to="megatron", world_size=2,
                    megatron_args={"rotary_interleaved": True})
    assert (tmp_path / "mcore" / "common.pt").is_file()  # the layout both 0.16 and 0.19 load
    result = _in_0_19(f"m.loaded(Path({str(tmp_path)!r}), 'llama_interleaved', 2, Path({str(tmp_path / 'mcore')!r}), "
                      "forward=True)", tmp_path / "loaded.pt")
    assert torch.equal(result["logits"], saved[1])
    assert result["common"] == {"checkpoint_version": 3.0, "iteration": 0}


def test_megatron_0_19_metadata_json_without_any_common_state_exits_2(tmp_path):
    import torch.distributed.checkpoint as dcp
    from click.testing import CliRunner

    from ckptkit.cli import cli

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)  # torch's DCP alone
    (tmp_path / "ckpt" / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "ckpt")])
    assert result.exit_code == 2, result.output
    assert "there is neither common.pt nor the 'common_state/shard_0_1' entry megatron-core 0.19" in result.output

"""ckptkit.save / ckptkit.load: real gloo ranks, every form, other wrappers and world sizes on load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptkit
from _checks import assert_same_tree, assert_tensor_identical, tree_difference
from ckptkit.errors import UsageError
from ckptkit.formats import run_directory
from ckptkit.harness.launch import run_ranks
from fixtures_models import TinyNet, train_step

FORMS = ("sharded", "full", "hf")


def _plain_model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()


def _build(kind: str):
    model = _plain_model()
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    # No cpu_offload: the parameters are on CPU already, and FSDP1 crashes offloading CPU parameters.
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.clone() for k, v in msd.items()}, "optim": osd}


def _train(model, opt, rank: int, steps: int = 2) -> None:
    for step in range(steps):
        train_step(model, opt, 1000 * step + rank)


def _save_all_forms(rank: int, world: int, root: str, kind: str) -> list[str]:
    """Every form saved from every rank; what torch warned meanwhile that it "assumes a single process"."""
    import warnings

    model, opt = _build(kind)
    _train(model, opt, rank)
    ref = _full_state(model, opt)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for form in (*FORMS, "local") if kind == "fsdp1" else FORMS:
            ckptkit.save(f"{root}/{form}", model, optimizer=opt, form=form, step=2, extra_state={"seed": 7})
        ckptkit.save(f"{root}/async", model, optimizer=opt, step=2, async_save=True).wait()
    if rank == 0:
        torch.save(ref, f"{root}/ref.pt")
    return [str(w.message) for w in warned if "single process" in str(w.message)]


def _load_all_forms(rank: int, world: int, root: str, kind: str) -> list:
    ref = torch.load(f"{root}/ref.pt", weights_only=False)
    out = []
    import pathlib

    for form in sorted(p.name for p in pathlib.Path(root).iterdir() if p.is_dir()):
        model, opt = _build(kind)
        result = ckptkit.load(f"{root}/{form}", model, optimizer=opt)
        got = _full_state(model, opt)
        if rank == 0:
            problem = tree_difference(got["model"], ref["model"], "model")
            # hf: the weights in safetensors, the optimizer in the training state beside them
            problem = problem or tree_difference(got["optim"]["state"], ref["optim"]["state"], "optim.state")
            out.append((form, problem, result.step, result.extra_state))
    return out


@pytest.mark.parametrize("saved_by, save_ws, loads", [
    # FSDP2 at 2 ranks, loaded by FSDP2 at 3, DDP at 2 and a plain model at 1
    ("fsdp2", 2, [("fsdp2", 3), ("ddp", 2), ("plain", 1)]),
    # FSDP1 FULL_SHARD at 2 ranks (every form, LOCAL too), loaded by FSDP1 at 3 and FSDP2 at 1
    ("fsdp1", 2, [("fsdp1", 3), ("fsdp2", 1)]),
])
def test_save_load_any_form_any_wrapper_any_world_size(tmp_path, saved_by, save_ws, loads):
    # A save from every rank of a group is no single process's: torch is not heard to say it assumes one.
    assert run_ranks(_save_all_forms, save_ws, str(tmp_path), saved_by) == [[]] * save_ws
    for kind, ws in loads:
        results = run_ranks(_load_all_forms, ws, str(tmp_path), kind)[0]
        for form, problem, step, extra in results:
            assert problem is None, f"{saved_by}@{save_ws} -> {kind}@{ws}: {form}: {problem}"
            if form == "async":
                assert step == 2 and extra is None
            else:
                assert step == 2 and extra == {"seed": 7}


def test_save_hf_keeps_the_training_state_beside_the_weights_and_load_resumes_it_bit_for_bit(tmp_path):
    from safetensors.torch import load_file

    model = _plain_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in (3, 4):
        _train(model, opt, step, steps=1)
        sched.step()
        ckptkit.save(tmp_path, model, optimizer=opt, scheduler=sched, extra_state={"seed": step}, form="hf",
                     step=step, keep_last=1)
    step_dir = tmp_path / "step-00000004"
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [4]
    assert (tmp_path / "latest").read_text().strip() == step_dir.name
    weights = load_file(step_dir / "model.safetensors")  # the weights, as safetensors reads them
    assert_same_tree(weights, {k: v for k, v in model.state_dict().items() if k in weights})
    assert ckptkit.verify(step_dir).ok  # the checksums ckptkit.json records, training state beside them
    fresh = _plain_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    result = ckptkit.load(tmp_path, fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert (result.path, result.step, result.extra_state, result.optimizer_loaded) == (step_dir, 4, {"seed": 4}, True)
    assert_same_tree(fresh_opt.state_dict()["state"], opt.state_dict()["state"])
    # torch's set_state_dict gives the betas back as a list, in every form: compared as lists
    assert json.dumps(fresh_opt.state_dict()["param_groups"]) == json.dumps(opt.state_dict()["param_groups"])
    assert fresh_sched.state_dict() == sched.state_dict()
    assert_same_tree(fresh.state_dict(), model.state_dict())


def test_load_returns_the_step_of_an_hf_save_without_training_state(tmp_path):
    ckptkit.save(tmp_path, _plain_model(), form="hf", step=5)
    assert ckptkit.load(tmp_path, _plain_model()).step == 5


def test_save_rotation_keeps_the_newest_complete_steps(tmp_path):
    model = _plain_model()
    for step in (1, 2, 3, 4):
        with torch.no_grad():
            model.norm.weight.fill_(step)
        ckptkit.save(tmp_path, model, form="full", step=step, keep_last=2)
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [3, 4]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    fresh = _plain_model()
    assert ckptkit.load(tmp_path, fresh).step == 4
    assert_tensor_identical(fresh.norm.weight.detach(), torch.full((7,), 4.0))


def test_save_rotation_by_size_never_removes_the_only_complete_step(tmp_path):
    model = _plain_model()
    for step in (1, 2):
        ckptkit.save(tmp_path, model, form="full", step=step, max_total_gb=1e-9)
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [2]


_KILLED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
import ckptkit
from fixtures_models import TinyNet
torch.manual_seed(0)
model = TinyNet()
real_save = torch.save
def dying_save(obj, f, *a, **k):
    with open(f, "wb") as out:
        out.write(b"PK\\x03\\x04 half a file")
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
ckptkit.save({root!r}, model, form="full", step=2)
"""


def test_save_killed_midway_leaves_previous_latest_loadable(tmp_path, capfd):
    model = _plain_model()
    ckptkit.save(tmp_path, model, form="full", step=1)
    code = textwrap.dedent(_KILLED_SAVE).format(tests=os.path.dirname(__file__), root=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    left = list(tmp_path.glob(".step-00000002.ckptkit-partial-*"))
    assert len(left) == 1 and left[0].is_dir()  # the dead save's staging directory, named by host and PID
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [1]
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    fresh = _plain_model()
    assert ckptkit.load(tmp_path, fresh, verify_checksums=True).step == 1
    assert f"removed {left[0].name}" in capfd.readouterr().err  # load recovers first, and says so
    ckptkit.save(tmp_path, model, form="full", step=2)
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [1, 2]
    assert not list(tmp_path.glob(".*ckptkit-*"))


@pytest.mark.parametrize("form", ["full", "hf"])  # sharded async runs in the multi-rank test
def test_save_async_writes_what_sync_writes(tmp_path, form):
    model = _plain_model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 0, steps=1)
    ckptkit.save(tmp_path / "sync", model, optimizer=opt, form=form)
    handle = ckptkit.save(tmp_path / "async", model, optimizer=opt, form=form, async_save=True)
    with torch.no_grad():  # training goes on while the async save writes: the snapshot must not change
        for p in model.parameters():
            p.add_(1.0)
    handle.wait()
    report = ckptkit.verify(tmp_path / "sync", tmp_path / "async")
    assert report.ok, report.differences
    assert report.tensors > 0


@pytest.mark.parametrize("form", ["full", "hf"])
def test_save_async_returns_while_the_write_is_still_under_way(tmp_path, monkeypatch, form):
    import threading

    from ckptkit.training import save as save_module

    returned, blocked = threading.Event(), []
    write = save_module._write_snapshot

    def held_write(*args):  # the write cannot finish before save() has returned
        blocked.append(not returned.wait(10))
        write(*args)

    monkeypatch.setattr(save_module, "_write_snapshot", held_write)
    model = _plain_model()
    handle = ckptkit.save(tmp_path / "ck", model, form=form, async_save=True)
    returned.set()
    handle.wait()
    assert blocked == [False], "save() waited for the write it was asked to leave in the background"
    if form == "full":
        saved = torch.load(tmp_path / "ck" / save_module.FULL_FILE, weights_only=True)["model"]
    else:
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "ck" / "model.safetensors")
    assert saved.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert_tensor_identical(saved[key], value)


def test_load_strict_lists_missing_keys(tmp_path):
    model = _plain_model()
    ckptkit.save(tmp_path / "ck", model)
    bigger = _plain_model()
    bigger.extra_head = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match=r"checkpoint lacks 2 keys the model needs: extra_head\.weight, "
                                         r"extra_head\.bias"):
        ckptkit.load(tmp_path / "ck", bigger)
    ckptkit.load(tmp_path / "ck", bigger, strict=False)
    assert_same_tree(bigger.state_dict(), {**model.state_dict(), **bigger.extra_head.state_dict(prefix="extra_head.")})


def test_save_writes_manifest_with_checksums(tmp_path):
    import json
    import zlib

    model = _plain_model()
    ckptkit.save(tmp_path / "ck", model, form="full", step=3)
    info = json.loads((tmp_path / "ck" / "step-00000003" / "ckptkit.json").read_text())
    assert (info["format"], info["world_size"], info["step"], info["save"]) == ("full", 1, 3, 1)
    w = model.norm.weight.detach()
    assert info["tensors"]["model.norm.weight"] == {
        "dtype": "float32", "shape": list(w.shape),
        "chunks": [{"offsets": [0], "sizes": list(w.shape), "crc32": f"{zlib.crc32(w.numpy().tobytes()):08x}"}]}


def test_example_trains_saves_and_resumes_on_another_world_size(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "train_fsdp2.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for ranks, steps in ((2, 4), (3, 6)):
        proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(ranks), script,
                               "--ckpt", str(tmp_path), "--steps", str(steps)],
                              capture_output=True, text=True, env=env, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 4 on 3 ranks" in proc.stdout
    assert (tmp_path / "latest").read_text().strip() == "step-00000006"


def _export_from_all_ranks(rank: int, world: int, src: str, dst: str) -> list[str]:
    report = ckptkit.export_hf(src, dst, max_shard_size=400, distributed=True)
    return [n for n in report.notes]


def test_export_hf_from_all_ranks_splits_files_and_matches_single_rank(tmp_path):
    model = _plain_model()
    torch.save({"model": model.state_dict(), "step": 1}, tmp_path / "src.pt")
    run_ranks(_export_from_all_ranks, 3, str(tmp_path / "src.pt"), str(tmp_path / "hf3"))
    ckptkit.export_hf(tmp_path / "src.pt", tmp_path / "hf1", max_shard_size=400)
    files = sorted(p.name for p in (tmp_path / "hf3").iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 3  # several shards, written by 3 ranks
    assert files == sorted(p.name for p in (tmp_path / "hf1").iterdir())
    assert ckptkit.verify(tmp_path / "hf1", tmp_path / "hf3").ok
    assert not list(tmp_path.glob(".hf3*"))  # no staging left behind


@pytest.mark.parametrize("async_save", [False, True])
def test_save_load_in_one_process_warn_of_nothing(tmp_path, async_save):
    import warnings

    model, fresh = _plain_model(), _plain_model()
    opt, fresh_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(fresh.parameters())
    train_step(model, opt, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckptkit.save(tmp_path / "run", model, optimizer=opt, step=1, form="sharded", async_save=async_save).wait()
        result = ckptkit.load(tmp_path / "run", fresh, optimizer=fresh_opt)
    assert [str(w.message) for w in caught if "torch.distributed" in str(w.message)] == []
    assert result.optimizer_loaded and torch.equal(fresh.head.weight, model.head.weight)

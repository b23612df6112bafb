"""LOCAL: FSDP1 ``LOCAL_STATE_DICT`` checkpoints, bit for bit.

The sources are saved by a real 2-rank FSDP1 run (gloo on CPU) of ``fixtures_models.tiny``, once with
``use_orig_params=False`` and once with True; what torch gathers under FULL_STATE_DICT is taken first, as
the ground truth. Results are read back by torch's own loaders, and LOCAL output is loaded into real FSDP1
models at another world size.
"""

from __future__ import annotations

import json
import pickletools
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from _checks import assert_same_tree, load_dcp, load_full, load_hf
from _fsdp1 import AUTO_WRAP, MODEL, load_and_gather, train_and_save
from ckptkit.cli import cli
from ckptkit.core.manifest import Format
from ckptkit.errors import FormatError, IncompleteCheckpointError, UsageError
from ckptkit.formats import LocalOptions
from ckptkit.formats.local.layout import LAYOUT_FILE
from ckptkit.harness.launch import run_ranks
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.inspect import inspect
from ckptkit.ops.verify import verify
from fixtures_models import tiny, train_step

LOCAL = {"model": MODEL, "auto_wrap": AUTO_WRAP}


def local(**kw) -> dict:
    """convert()'s ``local=`` argument: the test model's wrapping plus ``kw``."""
    return {"local": LocalOptions(**{**LOCAL, **kw})}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[bool, Path]:
    """use_orig_params -> a directory of what 2 FSDP1 ranks saved (see ``_fsdp1.train_and_save``)."""
    out = {}
    for use_orig_params in (False, True):
        d = tmp_path_factory.mktemp(f"fsdp1-orig{int(use_orig_params)}")
        run_ranks(train_and_save, 2, str(d), use_orig_params)
        # FSDP1 tags the tensors it gathers with a Python attribute, which ckptkit's FULL reader refuses;
        # plain copies are the FULL source for FULL -> LOCAL.
        torch.save({k: v.clone() for k, v in load_full(d / "full.pt").items()}, d / "full_plain.pt")
        out[use_orig_params] = d
    return out


@pytest.fixture(params=[False, True], ids=["flat", "orig-params"])
def uop(request) -> bool:
    return request.param


def joined_optim(paths: list[Path]) -> dict:
    """Per-parameter state joined from the ranks' ``optimizer.state_dict()`` of a use_orig_params model: each
    rank holds its part of each parameter's flattened state, in rank order (the step on every rank)."""
    ranks = [load_full(p) for p in paths]
    state = {}
    for i, (name, param) in enumerate(tiny().named_parameters()):
        parts = [r["state"][i] for r in ranks if i in r["state"]]
        state[name] = {k: torch.cat([p[k] for p in parts]).reshape(param.shape) if parts[0][k].dim() else parts[0][k]
                       for k in parts[0]}
    return state


def expected_optim(d: Path, use_orig_params: bool, world: int = 2) -> dict:
    """The full optimizer state. FSDP's own gather serves without use_orig_params; with it, torch 2.13 on CPU
    gathers exp_avg equal to exp_avg_sq, so the state is joined from the ranks' own parts instead."""
    full = load_full(d / "full_optim.pt")
    if not use_orig_params:
        return full
    return {"state": joined_optim([d / f"optim{r}.pt" for r in range(world)]), "param_groups": full["param_groups"]}


# ------------------------------------------------------------------------------------------------- reading


def test_local_reads_fsdp1_files_as_the_full_state_dict(saved, uop, tmp_path):
    src = saved[uop] / "model"
    convert(src, tmp_path / "out.pt", to="full", **local())
    assert_same_tree(load_full(tmp_path / "out.pt"), load_full(saved[uop] / "full.pt"))
    m = inspect(src, **local())
    assert (m.format, m.world_size, dict(m.details)["use_orig_params"]) == (Format.LOCAL, 2, str(uop).lower())
    # layers.0.up.weight (11x7) straddles the ranks mid-row: partial rows and whole rows from both files.
    up = m["layers.0.up.weight"]
    assert {Path(c.span.file).name for c in up.chunks} == {"rank0.pt", "rank1.pt"}
    assert any(c.sizes[0] == 1 and c.sizes[1] < 7 for c in up.chunks)
    # The tied head is the embedding's bytes under a second name, as in torch's full state dict.
    assert m["head.weight"].chunks == m["embed.weight"].chunks


def test_local_converts_to_hf_and_to_sharded_at_3_ranks(saved, uop, tmp_path):
    full = load_full(saved[uop] / "full.pt")
    convert(saved[uop] / "model", tmp_path / "hf", to="hf", **local())
    assert_same_tree(load_hf(tmp_path / "hf"), full)
    convert(saved[uop] / "model", tmp_path / "dcp3", to="sharded", world_size=3, **local())
    assert_same_tree(load_dcp(tmp_path / "dcp3", tmp_path / "scratch" / "dcp3.pt"), full)


def test_local_training_checkpoint_unflattens_the_optimizer(saved, uop, tmp_path):
    convert(saved[uop] / "train", tmp_path / "out.pt", to="full", **local())
    got = load_full(tmp_path / "out.pt")
    assert_same_tree(got["model"], load_full(saved[uop] / "full.pt"), "model")
    assert_same_tree(got["optim"], expected_optim(saved[uop], uop), "optim")
    assert got["step"] == 2


# ------------------------------------------------------------------------------------------------- writing


def test_local_written_by_ckptkit_loads_into_fsdp1_at_3_ranks(saved, tmp_path):
    jobs = []
    for use_orig_params in (False, True):
        src = saved[use_orig_params]
        train3, full3 = tmp_path / f"train3-{int(use_orig_params)}", tmp_path / f"full3-{int(use_orig_params)}"
        reshard(src / "train", train3, world_size=3, **local())
        convert(src / "full_plain.pt", full3, to="local", world_size=3, **local(use_orig_params=use_orig_params))
        jobs += [(str(train3), "model_rank_{rank}.pt", use_orig_params, True, str(tmp_path / f"{train3.name}.pt")),
                 (str(full3), "rank{rank}.pt", use_orig_params, False, str(tmp_path / f"{full3.name}.pt"))]
    run_ranks(load_and_gather, 3, jobs)
    for directory, _, use_orig_params, with_optim, out in jobs:
        got = load_full(Path(out))
        assert_same_tree(got["model"], load_full(saved[use_orig_params] / "full.pt"), directory)
        if with_optim and not use_orig_params:
            assert_same_tree(got["optim"], expected_optim(saved[False], False), directory)
        elif with_optim:
            state = joined_optim([Path(f"{out}.rank{r}") for r in range(3)])
            assert_same_tree(state, expected_optim(saved[True], True)["state"], directory)


def test_local_reshard_n_to_m_is_bit_exact(saved, uop, tmp_path):
    src = saved[uop] / "train"
    reshard(src, tmp_path / "l3", world_size=3, **local())
    reshard(tmp_path / "l3", tmp_path / "l1", world_size=1)  # the sidecar carries the layout from here on
    assert (sorted(p.name for p in (tmp_path / "l3").iterdir())
            == [LAYOUT_FILE] + [f"model_rank_{r}.pt" for r in range(3)])
    assert verify(src, tmp_path / "l3", **local()).ok
    assert verify(tmp_path / "l3", tmp_path / "l1").ok
    convert(tmp_path / "l1", tmp_path / "out.pt", to="full")
    got = load_full(tmp_path / "out.pt")
    assert_same_tree(got["model"], load_full(saved[uop] / "full.pt"))
    assert_same_tree(got["optim"], expected_optim(saved[uop], uop))


def test_full_to_local_and_back_is_bit_exact(saved, uop, tmp_path):
    convert(saved[uop] / "full_plain.pt", tmp_path / "l4", to="local", world_size=4,
            **local(rank_files="shard_{rank}.pt", use_orig_params=uop))
    assert (tmp_path / "l4" / "shard_3.pt").is_file()
    convert(tmp_path / "l4", tmp_path / "out.pt", to="full")
    assert_same_tree(load_full(tmp_path / "out.pt"), load_full(saved[uop] / "full.pt"))


def test_full_to_local_names_optimizer_state_that_only_some_parameters_hold_as_a_tensor(saved, tmp_path):
    # norm.weight shares the root unit's flat parameter with embed.weight, whose exp_avg is a tensor.
    optim = load_full(saved[False] / "full_optim.pt")
    state = {name: {key: value.clone() for key, value in slot.items()} for name, slot in optim["state"].items()}
    state["norm.weight"]["exp_avg"] = None
    model = load_full(saved[False] / "full_plain.pt")
    torch.save({"model": model, "optim": {"state": state, "param_groups": optim["param_groups"]}}, tmp_path / "src.pt")
    with pytest.raises(FormatError, match=r"src\.pt: optimizer state 'optim\.state\.norm\.weight\.exp_avg' is not a "
                                          r"tensor, though other parameters of its flat parameter have a tensor there"):
        convert(tmp_path / "src.pt", tmp_path / "l2", to="local", world_size=2, **local())


def test_local_rank_files_pickle_the_sharded_tensor_as_torch_does(saved, uop, tmp_path):
    """Same world size, same model: the same globals in the same order, plain tensors aside (ckptkit writes
    untyped storages and ``_rebuild_tensor_v3`` with a dtype global, which torch reads alike)."""
    reshard(saved[uop] / "model", tmp_path / "l2", world_size=2, **local())
    plain = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
             "torch.storage.UntypedStorage", "torch.FloatStorage", "torch.LongStorage", "torch.float32", "torch.int64"}

    def globals_of(path: Path) -> list[str]:
        with zipfile.ZipFile(path) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        names = [arg.replace(" ", ".") for op, arg, _ in pickletools.genops(pkl) if op.name == "GLOBAL"]
        # Python builds differ in how they pickle an enum member: ENUM(value), or getattr(ENUM, "NAME") where
        # enums pickle by name (Debian's 3.11, 3.12+), which moves the first (memoised) getattr. ckptkit reads
        # both and writes the first; getattr is left out of the comparison.
        return [n for n in names if n not in plain and n != "__builtin__.getattr"]

    for r in range(2):
        assert globals_of(tmp_path / "l2" / f"rank{r}.pt") == globals_of(saved[uop] / "model" / f"rank{r}.pt")


# ------------------------------------------------------------------------------------------------- errors


def test_local_without_layout_says_what_to_provide(saved, tmp_path):
    src = saved[False] / "model"
    with pytest.raises(UsageError, match=rf"{src}: .*provide --model package\.module:factory \(with --auto-wrap\) "
                                         rf"or a flat_layout\.json"):
        convert(src, tmp_path / "out.pt", to="full")


def test_local_single_rank_file_points_to_its_directory(saved, tmp_path):
    rank0 = saved[False] / "model" / "rank0.pt"
    with pytest.raises(UsageError, match=rf"{rank0} is one rank's file of an FSDP1 LOCAL_STATE_DICT checkpoint; "
                                         rf"pass its directory {rank0.parent}"):
        convert(rank0, tmp_path / "out.pt", to="full", **local())


def test_local_with_the_wrong_wrap_policy_lists_the_differences(saved, tmp_path):
    with pytest.raises(FormatError, match=r"the flat layout does not match the checkpoint: .*'layers\.0\._flat_param' "
                                          r"is in the rank files but not in the layout"):
        convert(saved[False] / "model", tmp_path / "out.pt", to="full",
                local=LocalOptions(model=MODEL, auto_wrap="none"))


def test_empty_containers_survive_local_and_sharded_and_back(tmp_path):
    state = {"model": tiny().state_dict(), "scaler": {}, "extra": {"seen": {}, "hist": []}}
    torch.save(state, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "l2", to="local", world_size=2, **local())
    convert(tmp_path / "l2", tmp_path / "dcp", to="sharded", world_size=2)
    convert(tmp_path / "dcp", tmp_path / "l3", to="local", world_size=3, **local())
    convert(tmp_path / "l3", tmp_path / "back.pt", to="full")
    assert_same_tree(load_full(tmp_path / "back.pt"), state)


def test_local_refuses_a_layout_that_gives_a_parameter_the_name_of_a_buffer(saved, uop, tmp_path):
    convert(saved[uop] / "full_plain.pt", tmp_path / "l2", to="local", world_size=2,
            **local(use_orig_params=uop))
    sidecar = tmp_path / "l2" / LAYOUT_FILE
    layout = json.loads(sidecar.read_text())
    param = next(p for u in layout["units"] for p in u["params"] if p["fqn"] == "norm.bias")
    param["fqn"] = "steps"  # the model's int64 buffer
    layout["param_order"] = ["steps" if n == "norm.bias" else n for n in layout.get("param_order", [])]
    sidecar.write_text(json.dumps(layout))
    with pytest.raises(FormatError, match=r"rank0\.pt: the flat layout names parameter 'steps' of unit '_flat_param' "
                                          r"after buffer 'steps' \(int64 \[3\]\) in the rank files"):
        convert(tmp_path / "l2", tmp_path / "out.pt", to="full")
    assert not (tmp_path / "out.pt").exists()


def test_local_rank_files_by_name_and_by_pattern(saved, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    for r in range(2):
        shutil.copy(saved[False] / "model" / f"rank{r}.pt", src / f"shard_{r}.pt")
    (src / "notes_1.txt").write_text("not a rank file")
    convert(src, tmp_path / "a.pt", to="full", **local())  # found by name
    for r in range(2):  # a second group of rank files makes the names ambiguous
        shutil.copy(src / f"shard_{r}.pt", src / f"backup_{r}.pt")
    with pytest.raises(FormatError, match=r"cannot tell which files are the LOCAL rank files "
                                          r"\(found backup_\{rank\}\.pt, shard_\{rank\}\.pt\); "
                                          r"name them with --rank-files"):
        convert(src, tmp_path / "b.pt", to="full", **local())
    convert(src, tmp_path / "c.pt", to="full", **local(rank_files="shard_{rank}.pt"))
    assert_same_tree(load_full(tmp_path / "c.pt"), load_full(saved[False] / "full.pt"))
    (src / "shard_1.pt").rename(src / "shard_2.pt")
    with pytest.raises(IncompleteCheckpointError, match=r"shard_\{rank\}\.pt' of ranks \[1\] are missing"):
        convert(src, tmp_path / "d.pt", to="full", **local(rank_files="shard_{rank}.pt"))
    (src / "shard_0.pt").rename(src / "shard_1.pt")  # rank 0's file under rank 1's name
    (src / "shard_2.pt").rename(src / "shard_0.pt")  # and the other way round
    with pytest.raises(FormatError,
                       match=r"shard_0\.pt: '_flat_param' was saved by rank 1 of 2, but the file is rank 0"):
        convert(src, tmp_path / "e.pt", to="full", **local(rank_files="shard_{rank}.pt"))


def test_local_output_needs_a_layout(saved, tmp_path):
    with pytest.raises(UsageError, match=r"writing LOCAL needs the model's flat-parameter layout; pass --model"):
        convert(saved[False] / "full_plain.pt", tmp_path / "l2", to="local", world_size=2)


def test_cli_convert_to_local_then_inspect(saved, tmp_path):
    run = CliRunner().invoke
    r = run(cli, ["convert", str(saved[True] / "model"), str(tmp_path / "l3"), "--to", "local", "--world-size", "3",
                  "--model", MODEL, "--auto-wrap", AUTO_WRAP, "-q"])
    assert r.exit_code == 0, r.output
    r = run(cli, ["inspect", str(tmp_path / "l3")])  # the sidecar makes --model unnecessary from here on
    assert r.exit_code == 0 and "local, world size 3" in r.output and "use_orig_params: true" in r.output, r.output
    r = run(cli, ["inspect", str(saved[True] / "model")])
    assert r.exit_code == 2 and "provide --model package.module:factory" in r.output


def _save_no_shard(rank: int, world: int, d: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, StateDictType

    torch.manual_seed(0)
    model = FSDP(tiny(), sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters())
    train_step(model, opt, 0)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):  # a collective: every rank takes part
        reference = FSDP.optim_state_dict(model, opt)  # torch's own full view, keyed by parameter name
    if rank == 0:
        torch.save(reference, f"{d}/../reference_optim.pt")
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{d}/rank{rank}.pt")


def test_convert_no_shard_local_unflattens_weights_and_optimizer(tmp_path):
    (tmp_path / "ns").mkdir()
    run_ranks(_save_no_shard, 2, str(tmp_path / "ns"))
    report = convert(tmp_path / "ns", tmp_path / "full.pt", to="full", local=LocalOptions(model=MODEL))
    assert report.source_format is Format.LOCAL
    saved = torch.load(tmp_path / "ns" / "rank1.pt", weights_only=False)["model"]  # FSDP's tensors, by torch
    got = load_full(tmp_path / "full.pt")
    assert_same_tree(got["model"], saved, "model")
    reference = torch.load(tmp_path / "reference_optim.pt", weights_only=False)
    assert_same_tree(got["optim"]["state"], reference["state"], "optim.state")
    # Without a layout the indices cannot be named: the state is carried as saved, and inspect says so.
    assert "per parameter index" in dict(inspect(tmp_path / "ns").details)["optimizer state"]

"""ckptkit against torch's own distributed checkpointing, in real gloo process groups on CPU.

One group of ranks per world size (1, 2, 3), started by ``run_ranks``, does every multi-process check of that
size, and each rank returns what it found; the tests below assert on it. In each group:

1. every rank loads ckptkit's DCP for 1, 2 and 3 ranks with ``torch.distributed.checkpoint.load`` into a
   ``Shard(0)`` DTensor state dict;
2. (2 and 3 ranks) DTensors placed ``Shard(1)``, ``Replicate()`` and ``Shard(0)`` are saved with DCP;
3. (2 and 3 ranks) a real FSDP2 model trains a step with AdamW and saves model + optimizer with DCP, beside
   the full state dict torch gathers itself; rank 0 has ckptkit convert that DCP to FULL and re-shard it,
   and fresh FSDP2 ranks resume from ckptkit's output with torch's loader and train on identically;
4. (2 ranks) an FSDP1 model saves its ``SHARDED_STATE_DICT`` (model + optimizer) with DCP, beside its
   ``FULL_STATE_DICT``.

The test process then converts every torch-written DCP to each form and compares with what torch gathered.
The model is ``fixtures_models.TinyNet`` with ``hidden=2``: its 13-, 7- and 3-row tensors split unevenly at 2
and 3 ranks, and its 2-row ``up`` weights leave rank 2 of 3 without rows.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import traceback
from pathlib import Path

import pytest
import torch

from _checks import assert_same_tree, flat_tensors, load_dcp, load_full, load_hf, make_training_state, tree_difference
from ckptkit.errors import FormatError
from ckptkit.harness.launch import run_ranks
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.export import export_hf
from ckptkit.ops.inspect import inspect
from ckptkit.ops.verify import verify
from fixtures_models import TinyNet, train_step

SOURCE_WORLD_SIZES = (1, 2, 3)


def loadable_state() -> dict:
    return make_training_state()


# ------------------------------------------------------------------------------------ in the spawned ranks


def _model() -> TinyNet:
    return TinyNet(hidden=2)  # up.weight: 2 rows, 1+1 / 1+1+0


def _check_loads(rank: int, ws: int, mesh, root: Path) -> dict:
    """Load ckptkit's DCP for each source world size into Shard(0) DTensors; compare with the source."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    ref = loadable_state()

    def target(v):
        if isinstance(v, dict):
            return {k: target(x) for k, x in v.items()}
        if isinstance(v, list):
            return [target(x) for x in v]
        if not isinstance(v, torch.Tensor):
            return None  # non-tensor entries are replaced by what the checkpoint holds
        if v.dim() == 0 or v.numel() == 0:
            return torch.zeros_like(v)
        rows = torch.chunk(torch.empty(v.shape, device="meta"), ws)
        n = rows[rank].shape[0] if rank < len(rows) else 0
        local = torch.zeros((n, *v.shape[1:]), dtype=v.dtype)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride())

    results = {}
    for n in SOURCE_WORLD_SIZES:
        found = {}
        try:
            sd = target(ref)
            dcp.load(sd, checkpoint_id=str(root / f"ckptkit-dcp{n}"))
            for key, want in flat_tensors(ref).items():
                got = flat_tensors(sd)[key]
                if isinstance(got, DTensor):
                    parts = torch.chunk(want, ws)
                    local_want = parts[rank] if rank < len(parts) else want[:0]
                    # gloo cannot move float8: gather its bytes instead
                    as_bytes = DTensor.from_local(got.to_local().view(torch.uint8), mesh, [Shard(0)], run_check=False,
                                                  shape=want.shape, stride=want.stride()
                                                  ) if want.dtype == torch.float8_e4m3fn else None
                    full = as_bytes.full_tensor().view(want.dtype) if as_bytes is not None else got.full_tensor()
                    problem = (tree_difference(got.to_local(), local_want, f"{key} (local)")
                               or tree_difference(full, want, f"{key} (gathered)"))
                else:
                    problem = tree_difference(got, want, key)
                found[key] = problem or "ok"
            found["step"] = "ok" if sd["step"] == 7 else repr(sd["step"])
            found["name"] = "ok" if sd["name"] == "run-1" else repr(sd["name"])
            pg = sd["optimizer"]["param_groups"]
            found["param_groups"] = "ok" if pg == ref["optimizer"]["param_groups"] else repr(pg)
        except Exception:
            found["<load>"] = traceback.format_exc()
        results[f"dcp{n}"] = found
    return results


def _fsdp2(rank: int, ws: int, mesh, root: Path) -> dict:
    """Train, save with DCP (and the full state torch gathers), then resume from ckptkit's re-sharded copy."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def build(seed: int):
        torch.manual_seed(seed)
        model = _model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, optim = build(0)
    train_step(model, optim, 1)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "fsdp2"))
    full_model, full_optim = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    full = {"model": full_model, "optim": full_optim}
    if rank == 0:
        torch.save(full, root / "fsdp2-full.pt")
        # ckptkit, offline, on one rank: torch's DCP -> FULL -> DCP for 3 ranks -> re-shard for this world size
        convert(root / "fsdp2", root / "fsdp2-via-ckptkit.pt", to="full")
        convert(root / "fsdp2-via-ckptkit.pt", root / "fsdp2-ckptkit3", to="sharded", world_size=3)
        reshard(root / "fsdp2-ckptkit3", root / "fsdp2-ckptkit-resume", world_size=ws)
    dist.barrier()

    # Fresh ranks resume from ckptkit's output with torch's own loader.
    model2, optim2 = build(123)
    msd2, osd2 = get_state_dict(model2, optim2)
    resumed = {"model": msd2, "optim": osd2}
    dcp.load(resumed, checkpoint_id=str(root / "fsdp2-ckptkit-resume"))
    set_state_dict(model2, optim2, model_state_dict=resumed["model"], optim_state_dict=resumed["optim"])
    again_model, again_optim = get_state_dict(model2, optim2, options=StateDictOptions(full_state_dict=True))
    again = {"model": again_model, "optim": again_optim}
    result = {"resume": tree_difference(again, full) or "ok"}
    # ...and both continue identically.
    train_step(model, optim, 2)
    train_step(model2, optim2, 2)
    after = [get_state_dict(m, o, options=StateDictOptions(full_state_dict=True)) for m, o in
             ((model, optim), (model2, optim2))]
    result["train_on"] = tree_difference(after[0], after[1]) or "ok"
    return result


def _fsdp1(rank: int, root: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType

    torch.manual_seed(0)
    model = FSDP(_model(), device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step(model, optim, 1)
    # The full state first: FSDP1 on CPU cannot unshard after a SHARDED_STATE_DICT call in the same process;
    # nor with offload_to_cpu=True.
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        full = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    if rank == 0:
        torch.save(full, root / "fsdp1-full.pt")
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    dcp.save(sharded, checkpoint_id=str(root / "fsdp1"))
    return {}


def placed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"col": torch.randn(3, 7, generator=g),    # Shard(1): columns 4+3 / 3+3+1
            "rep": torch.randn(4, 2, generator=g),    # Replicate(): every rank holds it all
            "row": torch.randn(5, 3, generator=g).to(torch.bfloat16)}  # Shard(0)


def _save_placements(mesh, root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    t = placed_tensors()
    placements = {"col": [Shard(1)], "rep": [Replicate()], "row": [Shard(0)]}
    dcp.save({k: distribute_tensor(v, mesh, placements[k]) for k, v in t.items()}, checkpoint_id=str(root / "placed"))


def unflattened_states() -> dict[str, dict]:
    """What a planner with ``flatten_state_dict=False`` stores whole under each top-level key: a model state dict
    with dotted keys beside a top-level tensor, and a nested one alone."""
    lin = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for i, p in enumerate(lin.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return {"flat": {"model": lin.state_dict(), "top_tensor": torch.arange(4.0), "step": 4},
            "nested": {"model": {"enc": {"weight": lin.weight.detach().clone()}, "dec": {"bias": torch.arange(3)}},
                       "step": 4}}


def _save_unflattened(root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    for name, state in unflattened_states().items():
        dcp.save(state, checkpoint_id=str(root / f"unflattened-{name}"),
                 planner=DefaultSavePlanner(flatten_state_dict=False))


def hf_shard_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"a.weight": torch.randn(5, 3, generator=g), "b.weight": torch.randn(4, 6, generator=g).bfloat16(),
            "c": torch.arange(3)}


def _save_hf_shards(mesh, root: Path) -> None:
    """torch's HF storage writer without consolidation: one safetensors file per rank, uneven Shard(0) rows, a
    Shard(1) split and a replica, with each chunk's offsets in the header."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placements = {"a.weight": [Shard(0)], "b.weight": [Shard(1)], "c": [Replicate()]}
    state = {k: distribute_tensor(v, mesh, placements[k]) for k, v in hf_shard_state().items()}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(path=str(root / "hf-shards"), save_distributed=True))


def _group_main(rank: int, ws: int, root_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    root = Path(root_dir)
    mesh = init_device_mesh("cpu", (ws,))
    results = {"loads": _check_loads(rank, ws, mesh, root)}
    if ws >= 2:
        _save_placements(mesh, root)
        results["fsdp2"] = _fsdp2(rank, ws, mesh, root)
    if ws == 2:
        results["fsdp1"] = _fsdp1(rank, root)
        _save_unflattened(root)
        _save_hf_shards(mesh, root)
    return results


# ------------------------------------------------------------------------------------ in the test process


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda ws: f"ws{ws}")
def group(request, tmp_path_factory):
    """Run one gloo group of ``param`` ranks; (world size, its directory, per-rank results)."""
    ws = request.param
    root = tmp_path_factory.mktemp(f"group{ws}")
    torch.save(loadable_state(), root / "source.pt")
    for n in SOURCE_WORLD_SIZES:
        convert(root / "source.pt", root / f"ckptkit-dcp{n}", to="sharded", world_size=n)
    return ws, root, run_ranks(_group_main, ws, str(root))


def test_dcp_load_by_torch_reads_ckptkit_output(group):
    ws, _, results = group
    for rank, res in enumerate(results):
        for source, found in res["loads"].items():
            bad = {k: v for k, v in found.items() if v != "ok"}
            assert not bad, f"rank {rank} of {ws} loading {source}: {bad}"
            assert len(found) == len(flat_tensors(loadable_state())) + 3


def _check_every_form(tmp_path: Path, src: Path, reference: dict) -> None:
    """ckptkit turns torch's DCP ``src`` into FULL, HF and DCP for 1 and 3 ranks, all equal to ``reference``."""
    convert(src, tmp_path / "full.pt", to="full")
    assert_same_tree(load_full(tmp_path / "full.pt"), reference)

    convert(src, tmp_path / "hf", to="hf")  # the model part, as export-hf finds it
    assert_same_tree(load_hf(tmp_path / "hf"), reference["model"])
    export_hf(src, tmp_path / "export")
    assert_same_tree(load_hf(tmp_path / "export"), reference["model"])

    for n in (1, 3):
        convert(src, tmp_path / f"dcp{n}", to="sharded", world_size=n)
        assert_same_tree(load_dcp(tmp_path / f"dcp{n}", tmp_path / f"dcp{n}.pt"), reference)
        assert verify(src, tmp_path / f"dcp{n}").ok
    assert verify(src, tmp_path / "full.pt").ok
    assert verify(src, tmp_path / "export", model_only=True).ok


@pytest.mark.parametrize("group", [2, 3], indirect=True, ids=lambda ws: f"ws{ws}")  # FSDP2 runs in these groups
def test_convert_fsdp2_dcp_to_every_form(group, tmp_path):
    ws, root, results = group
    reference = load_full(root / "fsdp2-full.pt")
    # torch's own consolidation of its DCP agrees with the state torch gathered: the reference is sound.
    assert_same_tree(load_dcp(root / "fsdp2", tmp_path / "torch.pt"), reference)
    _check_every_form(tmp_path, root / "fsdp2", reference)
    assert_same_tree(load_full(root / "fsdp2-via-ckptkit.pt"), reference)


@pytest.mark.parametrize("group", [2, 3], indirect=True, ids=lambda ws: f"ws{ws}")  # FSDP2 runs in these groups
def test_dcp_load_by_fsdp2_resumes_from_ckptkit_reshard(group):
    ws, _, results = group
    for rank, res in enumerate(results):
        assert res["fsdp2"] == {"resume": "ok", "train_on": "ok"}, f"rank {rank} of {ws}"


@pytest.mark.parametrize("group", [2, 3], indirect=True, ids=lambda ws: f"ws{ws}")
def test_convert_dtensor_column_shards_and_replicas(group, tmp_path):
    ws, root, _ = group
    src = root / "placed"
    chunks = {t.key: [(c.offsets, c.sizes) for c in t.chunks] for t in inspect(src).tensors}
    cols = [c.shape[1] for c in torch.chunk(torch.empty(3, 7), ws, dim=1)]
    starts = [sum(cols[:i]) for i in range(len(cols))]
    assert chunks["col"] == [((0, s), (3, n)) for s, n in zip(starts, cols, strict=True)]
    assert chunks["rep"] == [((0, 0), (4, 2))]  # replicated: DCP's planner keeps one rank's copy
    expected = placed_tensors()
    for form, kwargs in (("out.pt", {"to": "full"}), ("hf", {"to": "hf"}), ("dcp", {"to": "sharded", "world_size": 2})):
        convert(src, tmp_path / form, **kwargs)
    assert_same_tree(load_full(tmp_path / "out.pt"), expected)
    assert_same_tree(load_hf(tmp_path / "hf"), expected)
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "c.pt"), expected)
    assert verify(src, tmp_path / "out.pt").ok


@pytest.mark.parametrize("group", [2], indirect=True, ids=lambda ws: f"ws{ws}")  # FSDP1 runs in this group
def test_convert_fsdp1_sharded_state_dict_to_every_form(group, tmp_path):
    ws, root, _ = group
    reference = load_full(root / "fsdp1-full.pt")
    assert_same_tree(load_dcp(root / "fsdp1", tmp_path / "torch.pt"), reference)
    _check_every_form(tmp_path, root / "fsdp1", reference)


def test_dcp_load_with_empty_container(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 2)},
             "optimizer": {"state": {"w": {"exp_avg": torch.randn(3, 2)}},
                           "param_groups": [{"lr": 0.1, "params": ["w"]}]},
             "scaler": {}}
    torch.save(state, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "dcp", to="sharded", world_size=2)
    target = {"model": {"w": torch.zeros(3, 2)},
              "optimizer": {"state": {"w": {"exp_avg": torch.zeros(3, 2)}},
                            "param_groups": [{"lr": 0.0, "params": None}]},
              "scaler": {}}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_same_tree(target, state)


def test_dcp_load_without_process_group_reads_ckptkit_output(tmp_path):
    # torch's single-process path (no_dist=True) into plain tensors, for every dtype of the zoo.
    import torch.distributed.checkpoint as dcp

    state = loadable_state()
    torch.save(state, tmp_path / "src.pt")
    for n in SOURCE_WORLD_SIZES:
        convert(tmp_path / "src.pt", tmp_path / f"dcp{n}", to="sharded", world_size=n)
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                  "optimizer": {"state": {"f32": {"exp_avg": torch.zeros(5, 3), "step": torch.tensor(0.0)}},
                                "param_groups": [{"lr": None, "betas": None, "eps": None, "foreach": None,
                                                  "params": None}]},
                  "step": 0, "name": ""}
        dcp.load(target, checkpoint_id=str(tmp_path / f"dcp{n}"), no_dist=True)
        assert_same_tree(target, state)


@pytest.mark.parametrize("writer", [
    {"single_file_per_rank": False},  # one .distcp file per tensor
    {"thread_count": 2},              # __0_0.distcp and __0_1.distcp
])
def test_convert_reads_torch_writer_variants(tmp_path, writer):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    base = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    state = {"t": base.t(), "cols": base[:, 1:4], "b": torch.arange(5), "c": torch.ones(2, dtype=torch.bfloat16),
             "step": 3}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp"), **writer), no_dist=True)
    convert(tmp_path / "dcp", tmp_path / "out.pt", to="full")
    assert_same_tree(load_full(tmp_path / "out.pt"), {k: v.contiguous() if isinstance(v, torch.Tensor) else v
                                                      for k, v in state.items()})


def test_convert_torch_dcp_with_safetensors_serialization(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    state = {"a": torch.randn(4, 3), "b": torch.arange(5), "step": 3}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "dcp"),
                                                    serialization_format=SerializationFormat.SAFETENSORS), no_dist=True)
    # Its chunks are safetensors records, not torch.save archives: refused, naming the file and the first key.
    with pytest.raises(FormatError, match=rf"{tmp_path / 'dcp' / '__0_0.distcp'}: 'a' chunk at \[0, 0\] is not a "
                                          r"torch\.save record; DCP saved with serialization_format=SAFETENSORS .* "
                                          r"is not supported"):
        convert(tmp_path / "dcp", tmp_path / "out.pt", to="full")
    assert not (tmp_path / "out.pt").exists()


def torch_chunks(root: Path) -> dict[str, tuple[int, int]]:
    """Each key's chunk archive in ``__0_0.distcp`` of a one-process ``dcp.save``, as (offset, length), read
    with torch's own metadata reader."""
    from torch.distributed.checkpoint import FileSystemReader

    return {index.fqn: (info.offset, info.length)
            for index, info in FileSystemReader(str(root)).read_metadata().storage_data.items()}


def save_alike(root: Path, n: int = 4) -> dict[str, torch.Tensor]:
    """``n`` tensors of one dtype and shape saved by torch's DCP: archives that differ, outside their data, in
    their serialization ids and CRC-32s only."""
    import torch.distributed.checkpoint as dcp

    state = {f"t{i}": torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)}
    dcp.save(state, checkpoint_id=str(root), no_dist=True)
    return state


def torch_loads(root: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, checkpoint_id=str(root), no_dist=True)
    return target


def test_archive_cache_takes_torch_written_chunks_of_one_framing(tmp_path):
    from ckptkit.codecs.torchzip_read import ArchiveCache, read_archive

    state = save_alike(tmp_path / "dcp")
    path, chunks = str(tmp_path / "dcp" / "__0_0.distcp"), torch_chunks(tmp_path / "dcp")
    cache = ArchiveCache()
    with open(path, "rb") as f:
        def pread(size: int, offset: int) -> bytes:
            return os.pread(f.fileno(), size, offset)

        start, length = chunks["t0"]
        cache.read(path, start, length, pread=pread, where="t0")
        for key in ("t1", "t2", "t3"):  # each with its own serialization id and CRC-32s: all framed as t0
            start, length = chunks[key]
            assert cache.lookup(pread, path, start, length) == read_archive(path, start, length, tree=False)
        # Any other byte that differs, here the storage's device in data.pkl: not taken, the full read runs.
        other = pread(length, start).replace(b"cpu", b"cpv")
    (tmp_path / "other").write_bytes(other)
    with open(tmp_path / "other", "rb") as f:
        assert cache.lookup(lambda size, offset: os.pread(f.fileno(), size, offset), path, 0, length) is None
    convert(tmp_path / "dcp", tmp_path / "out.pt", to="full")
    assert_same_tree(load_full(tmp_path / "out.pt"), state)


def record_data(archive: bytes, name: bytes) -> int:
    """Where record ``name``'s bytes start in a zip archive: after its local header, name and padding."""
    header = archive.index(name) - 30
    name_len, extra_len = struct.unpack_from("<HH", archive, header + 26)
    return header + 30 + name_len + extra_len


@pytest.mark.parametrize("field", ["central directory CRC-32", "data descriptor CRC-32"])
def test_convert_reads_torch_chunks_with_a_wrong_crc_as_torch_does(tmp_path, field):
    # torch never checks a record's CRC-32: a chunk whose data no longer matches it loads all the same.
    state = save_alike(tmp_path / "dcp")
    path, (start, length) = tmp_path / "dcp" / "__0_0.distcp", torch_chunks(tmp_path / "dcp")["t2"]
    data = bytearray(path.read_bytes())
    archive = bytes(data[start:start + length])
    if field == "central directory CRC-32":
        at = archive.rindex(b"archive/data/0") - 46 + 16  # the name follows the 46-byte entry
    else:
        at = record_data(archive, b"archive/data/0") + 4 * 8 * 4
        assert archive[at:at + 4] == b"PK\x07\x08"
        at += 4
    data[start + at] ^= 0x5A
    path.write_bytes(data)
    convert(tmp_path / "dcp", tmp_path / "out.pt", to="full")
    assert_same_tree(load_full(tmp_path / "out.pt"), torch_loads(tmp_path / "dcp", state))


def test_convert_refuses_torch_chunk_whose_serialization_id_is_not_text(tmp_path):
    # torch.load decodes every archive's serialization id, so a chunk whose id is not UTF-8 fails in torch:
    # the cached framing of the chunks before it must not take it.
    state = save_alike(tmp_path / "dcp")
    path, (start, length) = tmp_path / "dcp" / "__0_0.distcp", torch_chunks(tmp_path / "dcp")["t2"]
    data = bytearray(path.read_bytes())
    data[start + record_data(bytes(data[start:start + length]), b"archive/.data/serialization_id") + 5] = 0xFF
    path.write_bytes(data)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException, match="UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"):
        torch_loads(tmp_path / "dcp", state)
    with pytest.raises(FormatError, match=rf"^{path}: 't2' chunk \[0, 0\]: not a torch\.save archive torch can read "
                                          r"\(serialization id b'.*' is not UTF-8 text\)$"):
        convert(tmp_path / "dcp", tmp_path / "out.pt", to="full")


def test_export_hf_and_verify_model_only_read_only_the_model_s_chunks(tmp_path):
    # An export writes the model alone, so it checks the model's chunk archives alone: a damaged optimizer
    # chunk that every full read refuses (convert, as torch's loader does) leaves the export what it was, and
    # verify --model-only compares the models.
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    model = {"embed.weight": torch.randn(6, 4, generator=gen), "head.weight": torch.randn(5, 4, generator=gen)}
    optim = {"state": {k: {"exp_avg": torch.randn(v.shape, generator=gen)} for k, v in model.items()},
             "param_groups": [{"lr": 0.1, "params": list(model)}]}
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    export_hf(tmp_path / "dcp", tmp_path / "intact")
    path = tmp_path / "dcp" / "__0_0.distcp"
    start, _ = torch_chunks(tmp_path / "dcp")["optim.state.embed.weight.exp_avg"]
    data = bytearray(path.read_bytes())
    data[start:start + 4] = b"PK\x00\x00"  # no longer a zip local header
    path.write_bytes(data)
    with pytest.raises(FormatError, match=r"'optim\.state\.embed\.weight\.exp_avg' chunk at \[0, 0\] is not a "
                                          r"torch\.save record"):
        convert(tmp_path / "dcp", tmp_path / "out.pt", to="full")
    export_hf(tmp_path / "dcp", tmp_path / "hf")
    written = (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert written == (tmp_path / "intact" / "model.safetensors").read_bytes()
    assert_same_tree(load_hf(tmp_path / "hf"), model)
    assert verify(tmp_path / "dcp", tmp_path / "hf", model_only=True).ok
    with pytest.raises(FormatError, match=r"'optim\.state\.embed\.weight\.exp_avg' chunk at \[0, 0\]"):
        verify(tmp_path / "dcp", tmp_path / "dcp")  # the whole of it is read


def test_read_part_leaves_unwanted_tensors_without_chunks_so_writing_them_fails(tmp_path):
    from ckptkit.errors import IncompleteCheckpointError
    from ckptkit.formats.dcp import DcpIO
    from ckptkit.formats.hf import HfIO, HfOptions
    from ckptkit.io.execute import execute
    from ckptkit.io.options import WriteOptions
    from ckptkit.io.storage.local import LOCAL

    state = save_alike(tmp_path / "dcp")
    partial = DcpIO().read_part(tmp_path / "dcp", lambda m: {"t1"})
    assert {t.key: len(t.chunks) for t in partial.tensors} == {"t0": 0, "t1": 1, "t2": 0, "t3": 0}
    with pytest.raises(IncompleteCheckpointError, match=r"tensor 't0': chunks supply 0 of the 128 bytes"):
        execute(HfIO().plan(partial, HfOptions()), tmp_path / "hf", LOCAL, WriteOptions())
    assert not (tmp_path / "hf").exists()
    execute(HfIO().plan(dataclasses.replace(partial, tensors=partial.tensors[1:2]), HfOptions()), tmp_path / "hf",
            LOCAL, WriteOptions())
    assert_same_tree(load_hf(tmp_path / "hf"), {"t1": state["t1"]})


def test_convert_and_reshard_carry_bytesio_leaves_as_the_bytes_torch_saved(tmp_path):
    # io.BytesIO is DCP's own leaf type for bytes, and Transformer Engine's _extra_state in a model's state dict.
    import io

    import torch.distributed.checkpoint as dcp

    extra = io.BytesIO()
    torch.save({"scale": torch.ones(2)}, extra)
    state = {"w": torch.randn(4, 2), "layer._extra_state": extra, "raw": io.BytesIO(b"hello")}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)

    def same_bytes(loaded: dict) -> None:
        assert torch.equal(loaded["w"], state["w"])
        for key in ("layer._extra_state", "raw"):
            assert isinstance(loaded[key], io.BytesIO) and loaded[key].getvalue() == state[key].getvalue(), key

    convert(tmp_path / "dcp", tmp_path / "full.pt", to="full")
    same_bytes(torch.load(tmp_path / "full.pt", weights_only=False))  # as torch.load reads a BytesIO
    reshard(tmp_path / "dcp", tmp_path / "dcp2", world_size=2)
    target = {"w": torch.zeros(4, 2), "layer._extra_state": io.BytesIO(), "raw": io.BytesIO()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp2"), no_dist=True)
    same_bytes(target)
    convert(tmp_path / "full.pt", tmp_path / "back", to="sharded", world_size=2)
    target = {"w": torch.zeros(4, 2), "layer._extra_state": io.BytesIO(), "raw": io.BytesIO()}
    dcp.load(target, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    same_bytes(target)
    assert verify(tmp_path / "dcp", tmp_path / "back").ok


@pytest.mark.parametrize("name", ["flat", "nested"])
def test_export_hf_and_convert_open_entries_a_planner_stored_whole(group, tmp_path, name):
    # DefaultSavePlanner(flatten_state_dict=False) stores each top-level value whole: "model" is one bytes entry
    # holding the model's tensors, which torch's loader returns as a dict of tensors.
    ws, root, _ = group
    if ws != 2:
        pytest.skip("saved by the 2-rank group")
    src, state = root / f"unflattened-{name}", unflattened_states()[name]
    reference = load_dcp(src, tmp_path / "torch.pt")
    assert_same_tree(reference, state)
    convert(src, tmp_path / "full.pt", to="full")
    assert_same_tree(load_full(tmp_path / "full.pt"), reference)
    reshard(src, tmp_path / "dcp3", world_size=3)
    assert_same_tree(load_dcp(tmp_path / "dcp3", tmp_path / "torch3.pt"), reference)
    model = flat_tensors(reference["model"])
    for report in (export_hf(src, tmp_path / "hf"), convert(src, tmp_path / "hf2", to="hf")):
        assert "model taken from top-level key 'model'" in report.notes
        assert_same_tree(load_hf(Path(report.destination)), model)


def test_every_command_reads_torch_hf_storage_writer_shards_as_the_sharded_checkpoint_they_are(group, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    ws, root, _ = group
    if ws != 2:
        pytest.skip("saved by the 2-rank group")
    src = root / "hf-shards"
    reference = {k: torch.zeros_like(v) for k, v in hf_shard_state().items()}
    dcp.load(reference, storage_reader=HuggingFaceStorageReader(str(src)), no_dist=True)
    assert_same_tree(reference, hf_shard_state())
    summary = inspect(src)
    assert (summary.format.value, summary.world_size) == ("hf-shards", 2)
    convert(src, tmp_path / "full.pt", to="full")
    assert_same_tree(load_full(tmp_path / "full.pt"), reference)
    reshard(src, tmp_path / "dcp3", world_size=3)
    assert_same_tree(load_dcp(tmp_path / "dcp3", tmp_path / "torch3.pt"), reference)
    export_hf(src, tmp_path / "hf")
    convert(src, tmp_path / "hf2", to="hf")
    assert_same_tree(load_hf(tmp_path / "hf"), reference)
    assert_same_tree(load_hf(tmp_path / "hf2"), reference)
    assert verify(src, tmp_path / "full.pt").ok


def test_convert_keeps_a_step_0_optimizer_s_empty_state_through_dcp(tmp_path):
    # AdamW before its first step: {"state": {}, "param_groups": [...]}. torch's DCP stores no empty dict.
    import torch.distributed.checkpoint as dcp

    def fresh() -> dict:
        lin = torch.nn.Linear(3, 2)
        return {"model": lin.state_dict(), "optimizer": torch.optim.AdamW(lin.parameters()).state_dict(),
                "scaler": {}, "hist": []}

    state = fresh()
    torch.save(state, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "dcp2", to="sharded", world_size=2)
    reshard(tmp_path / "dcp2", tmp_path / "dcp3", world_size=3)
    convert(tmp_path / "dcp3", tmp_path / "back.pt", to="full")
    back = load_full(tmp_path / "back.pt")
    assert_same_tree(back, state)
    torch.optim.AdamW(torch.nn.Linear(3, 2).parameters()).load_state_dict(back["optimizer"])  # no KeyError
    target = fresh()  # torch's own loader, as a resumed run calls it, still takes the output
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp3"), no_dist=True)
    assert_same_tree(target, state)
    assert verify(tmp_path / "src.pt", tmp_path / "dcp3").ok

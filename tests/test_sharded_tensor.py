"""ckptkit.codecs.sharded_tensor: torch's ``ShardedTensor`` pickles (what FSDP1 LOCAL_STATE_DICT files hold), read
as data and written back, against torch itself in a 2-rank gloo group.

torch cannot load such a file without a process group of the saving rank and world size, so the ranks do
all three steps: torch saves a ShardedTensor, ckptkit reads the file and writes its own, torch loads that.
"""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

import pytest
import torch

from ckptkit.codecs.sharded_tensor import sharded_tensor, sharded_tensor_globals
from ckptkit.codecs.torchzip_read import read_archive
from ckptkit.codecs.torchzip_write import archive_parts
from ckptkit.core.manifest import TensorRef
from ckptkit.core.plan import FilePlan, Region
from ckptkit.errors import UnsafeCheckpointError
from ckptkit.harness.launch import run_ranks
from ckptkit.io.sources import Files, read_region
from ckptkit.io.storage.local.writer import write_files

# name -> (global tensor, the rows each of the 2 ranks holds)
TENSORS = {
    "flat": (torch.arange(7.0), (4, 3)),                                    # 1-D, as FSDP1 flat parameters
    "rows": (torch.arange(15.0).reshape(5, 3).to(torch.bfloat16), (3, 2)),  # 2-D, uneven
}


def _described(st) -> dict:
    """A ShardedTensor as plain data (a rank cannot hand tensors back to the test process)."""
    (shard,) = st.local_shards()
    meta = st.metadata()
    return {"dtype": str(meta.tensor_properties.dtype), "size": list(meta.size),
            "shards": [(list(m.shard_offsets), list(m.shard_sizes), m.placement.rank()) for m in meta.shards_metadata],
            "local": (list(shard.metadata.shard_offsets), list(shard.metadata.shard_sizes),
                      shard.metadata.placement.rank()),
            "bytes": shard.tensor.contiguous().view(torch.uint8).numpy().tobytes()}


def _ref_bytes(ref: TensorRef) -> bytes:
    with Files() as files:
        return bytes(read_region(Region.whole(ref.as_entry(("t",))), files))


def _save_read_write_load(rank: int, world: int, d: str) -> dict:
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    root = Path(d)
    saved = {}
    for name, (full, rows) in TENSORS.items():
        start = sum(rows[:rank])
        offsets, sizes = [start] + [0] * (full.dim() - 1), [rows[rank], *full.shape[1:]]
        meta = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{rank}/cpu")
        saved[name] = init_from_local_shards([Shard(full[start:start + rows[rank]].clone(), meta)], list(full.shape))
    torch.save(saved, root / f"torch{rank}.pt")

    # ckptkit reads torch's file as data, and lays out its own from what it read.
    path = str(root / f"torch{rank}.pt")
    tree = read_archive(path, extra_globals=sharded_tensor_globals(path))
    read, written = {}, {}
    for name, data in tree.items():
        ((box, ref),) = data.local
        read[name] = {"dtype": f"torch.{data.dtype}", "size": list(data.size), "rank": data.rank,
                      "world": data.world_size,
                      "shards": [(list(s.offsets), list(s.sizes), s.rank) for s in data.shards],
                      "local": (list(box.offsets), list(box.sizes), box.rank), "bytes": _ref_bytes(ref)}
        written[name] = sharded_tensor(data.dtype, data.size, data.shards, [(box, Region.whole(ref.as_entry((name,))))],
                                       rank=data.rank, world_size=data.world_size, requires_grad=False)
    write_files((FilePlan(f"ckptkit{rank}.pt", archive_parts(written, name=f"ckptkit{rank}")),), root)
    dist.barrier()

    # torch loads ckptkit's file into ShardedTensors of its own.
    loaded = torch.load(root / f"ckptkit{rank}.pt", weights_only=False)
    return {"torch": {k: _described(v) for k, v in saved.items()}, "read": read,
            "loaded": {k: _described(v) for k, v in loaded.items()}}


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("sharded")
    return root, run_ranks(_save_read_write_load, 2, str(root))


def test_sharded_tensor_read_as_torch_saved_it(group):
    _, results = group
    for rank, res in enumerate(results):
        for name, want in res["torch"].items():
            got = res["read"][name]
            assert (got["rank"], got["world"]) == (rank, 2)
            assert {k: got[k] for k in want} == want, f"rank {rank}: {name}"


def test_sharded_tensor_written_by_ckptkit_loads_in_torch(group):
    _, results = group
    for rank, res in enumerate(results):
        assert res["loaded"] == res["torch"], f"rank {rank}"


def _globals(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return [arg.replace(" ", ".") for op, arg, _ in pickletools.genops(pkl) if op.name == "GLOBAL"]


def test_sharded_tensor_pickle_names_torch_s_globals_in_torch_s_order(group):
    # The local tensors aside (ckptkit writes untyped storages and _rebuild_tensor_v3, which torch reads
    # alike; see test_torchzip), and getattr, which Python builds memoise at different points (test_local).
    root, _ = group
    tensor_globals = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3", "torch.FloatStorage",
                      "torch.BFloat16Storage", "torch.storage.UntypedStorage", "torch.float32", "torch.bfloat16",
                      "__builtin__.getattr", "collections.OrderedDict"}
    for rank in range(2):
        ours, theirs = (_globals(root / f"{who}{rank}.pt") for who in ("ckptkit", "torch"))
        assert [g for g in ours if g not in tensor_globals] == [g for g in theirs if g not in tensor_globals]


class SubTensor(torch.Tensor):
    """A tensor subclass of the user's own, pickled by name through ``_rebuild_from_type_v2``."""


def test_sharded_tensor_globals_allow_no_other_tensor_subclass(tmp_path):
    torch.save({"w": torch.ones(2).as_subclass(SubTensor)}, tmp_path / "s.pt")
    path = str(tmp_path / "s.pt")
    with pytest.raises(UnsafeCheckpointError, match=rf"^{path}: the pickle asks for test_sharded_tensor\.SubTensor, "
                                                    r"which is not on ckptkit's allow-list"):
        read_archive(path, extra_globals=sharded_tensor_globals(path))


@pytest.mark.parametrize("state, torch_reads", [
    (b"N}(X\x0b\x00\x00\x00shard_sizesK\x01u\x86", True),   # (None, {slot: value}): what torch pickles
    (b"}(X\x0b\x00\x00\x00shard_sizesK\x01u", False),     # a dict: there is no __dict__ to set it in
    (b"N}(X\x05\x00\x00\x00otherK\x01u\x86", False),       # a name that is not a slot
])
def test_shard_metadata_state_is_held_to_what_torch_can_set(state, torch_reads):
    # ShardMetadata has __slots__ and no __dict__: torch's unpickler sets only a (None, slots) state on it.
    import pickle

    from ckptkit.codecs.pickle_read import SafeUnpickler
    from ckptkit.errors import FormatError

    data = b"\x80\x02ctorch.distributed._shard.metadata\nShardMetadata\n)\x81" + state + b"b."
    try:
        pickle.loads(data)
    except AttributeError:
        assert not torch_reads
    else:
        assert torch_reads
    read = lambda: SafeUnpickler(data, sharded_tensor_globals("rank0.pt"), where="rank0.pt").load_checked()  # noqa: E731
    if torch_reads:
        assert read().shard_sizes == 1
    else:
        with pytest.raises(FormatError, match=r"^rank0\.pt: ShardMetadata has state .* unpickler cannot set it"):
            read()

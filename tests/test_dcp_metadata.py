"""ckptkit.codecs.dcp_metadata: DCP's ``.metadata`` written straight from a plan.

The oracle is torch: its own unpickler must read the bytes into ``Metadata`` equal to one built from torch's
classes (memo slots past 255, ints past 2**31, lists of more than 1000 chunks and dicts of more than 1000
tensors included).
"""

from __future__ import annotations

import pickle
import pickletools
import random

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptkit.codecs.dcp_metadata import ChunkRecord, MetadataPickle, ObjectRecord, TensorRecord
from ckptkit.core.boxes import shard0_boxes
from ckptkit.core.dtypes import by_name


def records(seed: int, tensors: int, ranks: int) -> tuple[list[TensorRecord], list[ObjectRecord], dict]:
    rng = random.Random(seed)
    out, sizes = [], [0] * ranks
    for i in range(tensors):
        shape = rng.choice([(), (0,), (rng.randint(1, 40),), (rng.randint(1, 9), 3), (2, 3, 4, 5), (3000, 2)])
        key = f"model.layers.{i}.weight" if rng.random() < 0.6 else f"optim.state.layers.{i}.exp_avg"
        chunks = []
        for rank, (offsets, box) in shard0_boxes(shape, ranks):
            length = rng.choice([1000, 70_000, 3 << 30])  # past 2**31: a LONG1 in the pickle
            chunks.append(ChunkRecord(offsets, box, f"__{rank}_0.distcp", sizes[rank], length))
            sizes[rank] += length
        out.append(TensorRecord(key, by_name(rng.choice(["bfloat16", "float32", "int64"])), shape, chunks))
    objects = [ObjectRecord(f"extra.{i}", "__0_0.distcp", sizes[0] + 100 * i, 100) for i in range(rng.randint(0, 3))]
    planner = {t.key: tuple(t.key.split(".")) if t.key.startswith("optim") else (t.key,) for t in out}
    planner.update({o.key: ("extra", int(o.key.split(".")[1])) for o in objects})
    return out, objects, planner


def torch_metadata(tensors, objects, planner) -> Metadata:
    sd, storage = {}, {}
    for t in tensors:
        sd[t.key] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, t.dtype.name)), torch.Size(t.shape),
                                          [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                                           for c in t.chunks])
        for i, c in enumerate(t.chunks):
            storage[MetadataIndex(t.key, torch.Size(c.offsets), i)] = _StorageInfo(c.file, c.offset, c.length)
    for o in objects:
        sd[o.key] = BytesStorageMetadata()
        storage[MetadataIndex(o.key)] = _StorageInfo(o.file, o.offset, o.length)
    return Metadata(sd, planner_data=planner, storage_data=storage, version="1.0.0")


@pytest.mark.parametrize("seed, tensors, ranks", [
    (0, 1, 1), (1, 3, 2), (2, 40, 4),
    (3, 999, 1), (4, 1000, 1), (5, 1001, 1),  # state_dict_metadata on, and just past, a batch of 1000
    (6, 12, 1500),  # a (3000, 2) tensor on 1500 ranks: a list of 1500 chunks, more than a batch
    (7, 300, 7),
])
def test_metadata_pickle_is_what_torch_reads_as_its_own_metadata(seed, tensors, ranks):
    tensor_records, objects, planner = records(seed, tensors, ranks)
    written = MetadataPickle().dumps(tensor_records, objects, planner)
    assert pickle.loads(written) == torch_metadata(tensor_records, objects, planner)
    # Only what repeats is memoized (classes, field names, keys): no store per chunk.
    stores = sum(op.name in ("BINPUT", "LONG_BINPUT") for op, _, _ in pickletools.genops(written))
    assert stores <= len({t.key for t in tensor_records} | {o.key for o in objects}) + 30


def test_metadata_pickle_of_a_checkpoint_with_no_tensors():
    objects = [ObjectRecord("step", "__0_0.distcp", 0, 700)]
    written = MetadataPickle().dumps([], objects, {"step": ("step",)})
    assert pickle.loads(written) == torch_metadata([], objects, {"step": ("step",)})

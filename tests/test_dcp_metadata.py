"""ckptkit.codecs.dcp_metadata: DCP's ``.metadata`` written straight from a plan.

Two oracles: Python's C pickler, pickling the graph of stand-ins that the writer stands for (byte for byte,
batches of 1000 and memo slots past 255 included), and torch, whose own unpickler must read the bytes into
``Metadata`` equal to one built from torch's classes.
"""

from __future__ import annotations

import pickle
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
from ckptkit.codecs.pickle_read import keep_call, make_record
from ckptkit.codecs.pickle_write import dumps
from ckptkit.core.boxes import shard0_boxes
from ckptkit.core.dtypes import by_name

DCP, FS = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"


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


def stand_ins(tensors, objects, planner) -> bytes:
    """The graph of ckptkit's pickle stand-ins the writer stands for, pickled by the C pickler."""
    size = keep_call("torch", "Size")
    sd, storage = {}, {}
    for t in tensors:
        chunk_list = []
        for c in t.chunks:
            chunk_list.append(make_record(DCP, "ChunkStorageMetadata", {"offsets": size(c.offsets),
                                                                          "sizes": size(c.sizes)}))
            index = make_record(DCP, "MetadataIndex",
                                {"fqn": t.key, "offset": size(c.offsets), "index": len(chunk_list) - 1})
            storage[index] = make_record(FS, "_StorageInfo", {"relative_path": "".join(c.file), "offset": c.offset,
                                                              "length": c.length})
        props = make_record(DCP, "TensorProperties", (
            t.dtype, keep_call("torch.serialization", "_get_layout")("torch.strided"), False,
            keep_call(DCP, "_MEM_FORMAT_ENCODING")(0), False))
        sd[t.key] = make_record(DCP, "TensorStorageMetadata", {"properties": props, "size": size(t.shape),
                                                                "chunks": chunk_list})
    for o in objects:
        sd[o.key] = make_record(DCP, "BytesStorageMetadata", {})
        index = make_record(DCP, "MetadataIndex", {"fqn": o.key, "offset": None, "index": None})
        storage[index] = make_record(FS, "_StorageInfo", {"relative_path": "".join(o.file), "offset": o.offset,
                                                          "length": o.length})
    md = make_record(DCP, "Metadata", {"state_dict_metadata": sd, "planner_data": planner, "storage_data": storage,
                                       "storage_meta": None, "version": "1.0.0"})
    return dumps(md, protocol=2)


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
def test_metadata_pickle_is_the_c_picklers_pickle_and_torch_reads_it(seed, tensors, ranks):
    written = MetadataPickle().dumps(*records(seed, tensors, ranks))
    assert written == stand_ins(*records(seed, tensors, ranks))
    assert pickle.loads(written) == torch_metadata(*records(seed, tensors, ranks))


def test_metadata_pickle_of_a_checkpoint_with_no_tensors():
    objects = [ObjectRecord("step", "__0_0.distcp", 0, 700)]
    written = MetadataPickle().dumps([], objects, {"step": ("step",)})
    assert written == stand_ins([], objects, {"step": ("step",)})
    assert pickle.loads(written) == torch_metadata([], objects, {"step": ("step",)})

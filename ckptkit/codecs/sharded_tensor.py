"""torch's legacy ``ShardedTensor`` pickle as data, both ways, without importing torch.

``torch.save`` of a ShardedTensor (what FSDP1 ``LOCAL_STATE_DICT`` puts under each ``_flat_param``) pickles::

    torch._tensor._rebuild_from_type_v2(
        torch._utils._rebuild_wrapper_subclass, ShardedTensor,
        (ShardedTensor, dtype, size, stride, 0, layout, device, requires_grad),   # the wrapper's args
        ([Shard(tensor, ShardMetadata(offsets, sizes, _remote_device(rank)))],     # this rank's shards
         ShardedTensorMetadata([ShardMetadata per rank...], Size(size), TensorProperties(...)),
         getattr(ShardedTensor, "ProcessGroupState")(rank, rank, world, world),
         ChunkShardingSpec(dim=0, placements=[...]),
         False))                                                                 # init_rrefs

``ShardedTensor.__setstate__`` needs a process group of the saving rank and world size, so torch cannot
open such a file offline. :func:`sharded_tensor_globals` maps those globals to plain records and rebuilds
the whole thing as a :class:`ShardedTensorData`. :func:`sharded_tensor` writes the same structure back, and
:func:`archive` lays out a ``torch.save`` archive whose tensors may sit inside such pickled objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.boxes import row_major
from ..core.dtypes import DType
from ..core.manifest import TensorRef
from ._torch_globals import WRAPPER_SUBCLASS, Tag, subclass_rebuild
from .pickle_read import (
    MEMORY_FORMATS,
    Call,
    EnumStandIn,
    Record,
    allow_records,
    allow_slotted_records,
    keep_call,
    make_record,
    record_class,
    ref,
    safe_getattr,
)

__all__ = ["ShardBox", "ShardedTensorData", "sharded_tensor", "sharded_tensor_globals"]

_API = "torch.distributed._shard.sharded_tensor.api"
_SHARD = "torch.distributed._shard.sharded_tensor.shard"
_SHARD_META = "torch.distributed._shard.metadata"
_ST_META = "torch.distributed._shard.sharded_tensor.metadata"
_SPEC = "torch.distributed._shard.sharding_spec.chunk_sharding_spec"
_REMOTE = "torch.distributed.remote_device"


@dataclass(frozen=True, slots=True)
class ShardBox:
    """One shard's box of the global tensor and the rank that holds it (None when unplaced)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int | None


@dataclass(frozen=True, slots=True)
class ShardedTensorData:
    """A ShardedTensor as one rank saved it: the global picture and this rank's shard bytes."""

    dtype: DType
    size: tuple[int, ...]
    shards: tuple[ShardBox, ...]
    """Every rank's shard (the global metadata each rank's file repeats)."""
    local: tuple[tuple[ShardBox, TensorRef], ...]
    """The shards this rank holds, with their bytes."""
    rank: int
    world_size: int


# --------------------------------------------------------------------------------------------------------
# Reading


_SHARDED = Tag(f"{_API}.ShardedTensor")
_PG_STATE_NAME = "ProcessGroupState"


def sharded_tensor_globals(where: str) -> dict[tuple[str, str], Any]:
    """Extra allow-list entries for :func:`~ckptkit.codecs.torchzip_read.read_archive`: ShardedTensors become
    :class:`ShardedTensorData`; every other use of these names is refused, naming ``where``."""
    pg_state = record_class(_API, f"ShardedTensor.{_PG_STATE_NAME}")

    return {
        ("torch._tensor", "_rebuild_from_type_v2"): subclass_rebuild(where, _SHARDED, _sharded_data),
        ("torch._utils", "_rebuild_wrapper_subclass"): WRAPPER_SUBCLASS,
        (_API, "ShardedTensor"): _SHARDED,
        # Protocol 2 cannot name a nested class, so torch pickles getattr(ShardedTensor, "ProcessGroupState").
        ("builtins", "getattr"): safe_getattr({(id(_SHARDED), _PG_STATE_NAME): pg_state}),
        **allow_slotted_records(_SHARD, {"Shard": ("tensor", "metadata")}),
        **allow_slotted_records(_SHARD_META, {"ShardMetadata": ("shard_offsets", "shard_sizes", "placement")}),
        **allow_records(_REMOTE, "_remote_device"),
        **allow_records(_ST_META, "ShardedTensorMetadata", "TensorProperties"),
        **allow_records(_SPEC, "ChunkShardingSpec"),
        (_ST_META, "MEM_FORMAT_ENCODING"): EnumStandIn(MEMORY_FORMATS, keep_call(_ST_META, "MEM_FORMAT_ENCODING")),
    }


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if isinstance(v, Call):  # torch.Size((...))
        v = v.args[0] if v.args else ()
    valid = isinstance(v, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v)
    if not valid:
        raise ValueError(f"{what} should be a list of non-negative ints, found {v!r}")
    return tuple(v)


def _box(meta: Any) -> ShardBox:
    offsets, sizes = _ints(meta.shard_offsets, "shard_offsets"), _ints(meta.shard_sizes, "shard_sizes")
    if len(offsets) != len(sizes):
        raise ValueError(f"shard_offsets {list(offsets)} and shard_sizes {list(sizes)} differ in rank")
    rank = getattr(meta.placement, "_rank", None) if meta.placement is not None else None
    return ShardBox(offsets, sizes, rank if isinstance(rank, int) else None)


def _sharded_data(args: tuple, state: tuple) -> ShardedTensorData:
    dtype, size = args[1], _ints(args[2], "size")  # args[0] repeats the class
    shards, meta, pg = state[0], state[1], state[2]
    if not isinstance(dtype, DType):
        raise ValueError(f"dtype should be a torch dtype, found {dtype!r}")
    if _ints(meta.size, "metadata size") != size:
        raise ValueError(f"wrapper size {list(size)} differs from metadata size {list(_ints(meta.size, 'size'))}")
    local = []
    for s in shards:
        box, t = _box(s.metadata), s.tensor
        if not isinstance(t, TensorRef) or t.dtype != dtype or t.shape != box.sizes:
            found = f"{t.dtype} {list(t.shape)}" if isinstance(t, TensorRef) else type(t).__name__
            raise ValueError(f"local shard at {list(box.offsets)} holds {found}, "
                             f"metadata says {dtype} {list(box.sizes)}")
        if t.strides is None and t.span.length < math.prod(t.shape) * dtype.itemsize:
            raise ValueError(f"local shard at {list(box.offsets)} needs {math.prod(t.shape) * dtype.itemsize} bytes, "
                             f"its storage holds {t.span.length}")
        local.append((box, t))
    rank, world = pg.local_rank, pg.local_world_size
    if not all(isinstance(v, int) for v in (rank, world)):
        raise ValueError(f"process group state has rank {rank!r} and world size {world!r}")
    return ShardedTensorData(dtype, size, tuple(_box(m) for m in meta.shards_metadata), tuple(local), rank, world)


# --------------------------------------------------------------------------------------------------------
# Writing


class _PgState(Record):
    # A record whose class is pickled as the getattr call torch writes (see getattr_ above).
    _pickle_name = Call(ref("__builtin__", "getattr"), (ref(_API, "ShardedTensor"), _PG_STATE_NAME))  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ProcessGroupState({self.__dict__})"


def _slotted(module: str, name: str, fields: dict) -> Record:
    """A record of a ``__slots__`` class: torch pickles its state as ``(None, {slot: value})``."""
    obj = record_class(module, name).__new__(record_class(module, name))
    obj.__dict__["state"] = (None, fields)  # kept as is: its __setstate__ would merge the pair into a dict
    return obj


def _device(kind: str) -> Call:
    return keep_call("torch", "device")(kind)


def _placement(rank: int | None, device: Call) -> Record:
    return make_record(_REMOTE, "_remote_device", {"_worker_name": None, "_rank": rank, "_device": device})


def _shard_meta(box: ShardBox, placement: Record) -> Record:
    return _slotted(_SHARD_META, "ShardMetadata", {"shard_offsets": list(box.offsets), "shard_sizes": list(box.sizes),
                                             "placement": placement})


def sharded_tensor(dtype: DType, size: tuple[int, ...], shards: tuple[ShardBox, ...], local: list[tuple[ShardBox, Any]],
                   *, rank: int, world_size: int, requires_grad: bool) -> Call:
    """The pickle of a ShardedTensor chunked along dim 0, as rank ``rank`` of ``world_size`` saves it.

    ``local`` pairs this rank's boxes with their tensors (:class:`Region` or :class:`PartsTensor` leaves,
    for :func:`archive`). As in torch's own files, the local shards carry metadata objects of their own and
    the sharding spec reuses the global metadata's placements, ordered by offset.
    """
    device = _device("cpu")
    layout = keep_call("torch.serialization", "_get_layout")("torch.strided")
    placements = {box: _placement(box.rank, device) for box in shards}
    local_shards = [_slotted(_SHARD, "Shard", {"tensor": t, "metadata": _shard_meta(box, _placement(box.rank, device))})
                    for box, t in local]
    props = make_record(_ST_META, "TensorProperties",
                        (dtype, layout, requires_grad, keep_call(_ST_META, "MEM_FORMAT_ENCODING")(0), False))
    meta = make_record(_ST_META, "ShardedTensorMetadata", {
        "shards_metadata": [_shard_meta(box, placements[box]) for box in shards],
        "size": keep_call("torch", "Size")(tuple(size)), "tensor_properties": props})
    pg = _PgState()
    pg.__dict__.update({"local_rank": rank, "global_rank": rank, "local_world_size": world_size,
                     "global_world_size": world_size})
    by_offset = sorted(shards, key=lambda b: sum(b.offsets))
    spec = make_record(_SPEC, "ChunkShardingSpec", {"dim": 0, "placements": [placements[b] for b in by_offset]})
    wrapper_args = (ref(_API, "ShardedTensor"), dtype, tuple(size), row_major(tuple(size)), 0, layout, device,
                    requires_grad)
    return Call(ref("torch._tensor", "_rebuild_from_type_v2"), (
        ref("torch._utils", "_rebuild_wrapper_subclass"), ref(_API, "ShardedTensor"), wrapper_args,
        (local_shards, meta, pg, spec, False)))

"""torch's DTensor pickle as data, without importing torch, and the box of the global tensor each rank holds.

``torch.save`` of a DTensor (what FSDP2, and FSDP1 given a ``device_mesh``, put in a state dict) pickles::

    torch._tensor._rebuild_from_type_v2(
        torch._utils._rebuild_wrapper_subclass, DTensor,
        (DTensor, dtype, global_size, global_stride, 0, layout, device, requires_grad),
        (None, {"_local_tensor": <this rank's plain tensor>,
                "_spec": DTensorSpec{mesh: DeviceMesh{...}, placements: (Shard{dim}, ...),
                                     tensor_meta: TensorMeta(Size, stride, dtype), shard_order: (...)}}))

No process group is pickled: the DeviceMesh carries its shape (as a layout from torch 2.10, as a rank
tensor before) and this rank's coordinate in it. :func:`dtensor_globals` maps these globals to plain records
and rebuilds each DTensor as a :class:`DTensorData`; :func:`local_box` says which box of the global tensor a
coordinate holds, with ``torch.chunk`` sizes, as torch itself splits it. The pickles of torch 2.8 to 2.14 are
covered (the mesh's state changed in 2.10 and 2.13; placements are the same dicts throughout).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..core.dtypes import DType
from ..core.manifest import TensorRef
from ..errors import FormatError
from ._torch_globals import WRAPPER_SUBCLASS, Tag, subclass_rebuild
from .pickle_read import Call, Record, allow_records, record_class, ref

__all__ = ["DTensorData", "MeshData", "Placement", "dtensor_globals", "local_box"]

_D = "torch.distributed"
_API = f"{_D}.tensor"
_SPEC = f"{_D}.tensor._dtensor_spec"
_PLACEMENTS = f"{_D}.tensor.placement_types"
_MESH = f"{_D}.device_mesh"
_LAYOUT = f"{_D}._mesh_layout"
# Where torch <= 2.4 defined these classes; a file saved then names them so.
_OLD_API = (f"{_D}._tensor", f"{_D}._tensor.api", f"{_D}.tensor._api")
_OLD_PLACEMENTS = f"{_D}._tensor.placement_types"


@dataclass(frozen=True, slots=True)
class Placement:
    """How one mesh dimension places the tensor: ``shard`` (``dim``), ``strided_shard`` (``dim``,
    ``split_factor``: FSDP2 sharding a tensor-parallel shard), ``replicate`` or ``partial`` (``reduce_op``)."""

    kind: str
    dim: int | None = None
    split_factor: int | None = None
    reduce_op: str | None = None

    def __str__(self) -> str:
        return {"shard": f"Shard({self.dim})", "strided_shard": f"_StridedShard({self.dim}, sf={self.split_factor})",
                "replicate": "Replicate()", "partial": f"Partial({self.reduce_op})"}[self.kind]


@dataclass(frozen=True, slots=True)
class MeshData:
    """A DeviceMesh as one rank pickled it: its shape, the rank's coordinate in it, the dimension names."""

    shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    dim_names: tuple[str, ...] | None

    def describe(self) -> str:
        names = self.dim_names or tuple(f"dim{i}" for i in range(len(self.shape)))
        return " x ".join(f"{n}={s}" for n, s in zip(names, self.shape, strict=True))


@dataclass(frozen=True, slots=True)
class DTensorData:
    """A DTensor as one rank saved it: the global picture and this rank's local tensor."""

    dtype: DType
    shape: tuple[int, ...]
    """The global shape."""
    local: TensorRef
    mesh: MeshData
    placements: tuple[Placement, ...]

    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)`` of the global tensor this rank's local tensor holds."""
        return local_box(self.shape, self.mesh.shape, self.mesh.coordinate, self.placements)


# --------------------------------------------------------------------------------------------------------
# Geometry


def _apply_order(placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]) -> Iterator[int]:
    """Mesh dims in the order their splits apply: left to right, except that a ``_StridedShard(d)`` waits
    for the next ``Shard(d)`` and applies right after it (the last one deferred first). That is how FSDP2
    shards a tensor-parallel shard: the chunk of a chunk (torch 2.8's ``_explicit_order_placements``)."""
    deferred: dict[int, list[int]] = {}
    for m, p in enumerate(placements):
        if p.kind == "strided_shard":
            assert p.dim is not None
            later = [j for j in range(m + 1, len(placements))
                     if placements[j].kind == "shard" and placements[j].dim == p.dim]
            if p.split_factor != math.prod(mesh_shape[j] for j in later):
                raise FormatError(f"_StridedShard({p.dim}) on mesh dim {m} has split factor {p.split_factor}, but the "
                                  f"later mesh dims sharding tensor dim {p.dim} number "
                                  f"{math.prod(mesh_shape[j] for j in later)} ranks")
            deferred.setdefault(p.dim, []).append(m)
            continue
        yield m
        if p.kind == "shard" and p.dim in deferred:
            yield from reversed(deferred.pop(p.dim))
    if deferred:
        raise FormatError(f"placements {[str(p) for p in placements]}: a _StridedShard has no later Shard of the same "
                          "tensor dim")


def local_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
              placements: tuple[Placement, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the box of a tensor of ``shape`` that ``coordinate`` of the mesh holds.

    Each ``Shard(d)`` chunks the extent of dim ``d`` left so far as ``torch.chunk`` does (``ceil(n/k)`` per
    coordinate, the last ones shorter or empty) and moves the offset along; ``Replicate`` leaves it whole.
    ``Partial`` holds addends of a pending sum, not a piece of the tensor, and is refused.
    """
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise FormatError(f"{len(placements)} placements and coordinate {list(coordinate)} for a mesh of shape "
                          f"{list(mesh_shape)}")
    offsets, sizes = [0] * len(shape), list(shape)
    for m in _apply_order(placements, mesh_shape):
        p = placements[m]
        if p.kind == "replicate":
            continue
        if p.kind == "partial":
            raise FormatError(f"placement {p} on mesh dim {m}: each rank holds an addend of a pending "
                              "reduction, not a piece of the tensor; a checkpoint must hold Shard or Replicate")
        assert p.dim is not None
        d = p.dim + len(shape) if p.dim < 0 else p.dim
        if not 0 <= d < len(shape):
            raise FormatError(f"placement {p} on a tensor of shape {list(shape)}")
        n, k, c = sizes[d], mesh_shape[m], coordinate[m]
        step = -(-n // k)
        lo, hi = min(n, c * step), min(n, (c + 1) * step)
        offsets[d] += lo
        sizes[d] = hi - lo
    return tuple(offsets), tuple(sizes)


# --------------------------------------------------------------------------------------------------------
# Reading


class _NamedTupleRecord(Record):
    """Stand-in for a NamedTuple (``TensorMeta``, ``ShardOrderEntry``): NEWOBJ passes its fields as arguments."""

    args: tuple

    def __new__(cls, *args: Any) -> _NamedTupleRecord:
        obj = super().__new__(cls)
        obj.args = args
        return obj


def _named_tuple(module: str, name: str) -> type[_NamedTupleRecord]:
    return type(name, (_NamedTupleRecord,), {"_pickle_name": ref(module, name)})


_DTENSOR = Tag(f"{_API}.DTensor")
_TENSOR_META, _SHARD_ORDER = _named_tuple(_SPEC, "TensorMeta"), _named_tuple(_SPEC, "ShardOrderEntry")
_PLACEMENT_NAMES = ("Shard", "_StridedShard", "Replicate", "Partial", "_Partial")


def dtensor_globals(where: str) -> dict[tuple[str, str], Any]:
    """Extra allow-list entries for :func:`~ckptkit.codecs.torchzip_read.read_archive`: DTensors become
    :class:`DTensorData`; other tensor subclasses are refused, naming ``where``."""

    placements = {(m, n): record_class(_PLACEMENTS, n) for m in (_PLACEMENTS, _OLD_PLACEMENTS)
                  for n in _PLACEMENT_NAMES}
    return {
        ("torch._tensor", "_rebuild_from_type_v2"): subclass_rebuild(where, _DTENSOR, _dtensor),
        ("torch._utils", "_rebuild_wrapper_subclass"): WRAPPER_SUBCLASS,
        **{(m, "DTensor"): _DTENSOR for m in (_API, *_OLD_API)},
        **{(m, "DTensorSpec"): record_class(_SPEC, "DTensorSpec") for m in (_SPEC, _OLD_PLACEMENTS)},
        **{(m, "TensorMeta"): _TENSOR_META for m in (_SPEC, _OLD_PLACEMENTS)},
        (_SPEC, "ShardOrderEntry"): _SHARD_ORDER,
        **placements,
        **allow_records(_MESH, "DeviceMesh"),
        **allow_records(_LAYOUT, "_MeshLayout", "_FlatLayout"),
    }


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if isinstance(v, Call):  # torch.Size((...))
        v = v.args[0] if v.args else ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in v):
        raise ValueError(f"{what} should be a tuple of ints, found {v!r}")
    return tuple(v)


def _int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{what} should be an int, found {v!r}")
    return v


def _slots(state: Any) -> dict:
    """DTensor's ``__slots__`` state: ``(None or attribute dict, {slot: value})`` (the attribute dict is ``{}``
    from torch's own fallback on Python 3.10)."""
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        return {**(state[0] or {}), **state[1]}
    if isinstance(state, dict):
        return state
    raise ValueError(f"DTensor state should be (dict, slots), found {type(state).__name__}")


_STRIDED = Call(ref("torch.serialization", "_get_layout"), ("torch.strided",))


def _dtensor(args: tuple, state: Any) -> DTensorData:
    cls, dtype, shape, layout = args[0], args[1], _ints(args[2], "global size"), args[5]
    if cls is not _DTENSOR:
        raise ValueError(f"the wrapper's class should be DTensor, found {cls!r}")
    if not isinstance(dtype, DType):
        raise ValueError(f"dtype should be a torch dtype, found {dtype!r}")
    if layout != _STRIDED:  # a sparse DTensor's local tensor is no dense box
        raise ValueError(f"layout should be torch.strided, found {layout!r}")
    slots = _slots(state)
    local, spec = slots["_local_tensor"], slots["_spec"]
    if not isinstance(local, TensorRef):
        raise ValueError(f"_local_tensor should be a plain tensor, found {type(local).__name__}")
    if local.dtype != dtype or len(local.shape) != len(shape):
        raise ValueError(f"local tensor {local.dtype} {list(local.shape)} for a {dtype} DTensor of shape {list(shape)}")
    if not isinstance(spec, record_class(_SPEC, "DTensorSpec")):
        raise ValueError(f"_spec should be a DTensorSpec, found {type(spec).__name__}")
    fields = vars(spec)
    mesh = _mesh(fields["mesh"])
    if not isinstance(fields["placements"], (tuple, list)):
        raise ValueError(f"placements should be a tuple, found {fields['placements']!r}")
    placements = tuple(_placement(p) for p in fields["placements"])
    if len(placements) != len(mesh.shape):
        raise ValueError(f"{len(placements)} placements on a mesh of shape {list(mesh.shape)}")
    meta = fields.get("tensor_meta")
    if meta is not None:
        if not isinstance(meta, _TENSOR_META) or len(meta.args) != 3:
            raise ValueError(f"tensor_meta should be a TensorMeta(shape, stride, dtype), found {meta!r}")
        if _ints(meta.args[0], "tensor_meta shape") != shape or meta.args[2] != dtype:
            raise ValueError(f"tensor_meta says {meta.args[2]} {list(_ints(meta.args[0], 'shape'))}, the DTensor "
                             f"{dtype} {list(shape)}")
    _check_shard_order(fields.get("shard_order"), placements)
    return DTensorData(dtype, shape, local, mesh, placements)


def _placement(p: Any) -> Placement:
    name = p._pickle_name.name if isinstance(p, Record) else None
    if name == "Shard":
        return Placement("shard", dim=_int(p.dim, "Shard.dim"))
    if name == "_StridedShard":
        return Placement("strided_shard", dim=_int(p.dim, "_StridedShard.dim"),
                         split_factor=_int(p.split_factor, "_StridedShard.split_factor"))
    if name == "Replicate":
        return Placement("replicate")
    if name in ("Partial", "_Partial"):
        return Placement("partial", reduce_op=str(getattr(p, "reduce_op", "sum")))
    raise ValueError(f"unknown placement {p!r}")


def _check_shard_order(order: Any, placements: tuple[Placement, ...]) -> None:
    """torch >= 2.10 records which mesh dims shard each tensor dim, in order. Every known writer keeps the
    default (ascending mesh dims); another order would need other geometry, so it is refused."""
    if not order:
        return
    default: dict[int, tuple[int, ...]] = {}
    for m, p in enumerate(placements):
        if p.kind in ("shard", "strided_shard"):
            assert p.dim is not None
            default[p.dim] = (*default.get(p.dim, ()), m)
    got = {}
    for entry in order:
        if not isinstance(entry, _SHARD_ORDER) or len(entry.args) != 2:
            raise ValueError(f"shard_order should hold ShardOrderEntry(tensor_dim, mesh_dims), found {entry!r}")
        got[_int(entry.args[0], "tensor_dim")] = _ints(entry.args[1], "mesh_dims")
    if got != default:
        raise ValueError(f"shard_order {got} is not the default order {default} of placements "
                         f"{[str(p) for p in placements]}; ckptkit reads the default order only")


def _mesh(m: Any) -> MeshData:
    if not isinstance(m, record_class(_MESH, "DeviceMesh")):
        raise ValueError(f"mesh should be a DeviceMesh, found {type(m).__name__}")
    state = m.__dict__
    if "_layout" in state:  # torch >= 2.10: a layout; 2.13+ keeps one _FlatLayout per mesh dim under "axes"
        layout = state["_layout"].__dict__
        if "axes" in layout:
            shape = tuple(math.prod(_nested_ints(a.shape)) for a in layout["axes"])
        else:
            top = layout["shape"] if isinstance(layout["shape"], tuple) else (layout["shape"],)
            shape = tuple(math.prod(_nested_ints(e)) for e in top)
        names = state.get("_mesh_dim_names")
    elif isinstance(state.get("mesh"), TensorRef):  # torch 2.8, 2.9: the rank tensor, shaped as the mesh
        shape, names = state["mesh"].shape, state.get("mesh_dim_names")
    else:
        raise ValueError(f"DeviceMesh state has neither _layout nor mesh (keys {sorted(state)})")
    coordinate = state.get("_coordinate_on_dim")
    if coordinate is None:
        raise ValueError("the saving rank is not in the DTensor's mesh (no coordinate)")
    coordinate = _ints(coordinate, "_coordinate_on_dim")
    if len(coordinate) != len(shape) or not all(0 <= c < s for c, s in zip(coordinate, shape, strict=True)):
        raise ValueError(f"coordinate {list(coordinate)} is outside the mesh of shape {list(shape)}")
    if names is not None and (not isinstance(names, (tuple, list)) or len(names) != len(shape)
                              or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"mesh dim names {names!r} for a mesh of shape {list(shape)}")
    return MeshData(tuple(shape), coordinate, tuple(names) if names is not None else None)


def _nested_ints(v: Any) -> list[int]:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return [v]
    if isinstance(v, (tuple, list)):
        return [n for e in v for n in _nested_ints(e)]
    raise ValueError(f"mesh layout size should be ints, found {v!r}")

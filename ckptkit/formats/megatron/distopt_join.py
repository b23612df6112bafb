"""Per-parameter optimizer state joined into megatron-core's ``DistributedOptimizer`` buckets
(``dp_reshardable``), the inverse of :mod:`.distopt`, so that megatron-core's own
``DistributedOptimizer`` load resumes a run converted with ``convert --to megatron``.

The layout is the one ``_ParamAndGradBuffer`` makes for one bucket (``overlap_grad_reduce`` off, megatron-core's
default, so ``bucket_size`` is None): the parameters in megatron-core's ``GPTModel`` order with the local spec,
reversed, each at a multiple of 64 elements. Each parameter's state is a byte range of its tensor: the
bucket's chunks point at the source's bytes. The padding between parameters holds whatever bytes the
largest chunk starts with, as megatron-core's own save writes ``torch.empty`` there; its loader skips them.
The ``param`` state (the fp32 main parameters) is the float32 weights themselves.
"""

from __future__ import annotations

import math
from typing import Any

from ...core.dtypes import by_name
from ...core.manifest import Chunk, ObjectEntry, Span, TensorEntry
from ...errors import FormatError
from ...io.sources import Files
from ..base import object_value, scalar_value
from .distopt import PREFIX, _listed, _module_order, _Param, aligned
from .groups import megatron_groups
from .torch_dist import COMMON

__all__ = ["join_buckets"]

_SLOTS = ("exp_avg", "exp_avg_sq")


def _run(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int | None:
    """The flat start of box ``(offsets, sizes)`` of a row-major ``shape`` where the box is one contiguous run;
    None where it is not."""
    k = next((d for d, n in enumerate(sizes) if n != 1), len(sizes))
    if tuple(sizes[k + 1:]) != tuple(shape[k + 1:]):
        return None
    flat = 0
    for d, o in enumerate(offsets):
        flat = flat * shape[d] + o
    return flat


def _pieces(t: TensorEntry, p: _Param, start: int) -> list[Chunk]:
    """``p``'s part of ``t`` (its layer of a layer-stacked tensor) as 1-D chunks of a bucket from ``start`` on."""
    if t.derived is not None or t.rows is not None:
        raise FormatError(f"tensor {t.key!r} is computed or row-permuted; a DistributedOptimizer bucket takes byte "
                          "ranges only")
    out = []
    for c in t.chunks:
        offsets, sizes = (c.offsets[1:], c.sizes[1:]) if p.layer is not None else (c.offsets, c.sizes)
        if p.layer is not None and c.offsets[0] != p.layer:
            continue
        if p.layer is not None and c.sizes[0] != 1 or c.strides is not None:
            raise FormatError(f"tensor {t.key!r}: a chunk spans layers or is strided; a bucket takes byte ranges")
        flat = _run(p.shape, offsets, sizes)
        if flat is None:
            raise FormatError(f"tensor {t.key!r}: chunk at {list(c.offsets)} is not one run of elements")
        out.append(Chunk((start + flat,), (math.prod(sizes),), c.span))
    return out


def _bucket(key: str, tensors: dict[str, TensorEntry], placed: list[tuple[_Param, int]], size: int) -> TensorEntry:
    """The 1-D bucket tensor ``key`` of ``size`` elements from each placed parameter's ``tensors`` entry."""
    chunks = [c for p, start in placed for c in _pieces(tensors[p.key], p, start)]
    chunks.sort(key=lambda c: c.offsets[0])
    dtype = next(iter(tensors.values())).dtype
    filler = max(chunks, key=lambda c: c.span.length).span
    at, out = 0, []
    for c in chunks:
        if c.offsets[0] > at:  # padding: megatron-core saves and loads it as torch.empty, never read
            n = c.offsets[0] - at
            if n * dtype.itemsize > filler.length:
                raise FormatError(f"{key}: no chunk of {n} elements to fill the padding at {at} with")
            out.append(Chunk((at,), (n,), Span(filler.file, filler.offset, n * dtype.itemsize)))
        out.append(c)
        at = c.offsets[0] + c.sizes[0]
    entry = TensorEntry(key, (key,), dtype, (size,), tuple(out))
    entry.validate()
    return entry


def _per_parameter(numbered: dict[int, dict[str, Any]], flat: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each parameter's hyperparameters: its numbered group's (``params`` listing it), or its own where the groups
    are kept per parameter (torchtitan's layout)."""
    out = {name: dict(fields) for name, fields in flat.items()}
    for index, fields in sorted(numbered.items()):
        names = fields.get("params")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise FormatError(f"param group {index}: expected the names of its parameters, found {names!r:.60}")
        out.update({n: {k: v for k, v in fields.items() if k != "params"} for n in names})
    return out


def _parsed(state: tuple[TensorEntry | ObjectEntry, ...], section: str, params: list[_Param]
            ) -> tuple[dict[str, dict[str, TensorEntry]], dict[str, dict[str, Any]], set[Any]]:
    """The moments by slot and tensor, each parameter's hyperparameters, and the steps of ``state``."""
    moments: dict[str, dict[str, TensorEntry]] = {s: {} for s in _SLOTS}
    numbered: dict[int, dict[str, Any]] = {}
    flat: dict[str, dict[str, Any]] = {}
    known = {p.key for p in params}
    step_entries = []
    for e in state:
        rest = e.key[len(section) + 1:]
        if rest.startswith("state."):
            key, slot = rest[len("state."):].rsplit(".", 1)
            if slot in _SLOTS and isinstance(e, TensorEntry):
                moments[slot][key] = e
            elif slot == "step":
                step_entries.append(e)
            else:
                raise FormatError(f"{e.key}: megatron-core's DistributedOptimizer keeps exp_avg, exp_avg_sq and step")
        elif rest.startswith("param_groups.") and isinstance(e, ObjectEntry):
            head, field = rest[len("param_groups."):].rsplit(".", 1)
            if head.isdigit():
                numbered.setdefault(int(head), {})[field] = object_value(e)
            elif head in known:
                flat.setdefault(head, {})[field] = object_value(e)
            else:
                raise FormatError(f"{e.key}: a param group field of {head!r}, which is no parameter of the model")
    with Files() as files:
        values = [scalar_value(e, files) for e in step_entries]
    steps = {float(v) if isinstance(v, (int, float)) else str(v)[:40] for v in values}
    return moments, _per_parameter(numbered, flat), steps


def join_buckets(model: tuple[TensorEntry, ...], state: tuple[TensorEntry | ObjectEntry, ...], section: str
                 ) -> tuple[tuple[TensorEntry, ...], tuple[ObjectEntry, ...]]:
    """The buckets, their objects and ``common.pt``'s sharding type of the per-parameter optimizer state
    ``state`` (``<section>.state.<tensor>.<slot>``, and ``<section>.param_groups.<i>.<field>`` or, kept per
    parameter as torchtitan keeps them, ``<section>.param_groups.<tensor>.<field>``, under megatron-core's
    names) of ``model`` (megatron-core's names and shapes).

    Args:
        model: The model's tensors as written.
        state: The optimizer's entries, carried to megatron-core's names.
        section: Their top-level name.

    Returns:
        The bucket tensors and the objects megatron-core's ``dp_reshardable`` load reads.

    Raises:
        FormatError: a model outside megatron-core's GPTModel tables, weights other than float32, state other than
            Adam's, or hyperparameters megatron-core's grouping cannot hold (:func:`.groups.megatron_groups`).
    """
    params = _module_order(_listed(list(model)))
    if params is None:
        raise FormatError("convert --to megatron with optimizer state: the model's tensors are not all in "
                          "megatron-core's GPTModel tables (local spec), which give the buckets' parameter order")
    weights = {t.key: t for t in model}
    if {t.dtype.name for t in model} != {"float32"}:
        raise FormatError("convert --to megatron with optimizer state: the weights are not all float32, and the "
                          "DistributedOptimizer's fp32 main parameters are taken from them")
    moments, fields, steps = _parsed(state, section, params)
    undecayed = {p.key for p in params if p.undecayed}
    saved_groups = megatron_groups(fields, list(dict.fromkeys(p.key for p in params)), undecayed.__contains__)
    lacking = [p.key for p in params for s in _SLOTS if p.key not in moments[s]]
    if lacking or len(steps) != 1 or not all(isinstance(v, float) for v in steps):
        raise FormatError(f"convert --to megatron: optimizer state for {', '.join(lacking[:3]) or 'every tensor'} "
                          f"(exp_avg, exp_avg_sq and one numeric step) is not all there "
                          f"(steps {sorted(map(str, steps))})")
    step = float(steps.pop())
    placed, at = [], 0
    for p in reversed(params):
        at = aligned(at)
        placed.append((p, at))
        at += p.numel
    name = f"{PREFIX}dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0"
    tensors = (_bucket(f"{name}.param", weights, placed, at),
               *(_bucket(f"{name}.{s}", moments[s], placed, at) for s in _SLOTS))
    f32 = by_name("float32")
    numel = {(f32, f32): [at]}
    padded = {(f32, f32): [-(-at // 128) * 128]}  # megatron-core checks the unpadded sizes only
    objects = tuple(ObjectEntry(f"{PREFIX}dp_group_idx_0.{k}/shard_0_1", (f"{PREFIX}dp_group_idx_0.{k}/shard_0_1",), v)
                    for k, v in (("optimizer", [{"param_groups": [{**g, "step": step} for g in saved_groups]}]),
                                 ("per_bucket_numel", [[padded]]), ("per_bucket_numel_unpadded", [[numel]])))
    sharding = ObjectEntry("optimizer.param_state_sharding_type", ("optimizer", "param_state_sharding_type"),
                           "dp_reshardable", sidecar=COMMON)
    return tensors, (*objects, sharding)


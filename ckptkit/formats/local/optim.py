"""FSDP1's per-rank ``optimizer.state_dict()`` as state per original parameter, keyed by its name.

A wrapped model's optimizer numbers what it optimizes: each flat parameter, or with ``use_orig_params``
each original parameter (:attr:`FlatLayout.slots`). Its ``state`` is keyed by those indices and its
``param_groups`` list them. Read into a manifest, the state is keyed by parameter name, as
``FSDP.optim_state_dict`` names it under ``FULL_STATE_DICT``, and the groups list names; the writer
(:mod:`.write`) numbers them again for the layout it writes.

Sharded ranks each hold their slice of every state shaped like the parameter; NO_SHARD ranks hold it whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...core.manifest import Chunk, ObjectEntry, Path_, Span, TensorEntry, TensorRef, key_of
from ...errors import FormatError
from .layout import FlatLayout, FlatParam, param_entry

__all__ = ["below", "fits", "is_flat_optim", "read_replicated_optim", "read_sharded_optim"]

def below(leaves: dict, prefix: Path_) -> dict[Any, dict[Path_, Any]]:
    """The leaves under ``prefix``, grouped by the path element right below it: ``{k: {rest of path: leaf}}``."""
    out: dict = {}
    n = len(prefix)
    for path, leaf in leaves.items():
        if path[:n] == prefix and len(path) > n:
            out.setdefault(path[n], {})[path[n + 1:]] = leaf
    return out


def is_flat_optim(leaves: dict, top: Path_) -> bool:
    """An ``optimizer.state_dict()``: ``state`` keyed by int parameter indices, ``param_groups`` listing them."""
    groups = below(leaves, (*top, "param_groups"))
    return (bool(groups) and all(isinstance(k, int) for k in below(leaves, (*top, "state")))
            and all(isinstance(g.get(("params",)), list) and all(isinstance(i, int) for i in g[("params",)])
                    for g in groups.values()))


def fits(layout: FlatLayout, state: dict[Any, dict[Path_, Any]]) -> bool:
    """Whether whole (NO_SHARD) optimizer ``state`` ({index: {name: leaf}}) has the shapes ``layout`` gives
    its indices: an original parameter's shape, or a flat parameter's unpadded length."""
    for i, per in state.items():
        if not 0 <= i < len(layout.slots):
            return False
        params = layout.slot_params(i)
        want = params[0].shape if layout.use_orig_params else (params[-1].end,)
        if any(isinstance(v, TensorRef) and v.shape and v.shape != want for v in per.values()):
            return False
    return True


def _groups_and_rest(top: Path_, leaves: dict, layout: FlatLayout, file: Path,
                     tensors: list[TensorEntry], objects: list[ObjectEntry]) -> None:
    """``param_groups`` with parameter names for indices, and every entry beside ``state`` and the groups."""
    for gi, group in below(leaves, (*top, "param_groups")).items():
        for sub, value in group.items():
            if sub == ("params",):
                if not all(0 <= i < len(layout.slots) for i in value):
                    what = "parameters" if layout.use_orig_params else "flat parameters"
                    raise FormatError(f"{file}: {key_of(top)!r} param_groups name parameter indices {value}, but the "
                                      f"layout has {len(layout.slots)} {what}")
                value = layout.names_of(value)
            path = (*top, "param_groups", gi, *sub)
            objects.append(ObjectEntry(key_of(path), path, value))
    for path, leaf in leaves.items():
        if path[:1] != top or path[1:2] in (("state",), ("param_groups",)):
            continue
        if isinstance(leaf, TensorRef):
            tensors.append(leaf.as_entry(path))
        else:
            objects.append(ObjectEntry(key_of(path), path, leaf))


def read_replicated_optim(top: Path_, leaves: dict, layout: FlatLayout, file: Path,
                          tensors: list[TensorEntry], objects: list[ObjectEntry]) -> None:
    """A NO_SHARD ``optimizer.state_dict()``.

    With use_orig_params the state is already per original parameter, by index; without, each flat
    parameter's state is one vector over the whole (unsharded, unpadded) flat parameter, cut here at each
    parameter's offset.
    """
    state = below(leaves, (*top, "state"))
    if not fits(layout, state):
        what = "parameters" if layout.use_orig_params else "flat parameters"
        raise FormatError(f"{file}: optimizer state {key_of(top)!r} does not fit the flat layout "
                          f"({len(layout.slots)} {what})")
    for i, per in state.items():
        for p in layout.slot_params(i):
            for name, v in per.items():
                path = (*top, "state", p.fqn, *name)
                if not isinstance(v, TensorRef):
                    objects.append(ObjectEntry(key_of(path), path, v))
                elif layout.use_orig_params or not v.shape:  # whole tensors: per-parameter state, or a step counter
                    tensors.append(v.as_entry(path))
                else:
                    span = Span(v.span.file, v.span.offset + p.offset * v.dtype.itemsize, p.numel * v.dtype.itemsize)
                    tensors.append(TensorEntry(key_of(path), path, v.dtype, p.shape,
                                               (Chunk((0,) * len(p.shape), p.shape, span),)))
    _groups_and_rest(top, leaves, layout, file, tensors, objects)


def read_sharded_optim(top: Path_, ranks: list[dict], files: list[Path], layout: FlatLayout, world: int,
                       tensors: list[TensorEntry], objects: list[ObjectEntry]) -> None:
    """Each sharded rank's ``optimizer.state_dict()``: a rank's state is its whole flat slice, padded to the
    chunk size, or with use_orig_params just its part of each parameter."""
    uop = layout.use_orig_params
    state = [below(leaves, (*top, "state")) for leaves in ranks]
    for i in range(len(layout.slots)):
        per_rank = [s.get(i, {}) for s in state]
        names = list(dict.fromkeys(n for s in per_rank for n in s))
        unit = layout.slot_unit(i)
        ranges = layout.shard_ranges(unit, world)
        for p in layout.slot_params(i):
            for name in names:
                values = [s.get(name) for s in per_rank]
                path = (*top, "state", p.fqn, *name)
                first = next(v for v in values if v is not None)
                if not (isinstance(first, TensorRef) and first.shape):  # step counters: the same on every rank
                    if isinstance(first, TensorRef):
                        tensors.append(first.as_entry(path))
                    else:
                        objects.append(ObjectEntry(key_of(path), path, first))
                    continue
                _check_slices(p, name, values, first, ranges, uop, files)

                def locate(r: int, start: int, p: FlatParam = p, values: list = values,
                           ranges: tuple[tuple[int, int], ...] = ranges, first: TensorRef = first) -> tuple[str, int]:
                    span = values[r].span
                    skip = 0 if uop else p.offset + start - ranges[r][0]
                    return span.file, span.offset + skip * first.dtype.itemsize

                tensors.append(param_entry(path, p, first.dtype, ranges, locate))
    _groups_and_rest(top, ranks[0], layout, files[0], tensors, objects)


def _check_slices(p: FlatParam, name: Path_, values: list[Any], first: TensorRef,
                  ranges: tuple[tuple[int, int], ...], uop: bool, files: list[Path]) -> None:
    for r, (lo, hi) in enumerate(ranges):
        a, b = max(lo, p.offset), min(hi, p.end)
        if a >= b:
            continue
        t = values[r]
        need = (b - a) if uop else hi - lo
        if (not isinstance(t, TensorRef) or t.dtype != first.dtype or len(t.shape) != 1 or t.strides is not None
                or t.shape[0] < need or (uop and t.shape[0] != need) or t.span.length < need * t.dtype.itemsize):
            found = f"{t.dtype} {list(t.shape)}" if isinstance(t, TensorRef) else type(t).__name__
            raise FormatError(f"{files[r]}: optimizer state {key_of(name)!r} of {p.fqn!r} is {found}; "
                              f"expected a 1-D {first.dtype} tensor of {need}{'' if uop else ' or more'} elements")

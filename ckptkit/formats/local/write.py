"""Writing LOCAL: each rank's ``LOCAL_STATE_DICT`` (and flattened optimizer state) from a manifest's tensors.

A rank's flat parameter is a run of :class:`Region` pieces of the original parameters with zeros for the
padding (:class:`PartsTensor`), pickled as the ShardedTensor FSDP1 saves; with ``use_orig_params`` each
original parameter's view of the rank's part follows it. An optimizer keyed by parameter name is numbered
again by the layout's slots and sliced the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...codecs.sharded_tensor import ShardBox, sharded_tensor
from ...codecs.torchzip_write import PartsTensor
from ...core.boxes import range_boxes
from ...core.dtypes import DType
from ...core.manifest import Manifest, ObjectEntry, Path_, TensorEntry
from ...core.plan import Bytes, Part, Region
from ...core.tree import unflatten
from ...errors import FormatError
from ..base import cast_for, object_value, regions_in
from .layout import FlatLayout, FlatParam, FlatUnit

__all__ = ["RankWriter"]


def _zeros(n: int, dtype: DType) -> list[Part]:
    return [Bytes(bytes(n * dtype.itemsize))] if n > 0 else []


class RankWriter:
    """Each rank's LOCAL state: flat slices (and, with use_orig_params, views) from the manifest's tensors."""

    def __init__(self, manifest: Manifest, layout: FlatLayout, world: int, cast: DType | None) -> None:
        self.manifest, self.layout, self.world, self.cast = manifest, layout, world, cast
        self.ranges = {u.key: layout.shard_ranges(u, world) for u in layout.units}
        self.names = [p.fqn for u in layout.units for p in u.params]
        self.alias = {a: fqn for u in layout.units for a, fqn in u.shared}
        self.parent = self._model_parent()
        by_path = {t.path: t for t in manifest.tensors}
        self.params = {fqn: by_path[self.parent + (fqn,)] for fqn in self.names}
        self.dtypes = {}
        for u in layout.units:
            for p in u.params:
                t = self.params[p.fqn]
                if t.shape != p.shape:
                    raise FormatError(f"{manifest.root}: {t.key!r} has shape {list(t.shape)}; the flat layout says "
                                      f"{list(p.shape)} (was the layout made for another model?)")
            found = {self.params[p.fqn].dtype for p in u.params}
            if len(found) != 1:
                raise FormatError(f"{manifest.root}: the parameters of FSDP unit {u.key!r} mix dtypes "
                                  f"{sorted(d.name for d in found)}; a flat parameter has one dtype")
            dtype = found.pop()
            self.dtypes[u.key] = cast_for(dtype, cast) or dtype
        self.optims = {o.path[:1] for o in manifest.objects if self._is_named_optim(o)}

    def _model_parent(self) -> Path_:
        """The path of the dict holding the model's parameters: () for a model state dict, ("model",) when
        nested. Every layout parameter must be there."""
        paths = {t.path for t in self.manifest.tensors}
        parents = {p[:-1] for p in paths if isinstance(p[-1], str) and self.layout.holds(p[-1])}
        for parent in sorted(parents, key=len):
            if all((*parent, n) in paths for n in self.names):
                return parent
        have = [t.key for t in self.manifest.tensors[:4]]
        raise FormatError(f"{self.manifest.root}: no tensor for the flat layout's parameter "
                          f"{self.names[0]!r}{' and others' if len(self.names) > 1 else ''} (the checkpoint has "
                          f"{have}...); the layout must be the one of this model, keyed as its state dict is")

    def _is_named_optim(self, o: ObjectEntry) -> bool:
        """``param_groups`` of an optimizer state keyed by parameter name (FSDP's full optim state dict)."""
        p = o.path
        if not (len(p) == 4 and p[:1] != self.parent[:1] and p[1] == "param_groups" and p[3] == "params"):
            return False
        names = object_value(o)
        return isinstance(names, list) and all(isinstance(n, str) and self.layout.holds(n) for n in names)

    def _parts(self, unit: FlatUnit, lo: int, hi: int, entry_of: Callable[[FlatParam], TensorEntry],
               dtype: DType) -> list[Part]:
        """The bytes of flat elements ``[lo, hi)`` in ``dtype``: pieces of the parameters' tensors (or of
        their optimizer states), zeros for padding."""
        parts, at = [], lo
        for p in unit.params:
            a, b = max(lo, p.offset), min(hi, p.end)
            if a >= b:
                continue
            parts += _zeros(a - at, dtype)  # use_orig_params alignment padding
            t = entry_of(p)
            parts += [Region(t, offsets, sizes, cast_for(t.dtype, self.cast))
                      for offsets, sizes in range_boxes(p.shape, a - p.offset, b - p.offset)]
            at = b
        return parts + _zeros(hi - at, dtype)  # world-size padding at the end

    def _view(self, fqn: str, rank: int, entry_of: Callable[[FlatParam], TensorEntry], dtype: DType) -> PartsTensor:
        """This rank's part of a parameter (use_orig_params), flattened."""
        unit, p = self.layout.owner(fqn)
        lo, hi = self.ranges[unit.key][rank]
        a, b = max(lo, p.offset), min(hi, p.end)
        return PartsTensor(dtype, tuple(self._parts(unit, a, b, entry_of, dtype)) if a < b else ())

    def rank_tree(self, rank: int) -> Any:
        """What FSDP1 rank ``rank`` saves: the model state with each unit's flat parameter where its first
        parameter was, the other entries as they are, and the optimizer state flattened."""
        items: list[tuple[Path_, Any]] = []
        placed: set[str] = set()
        for t in self.manifest.tensors:
            name = t.path[-1]
            if t.path[:1] in self.optims:
                continue
            if t.path[:-1] == self.parent and (self.layout.holds(name) or name in self.alias):
                unit = self.layout.owner(self.alias.get(name, name))[0]
                if unit.key not in placed:
                    placed.add(unit.key)
                    items += self._unit_items(unit, rank)
            else:
                items.append((t.path, Region.whole(t, cast_for(t.dtype, self.cast))))
        for o in self.manifest.objects:
            if o.path[:1] not in self.optims:
                items.append((o.path, regions_in(object_value(o), self.cast)))
        for top in sorted(self.optims):
            items.append((top, self._optimizer(top, rank)))
        return unflatten(items)

    def _unit_items(self, unit: FlatUnit, rank: int) -> list[tuple[Path_, Any]]:
        """The flat parameter, and with use_orig_params every parameter's view of its part (tied ones too),
        which is what FSDP1 loads in that mode."""
        items = [((*self.parent, unit.key), self._flat(unit, rank))]
        if self.layout.use_orig_params:
            dtype, param_of = self.dtypes[unit.key], (lambda p: self.params[p.fqn])
            names = [(p.fqn, p.fqn) for p in unit.params] + list(unit.shared)
            items += [((*self.parent, name), self._view(fqn, rank, param_of, dtype)) for name, fqn in names]
        return items

    def _flat(self, unit: FlatUnit, rank: int) -> Any:
        ranges, dtype = self.ranges[unit.key], self.dtypes[unit.key]
        shards = tuple(ShardBox((lo,), (hi - lo,), r) for r, (lo, hi) in enumerate(ranges) if hi > lo)
        lo, hi = ranges[rank]
        parts = self._parts(unit, lo, hi, lambda p: self.params[p.fqn], dtype)
        local = [(ShardBox((lo,), (hi - lo,), rank), PartsTensor(dtype, tuple(parts)))] if hi > lo else []
        return sharded_tensor(dtype, (self.layout.total(unit, self.world),), shards, local, rank=rank,
                              world_size=self.world, requires_grad=True)

    def _optimizer(self, top: Path_, rank: int) -> dict:
        """``optimizer.state_dict()`` of this rank: state keyed by flat-parameter index (by parameter index
        with use_orig_params), holding this rank's slice."""
        layout = self.layout
        by_param = self._named_state(top)
        state: dict[int, Any] = {}
        if layout.use_orig_params:
            for i, fqn in enumerate(layout.param_order):
                unit, p = self.layout.owner(fqn)
                lo, hi = self.ranges[unit.key][rank]
                if fqn in by_param and max(lo, p.offset) < min(hi, p.end):  # torch keeps no state for empty parts

                    def view(name: Path_, dtype: DType, fqn: str = fqn) -> PartsTensor:
                        return self._view(fqn, rank, lambda q: self._state_tensor(by_param[q.fqn], name), dtype)

                    state[i] = self._state_of(by_param[fqn], view)
        else:
            for i, unit in enumerate(layout.units):
                have = [p.fqn for p in unit.params if p.fqn in by_param]
                if not have:
                    continue
                if len(have) != len(unit.params):
                    missing = [p.fqn for p in unit.params if p.fqn not in by_param]
                    raise FormatError(f"{self.manifest.root}: optimizer state has no entry for {missing[:3]}, "
                                      f"which share flat parameter {unit.key!r} with parameters that have one")
                lo, hi = self.ranges[unit.key][rank]
                # torch's per-rank flat state is the padded chunk: every rank holds ``step`` elements.
                step = -(-layout.total(unit, self.world) // self.world)

                def flat(name: Path_, dtype: DType, unit: FlatUnit = unit, lo: int = lo, hi: int = hi,
                         step: int = step) -> PartsTensor:
                    parts = self._parts(unit, lo, hi, lambda q: self._state_tensor(by_param[q.fqn], name), dtype)
                    return PartsTensor(dtype, tuple(parts + _zeros(step - (hi - lo), dtype)))

                state[i] = self._state_of(by_param[have[0]], flat)
        groups: dict[int, list[tuple[Path_, Any]]] = {}
        rest: list[tuple[Path_, Any]] = []
        for o in self.manifest.objects:
            if o.path[:2] == (*top, "param_groups"):
                value = object_value(o)
                if o.path[3:] == ("params",):
                    value = layout.indices_of(value)
                groups.setdefault(o.path[2], []).append((o.path[3:], value))
            elif o.path[:1] == top and o.path[1:2] != ("state",):
                rest.append((o.path[1:], regions_in(object_value(o), self.cast)))
        out = {"state": state, "param_groups": [unflatten(groups[g]) for g in sorted(groups)]}
        out.update(unflatten(rest) if rest else {})
        return out

    def _named_state(self, top: Path_) -> dict[str, dict[Path_, TensorEntry | ObjectEntry]]:
        """The optimizer state under ``top``, per parameter name, checked against the layout."""
        by_param: dict[str, dict[Path_, TensorEntry | ObjectEntry]] = {}
        for e in self.manifest.entries:
            if e.path[:2] != (*top, "state") or len(e.path) < 4:
                continue
            fqn = e.path[2]
            if not self.layout.holds(fqn):
                raise FormatError(f"{self.manifest.root}: optimizer state {e.key!r} is for {fqn!r}, which the flat "
                                  "layout does not hold")
            shape = self.layout.owner(fqn)[1].shape
            if isinstance(e, TensorEntry) and e.shape and e.shape != shape:
                raise FormatError(f"{self.manifest.root}: optimizer state {e.key!r} has shape {list(e.shape)}, its "
                                  f"parameter {list(shape)}; only states shaped like the parameter can be sharded")
            by_param.setdefault(fqn, {})[e.path[3:]] = e
        return by_param

    def _state_tensor(self, states: dict[Path_, TensorEntry | ObjectEntry], name: Path_) -> TensorEntry:
        """State ``name`` of one parameter of a flat parameter, whose first parameter has a tensor there."""
        e = states[name]
        if not isinstance(e, TensorEntry):
            raise FormatError(f"{self.manifest.root}: optimizer state {e.key!r} is not a tensor, though other "
                              "parameters of its flat parameter have a tensor there")
        return e

    def _state_of(self, entries: dict[Path_, Any], sliced: Callable[[Path_, DType], PartsTensor]) -> dict:
        """One slot's state: tensors shaped like the parameter are sliced, step counters copied."""
        out: list[tuple[Path_, Any]] = []
        for name, e in entries.items():
            if isinstance(e, TensorEntry) and e.shape:
                out.append((name, sliced(name, cast_for(e.dtype, self.cast) or e.dtype)))
            elif isinstance(e, TensorEntry):
                out.append((name, Region.whole(e, cast_for(e.dtype, self.cast))))
            else:
                out.append((name, regions_in(object_value(e), self.cast)))
        return unflatten(out)

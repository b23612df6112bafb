"""FSDP1 flat parameters: which original parameters each FSDP unit's 1-D ``_flat_param`` holds, where they lie
in it, and which elements each rank keeps.

FSDP1 concatenates the parameters of each wrapped module (a *unit*) into one 1-D ``FlatParameter`` of
``total`` elements and gives rank r the elements ``[r*S, min((r+1)*S, total))`` with
``S = ceil(total / world_size)`` (``torch.chunk``); ranks past the end hold nothing. With
``use_orig_params=True`` it also inserts padding before each parameter so that every parameter starts on a
16-byte boundary, and pads the end to a multiple of the world size. A ``LOCAL_STATE_DICT`` file saves the
flat parameter with that end padding (so its size depends on the world size) but without the padding
``torch.chunk`` needs on the last ranks.

The padding rule, from torch 2.13's ``torch/distributed/fsdp/_flat_param.py``: ``FlatParamHandle.__init__``
aligns only when ``use_orig_params`` (``align_addresses = use_orig_params``), to
``_get_aligned_numel(unsharded_dtype=self._fwd_bwd_param_dtype)`` = ``16 // itemsize`` elements (4 in fp32,
8 in bf16 or fp16). ``_fwd_bwd_param_dtype`` is ``MixedPrecision.param_dtype`` if given, else the
parameters' dtype at wrap time (``_init_param_reduce_dtypes``): under mixed precision the saved flat
parameter stays float32 but its offsets follow the 2-byte alignment. ``_init_flat_param_and_metadata`` pads
before every parameter but the first to a multiple of that (tied aliases take no space), then, only when
aligning, the end to a multiple of the world size.

A :class:`FlatLayout` holds what does not depend on the world size: the units, the parameters in each and
their offsets. ckptkit writes it as ``flat_layout.json`` beside every LOCAL checkpoint; for one saved by FSDP
itself, :func:`derive_layout` reads it from the FlatParameters FSDP builds for the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...core.boxes import range_boxes
from ...core.dtypes import DTYPES, DType
from ...core.manifest import Chunk, Path_, Span, TensorEntry, key_of
from ...errors import FormatError

__all__ = ["FLAT_PARAM", "LAYOUT_FILE", "FlatLayout", "FlatParam", "FlatUnit", "param_entry", "pieces"]

FLAT_PARAM = "_flat_param"
LAYOUT_FILE = "flat_layout.json"
_FORMAT = "ckptkit.flat_layout"
_MAX_JSON = 64 << 20
_FLOATING = frozenset(d.name for d in DTYPES if d.is_floating)


@dataclass(frozen=True, slots=True)
class FlatParam:
    """An original parameter inside a flat parameter."""

    fqn: str
    """Its name in the unwrapped model's state dict, e.g. ``layers.0.attn.weight``."""
    shape: tuple[int, ...]
    offset: int
    """Index of its first element in the unit's flat parameter (after any alignment padding)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, slots=True)
class FlatUnit:
    """One FSDP unit: the flat parameter saved under ``key`` and the parameters it holds, in order."""

    key: str
    """State-dict key of the flat parameter, e.g. ``layers.0._flat_param`` (``_flat_param`` for the root)."""
    params: tuple[FlatParam, ...]
    shared: tuple[tuple[str, str], ...] = ()
    """``(alias, fqn)`` for parameters tied to one in ``params`` (``lm_head.weight`` tied to the embedding):
    FSDP stores them once; a full state dict holds them under both names."""

    def __post_init__(self) -> None:
        if not self.key.endswith(FLAT_PARAM) or not (self.key == FLAT_PARAM or self.key.endswith("." + FLAT_PARAM)):
            raise FormatError(f"flat parameter key {self.key!r} does not end in '{FLAT_PARAM}'")
        at = 0
        for p in self.params:
            if p.offset < at or any(d < 0 for d in p.shape):
                raise FormatError(f"unit {self.key!r}: parameter {p.fqn!r} at offset {p.offset} shape {list(p.shape)} "
                                  f"overlaps the one before it (which ends at {at})")
            at = p.end
        names = {p.fqn for p in self.params}
        for alias, fqn in self.shared:
            if fqn not in names or alias in names:
                raise FormatError(f"unit {self.key!r}: tied parameter {alias!r} -> {fqn!r} does not name one of "
                                  "its parameters")

    @property
    def end(self) -> int:
        """Elements up to the end of the last parameter: the flat size before any world-size padding."""
        return self.params[-1].end if self.params else 0


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Every FSDP unit of a model, independent of the world size."""

    units: tuple[FlatUnit, ...]
    """In the order ``model.parameters()`` yields the flat parameters (an optimizer's parameter indices)."""
    use_orig_params: bool
    """Whether FSDP aligned each parameter and padded the end to the world size (``use_orig_params=True``)."""
    param_order: tuple[str, ...] = ()
    """Original parameter names in ``model.parameters()`` order, which with ``use_orig_params=True`` are the
    indices of ``optimizer.state_dict()``; empty when unknown."""
    param_dtype: str | None = None
    """The dtype FSDP aligned the parameters in (``bfloat16`` under ``MixedPrecision(param_dtype=bfloat16)``),
    as torch names it; None when unknown (files of older ckptkit). The offsets already carry the alignment:
    it is a record of how the layout was made, and readers need not know it."""

    _units_by_key: dict[str, FlatUnit] = field(init=False, repr=False, compare=False)
    _owners: dict[str, tuple[FlatUnit, FlatParam]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_key: dict[str, FlatUnit] = {}
        owners: dict[str, tuple[FlatUnit, FlatParam]] = {}
        names: set[str] = set()
        for u in self.units:
            if u.key in by_key:
                raise FormatError(f"flat layout lists unit {u.key!r} twice")
            by_key[u.key] = u
            for name in [p.fqn for p in u.params] + [a for a, _ in u.shared]:
                if name in names:
                    raise FormatError(f"flat layout places parameter {name!r} in two units")
                names.add(name)
            owners.update((p.fqn, (u, p)) for p in u.params)
        missing = [n for n in self.param_order if n not in owners]
        if self.use_orig_params and missing:
            raise FormatError(f"flat layout's param_order names {missing[:3]}, which no unit holds")
        object.__setattr__(self, "_units_by_key", by_key)
        object.__setattr__(self, "_owners", owners)

    def unit(self, key: str) -> FlatUnit:
        return self._units_by_key[key]

    def owner(self, fqn: str) -> tuple[FlatUnit, FlatParam]:
        """The unit holding original parameter ``fqn``, and the parameter's place in it."""
        return self._owners[fqn]

    def holds(self, fqn: str) -> bool:
        return fqn in self._owners

    @property
    def slots(self) -> tuple[str, ...]:
        """What each index of a wrapped model's ``optimizer.state_dict()`` names: an original parameter with
        ``use_orig_params`` (in ``param_order``), else a flat parameter (its unit's key)."""
        return self.param_order if self.use_orig_params else tuple(u.key for u in self.units)

    def slot_params(self, index: int) -> tuple[FlatParam, ...]:
        """The original parameters optimizer index ``index`` covers: one, or every one of a flat parameter."""
        slot = self.slots[index]
        return (self.owner(slot)[1],) if self.use_orig_params else self.unit(slot).params

    def slot_unit(self, index: int) -> FlatUnit:
        slot = self.slots[index]
        return self.owner(slot)[0] if self.use_orig_params else self.unit(slot)

    def names_of(self, indices: list[int]) -> list[str]:
        """A param group's optimizer indices as the parameter names they cover."""
        return [p.fqn for i in indices for p in self.slot_params(i)]

    def indices_of(self, names: list[str]) -> list[int]:
        """Parameter names as the optimizer indices that hold them (a flat parameter's index once)."""
        index = {p.fqn: i for i in range(len(self.slots)) for p in self.slot_params(i)}
        return list(dict.fromkeys(index[n] for n in names))

    def total(self, unit: FlatUnit, world_size: int) -> int:
        """The flat parameter's size in a LOCAL file saved at ``world_size`` ranks (the ShardedTensor's size)."""
        return unit.end + ((-unit.end) % world_size if self.use_orig_params else 0)

    def shard_ranges(self, unit: FlatUnit, world_size: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of the flat elements each rank holds; ``start == stop`` for a rank with none."""
        total = self.total(unit, world_size)
        step = -(-total // world_size)
        return tuple((min(total, r * step), min(total, (r + 1) * step)) for r in range(world_size))

    def to_json(self) -> bytes:
        # One line per parameter: the file stays readable (and diffable) for models with thousands of them.
        units = ",\n".join(
            f'  {{"key": {json.dumps(u.key)}, "shared": {json.dumps([list(s) for s in u.shared])}, "params": [\n'
            + ",\n".join(f'    {json.dumps({"fqn": p.fqn, "shape": list(p.shape), "offset": p.offset})}'
                         for p in u.params)
            + "]}" for u in self.units)
        # param_dtype is optional and the version stays 1: a reader that ignores it still reads the offsets right.
        dtype = f' "param_dtype": {json.dumps(self.param_dtype)},\n' if self.param_dtype is not None else ""
        return (f'{{"format": "{_FORMAT}", "version": 1, "use_orig_params": {json.dumps(self.use_orig_params)},\n'
                f'{dtype} "param_order": {json.dumps(list(self.param_order))},\n "units": [\n{units}]}}\n').encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> FlatLayout:
        """Parse ``flat_layout.json``, checked as untrusted input."""
        if len(data) > _MAX_JSON:
            raise FormatError(f"{where}: {len(data)} bytes is too large for a flat layout (limit {_MAX_JSON})")
        try:
            doc = json.loads(data)
            if doc.get("format") != _FORMAT or doc.get("version") != 1:
                raise ValueError(f"expected format {_FORMAT!r} version 1, "
                                 f"found {doc.get('format')!r} {doc.get('version')!r}")
            units = tuple(
                FlatUnit(_str(unit["key"]),
                         tuple(FlatParam(_str(param["fqn"]), _shape(param["shape"]), _int(param["offset"]))
                               for param in unit["params"]),
                         tuple((_str(alias), _str(fqn)) for alias, fqn in unit.get("shared", ())))
                for unit in doc["units"])
            dtype = doc.get("param_dtype")
            return cls(units, _bool(doc["use_orig_params"]), tuple(_str(name) for name in doc.get("param_order", ())),
                       None if dtype is None else _floating(dtype))
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from e
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise FormatError(f"{where}: not a ckptkit flat layout ({type(e).__name__}: {str(e)[:200]})") from e


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, found {v!r}")
    return v


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TypeError(f"expected a non-negative integer, found {v!r}")
    return v


def _floating(v: Any) -> str:
    if v not in _FLOATING:
        raise TypeError(f"expected a floating dtype name ({', '.join(sorted(_FLOATING))}), found {v!r}")
    return v


def _shape(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 64:
        raise TypeError(f"expected a shape (a list of at most 64 sizes), found {v!r:.60}")
    return tuple(_int(dim) for dim in v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, found {v!r}")
    return v


def pieces(param: FlatParam, ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """``(rank, start, stop)``: which of ``param``'s flattened elements each rank's flat slice holds."""
    out = []
    for r, (lo, hi) in enumerate(ranges):
        a, b = max(lo, param.offset), min(hi, param.end)
        if a < b:
            out.append((r, a - param.offset, b - param.offset))
    return out


def param_entry(path: Path_, p: FlatParam, dtype: DType, ranges: tuple[tuple[int, int], ...],
                locate: Callable[[int, int], tuple[str, int]]) -> TensorEntry:
    """``p`` (or a state of it) as chunks: ``locate(rank, start)`` says where, in which file, the rank's part
    starting at ``p``'s flattened element ``start`` begins."""
    chunks = []
    for r, a, b in pieces(p, ranges):
        file, offset = locate(r, a)
        for offsets, sizes in range_boxes(p.shape, a, b):
            n = math.prod(sizes) * dtype.itemsize
            chunks.append(Chunk(offsets, sizes, Span(file, offset, n)))
            offset += n
    entry = TensorEntry(key_of(path), path, dtype, p.shape, tuple(chunks))
    entry.validate()
    return entry

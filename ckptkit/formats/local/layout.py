"""FSDP1 flat parameters: which original parameters each FSDP unit's 1-D ``_flat_param`` holds, where they lie
in it, and which elements each rank keeps.

FSDP1 concatenates the parameters of each wrapped module (a *unit*) into one 1-D ``FlatParameter`` of
``total`` elements and gives rank r the elements ``[r*S, min((r+1)*S, total))`` with
``S = ceil(total / world_size)`` (``torch.chunk``); ranks past the end hold nothing. With
``use_orig_params=True`` it also inserts padding before each parameter so that every parameter starts on a
16-byte boundary, and pads the end to a multiple of the world size. A ``LOCAL_STATE_DICT`` file saves the
flat parameter with that end padding (so its size depends on the world size) but without the padding
``torch.chunk`` needs on the last ranks.

A :class:`FlatLayout` holds what does not depend on the world size: the units, the parameters in each and
their offsets. ckptkit writes it as ``flat_layout.json`` beside every LOCAL checkpoint; for one saved by FSDP
itself, :func:`derive_layout` reads it from the FlatParameters FSDP builds for the model.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass
from typing import Any

from ...errors import FormatError, UsageError

__all__ = ["FLAT_PARAM", "LAYOUT_FILE", "FlatLayout", "FlatParam", "FlatUnit", "derive_layout", "range_boxes"]

FLAT_PARAM = "_flat_param"
LAYOUT_FILE = "flat_layout.json"
_FORMAT = "ckptkit.flat_layout"
_MAX_JSON = 64 << 20


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
                raise FormatError(f"unit {self.key!r}: tied parameter {alias!r} -> {fqn!r} does not name one of its parameters")

    @property
    def prefix(self) -> str:
        """The module prefix of the unit's keys: ``layers.0.`` for ``layers.0._flat_param``."""
        return self.key[: -len(FLAT_PARAM)]

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

    def __post_init__(self) -> None:
        keys, names = set(), set()
        for u in self.units:
            if u.key in keys:
                raise FormatError(f"flat layout lists unit {u.key!r} twice")
            keys.add(u.key)
            for name in [p.fqn for p in u.params] + [a for a, _ in u.shared]:
                if name in names:
                    raise FormatError(f"flat layout places parameter {name!r} in two units")
                names.add(name)

    def unit(self, key: str) -> FlatUnit | None:
        return next((u for u in self.units if u.key == key), None)

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
            + ",\n".join(f'    {json.dumps({"fqn": p.fqn, "shape": list(p.shape), "offset": p.offset})}' for p in u.params)
            + "]}" for u in self.units)
        return (f'{{"format": "{_FORMAT}", "version": 1, "use_orig_params": {json.dumps(self.use_orig_params)},\n'
                f' "param_order": {json.dumps(list(self.param_order))},\n "units": [\n{units}]}}\n').encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "FlatLayout":
        """Parse ``flat_layout.json``, checked as untrusted input."""
        if len(data) > _MAX_JSON:
            raise FormatError(f"{where}: {len(data)} bytes is too large for a flat layout (limit {_MAX_JSON})")
        try:
            doc = json.loads(data)
            if doc.get("format") != _FORMAT or doc.get("version") != 1:
                raise ValueError(f"expected format {_FORMAT!r} version 1, found {doc.get('format')!r} {doc.get('version')!r}")
            units = tuple(FlatUnit(_str(u["key"]),
                                   tuple(FlatParam(_str(p["fqn"]), tuple(_int(d) for d in p["shape"]), _int(p["offset"]))
                                         for p in u["params"]),
                                   tuple((_str(a), _str(b)) for a, b in u.get("shared", ())))
                          for u in doc["units"])
            return cls(units, _bool(doc["use_orig_params"]), tuple(_str(n) for n in doc.get("param_order", ())))
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from e
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FormatError(f"{where}: not a ckptkit flat layout ({type(e).__name__}: {e})") from e


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, found {v!r}")
    return v


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TypeError(f"expected a non-negative integer, found {v!r}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected true or false, found {v!r}")
    return v


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(offsets, sizes)`` of a tensor of ``shape`` that hold its flattened elements ``[start, stop)``.

    Row-major order makes each box one contiguous run of the range, and the boxes follow each other in it. A
    range of whole rows is one box; otherwise it splits into a partial first row, the whole rows between and
    a partial last row, and each partial row splits the same way one dimension down: at most
    ``2 * len(shape) - 1`` boxes.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    head, tail = start - first * inner, stop - last * inner  # offset into the first row; length of the last
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)

    def rows(a: int, b: int) -> list:
        return [((a, *zeros), (b - a, *rest))] if b > a else []

    def part(row: int, a: int, b: int) -> list:
        return [((row, *o), (1, *s)) for o, s in range_boxes(rest, a, b)]

    if first == last:
        return rows(first, first + 1) if head == 0 and tail == inner else part(first, head, tail)
    out = part(first, head, inner) if head else []
    out += rows(first + (1 if head else 0), last + (1 if tail == inner else 0))
    return out + (part(last, 0, tail) if tail != inner else [])


# --------------------------------------------------------------------------------------------------------
# Deriving the layout from the model


def derive_layout(model: str, auto_wrap: str = "none", *, world_size: int, use_orig_params: bool) -> FlatLayout:
    """The layout FSDP1 gives ``model`` (``"package.module:factory"``, called with no arguments) wrapped with
    ``auto_wrap`` at ``world_size`` ranks, read from the FlatParameters FSDP builds.

    ``auto_wrap`` is ``none`` (one unit, FSDP's default), ``size:<min_num_params>``
    (``size_based_auto_wrap_policy``) or ``block:<module.path:ClassName>[,...]`` (``ModuleWrapPolicy``). The
    model is built under a fake tensor mode (no parameter memory) and wrapped under a fake process group of
    ``world_size`` ranks, so no real ranks are needed. A mixed-precision ``param_dtype`` changes FSDP's
    alignment padding; derived layouts assume none.
    """
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    factory = _import(model, "--model")
    policy = _wrap_policy(auto_wrap)
    if dist.is_initialized():
        raise UsageError("deriving a flat layout needs a process of its own (it starts a fake process group), "
                         "but this process already has a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # FSDP1 refuses a meta-device module without an accelerator; fake CPU tensors take no memory either.
        with FakeTensorMode():
            module = factory()
            if not isinstance(module, torch.nn.Module):
                raise UsageError(f"--model {model}: the factory returned {type(module).__name__}, not a torch.nn.Module")
            order = tuple(name for name, _ in module.named_parameters())
            wrapped = FSDP(module, auto_wrap_policy=policy, use_orig_params=use_orig_params,
                           device_id=torch.device("cpu"))
        units = _units(wrapped)
    finally:
        dist.destroy_process_group()
    return FlatLayout(units, use_orig_params, order)


def layout_of(wrapped: Any) -> FlatLayout:
    """The layout of a live FSDP1 model, as ``ckptkit.save(form="local")`` records it beside the rank files."""
    use_orig = bool(getattr(wrapped, "_use_orig_params", False))
    # With use_orig_params the optimizer holds the original parameters, in the wrapped model's order.
    order = tuple(_clean(name) for name, _ in wrapped.named_parameters()) if use_orig else ()
    return FlatLayout(_units(wrapped), use_orig, order)


def _units(wrapped: Any) -> tuple[FlatUnit, ...]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return tuple(_unit(_clean(name), sub._handle.flat_param) for name, sub in wrapped.named_modules()
                 if isinstance(sub, FSDP) and sub._handle is not None)


def _clean(name: str) -> str:
    # FSDP's state-dict hooks drop the wrapper segments from keys; so do we.
    return ".".join(p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def _unit(module_name: str, flat: Any) -> FlatUnit:
    prefix = f"{module_name}." if module_name else ""
    params, at, names = [], 0, iter(zip(flat._fqns, flat._shapes))
    for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not is_padding:
            fqn, shape = next(names)
            params.append(FlatParam(prefix + _clean(fqn), tuple(shape), at))
        at += numel
    shared = tuple((prefix + _clean(f"{s.module_name}.{s.param_name}".lstrip(".")),
                    prefix + _clean(f"{s.prim_module_name}.{s.prim_param_name}".lstrip(".")))
                   for s in flat._shared_param_infos)
    return FlatUnit(prefix + FLAT_PARAM, tuple(params), shared)


def _import(spec: str, option: str) -> Any:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise UsageError(f"{option} {spec!r}: expected package.module:name")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{option} {spec!r}: cannot import it ({type(e).__name__}: {e}); is its package on "
                         "PYTHONPATH?") from e
    return obj


def _wrap_policy(auto_wrap: str) -> Any:
    import functools

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    kind, _, arg = auto_wrap.partition(":")
    if kind == "none" and not arg:
        return None
    if kind == "size" and arg.isdigit():
        return functools.partial(size_based_auto_wrap_policy, min_num_params=int(arg))
    if kind == "block" and arg:
        return ModuleWrapPolicy({_import(a.strip(), "--auto-wrap block:") for a in arg.split(",")})
    raise UsageError(f"--auto-wrap {auto_wrap!r}: expected none, size:<min_num_params> or "
                     "block:<module.path:ClassName>[,<module.path:ClassName>...]")

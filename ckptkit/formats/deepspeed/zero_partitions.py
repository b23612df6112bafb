"""DEEPSPEED, the partitions: where each parameter of a ZeRO checkpoint lies in the ranks' optimizer files,
and the manifest those byte ranges make (see :mod:`.zero` for the layout and what the manifest holds).

:func:`zero_manifest` takes the tag directory's files, already loaded as data, and checks every structure it
reads on its way in: param_shapes against the partitions' sizes, the slice mappings, the frozen fragments,
the tied aliases.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...codecs.pickle_read import Call, Record
from ...core.manifest import Format, Manifest, ObjectEntry, Path_, TensorEntry, TensorRef, key_of
from ...core.tree import flatten
from ...errors import FormatError
from ..base import plain_object
from ..local.layout import FlatParam, param_entry

__all__ = ["ZeroFiles", "zero_manifest"]


@dataclass(frozen=True)
class ZeroFiles:
    """A tag directory's model and optimizer files, in rank order."""

    models: list[Path]
    """``mp_rank_00_model_states.pt`` (stage 1, 2) or every rank's ``zero_pp_rank_*`` one (stage 3)."""
    optims: list[Path]
    zero3_names: bool
    """Whether the model files have ZeRO-3's names (one per rank)."""


def _get(tree: dict, key: str, file: Path, kind: type | tuple[type, ...]) -> Any:
    value = tree.get(key)
    if not isinstance(value, kind):
        raise FormatError(f"{file}: {key!r} should be a {getattr(kind, '__name__', kind)}, found "
                          f"{type(value).__name__}")
    return value


def _shape(v: Any, where: str) -> tuple[int, ...]:
    if isinstance(v, Call):  # torch.Size((...))
        v = v.args[0] if v.args else ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                   for n in v):
        raise FormatError(f"{where}: expected a shape, found {v!r}")
    return tuple(v)


def _shapes(v: Any, where: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise FormatError(f"{where}: expected a dict of parameter names to shapes, found {type(v).__name__}")
    return {k: _shape(s, f"{where}[{k!r}]") for k, s in v.items()}


# --------------------------------------------------------------------------------------------------------
# Where each parameter lies


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where a parameter lies in the per-rank 1-D tensors of its group: ``param.offset`` is its first element
    in the flat space that ``ranges`` splits over ranks (rank r holds flat ``[lo, hi)`` of it, from element
    ``base`` of its tensor on)."""

    group: int
    param: FlatParam
    ranges: tuple[tuple[int, int], ...]
    base: int = 0


def _vectors(leaves: list[Any], need: list[int], where: str) -> list[TensorRef]:
    """The ranks' 1-D tensors of a group, each holding at least the ``need[r]`` elements its slots use."""
    for r, (t, n) in enumerate(zip(leaves, need, strict=True)):
        if not isinstance(t, TensorRef) or len(t.shape) != 1 or t.strides is not None or t.dtype != leaves[0].dtype:
            found = f"{t.dtype} {list(t.shape)}" if isinstance(t, TensorRef) else type(t).__name__
            raise FormatError(f"{where} of rank {r}: expected a contiguous 1-D {getattr(leaves[0], 'dtype', '')} "
                              f"tensor, found {found}")
        if t.shape[0] < n:
            raise FormatError(f"{where} of rank {r}: holds {t.shape[0]} elements, the parameters need {n}")
    return leaves


def _entry(path: Path_, slot: _Slot, vectors: list[TensorRef]) -> TensorEntry:
    dtype = vectors[0].dtype

    def locate(rank: int, start: int) -> tuple[str, int]:
        span = vectors[rank].span
        element = slot.base + slot.param.offset + start - slot.ranges[rank][0]
        return span.file, span.offset + element * dtype.itemsize

    return param_entry(path, slot.param, dtype, slot.ranges, locate)


def _cumulative(lengths: list[int]) -> tuple[tuple[int, int], ...]:
    starts = [sum(lengths[:r]) for r in range(len(lengths))]
    return tuple((s, s + n) for s, n in zip(starts, lengths, strict=True))


def _partitioned(n: int, ws: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """ZeRO-3's partition of an ``n``-element parameter: ``ceil(n / ws)`` per rank, the padding on the last."""
    pn = -(-n // ws)
    return pn, tuple((r * pn, min(n, r * pn + pn)) if r * pn < n else (n, n) for r in range(ws))



def zero_manifest(tag: Path, files: ZeroFiles, models: list[dict], optims: list[dict]) -> Manifest:
    """The manifest of the ZeRO checkpoint in tag directory ``tag``, from its ``files`` loaded as ``models``
    and ``optims`` (each a dict, in rank order).

    Args:
        tag: The tag directory.
        files: Its model and optimizer files, in rank order.
        models: The model files' contents, as data.
        optims: The optimizer files' contents, as data.

    Returns:
        The model, the Adam moments and the param groups, as the module docstring of :mod:`.zero` says.

    Raises:
        FormatError: A structure is not what DeepSpeed saves, or the files disagree.
    """
    return _Zero(tag, files, models, optims).manifest()


def _names_to(value: Any, kind: type, where: str) -> dict:
    """``value`` checked to be a dict from names (str) to values of ``kind``."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, kind) for k, v in value.items()):
        raise FormatError(f"{where}: expected a dict of names to {kind.__name__}, found {value!r:.80}")
    return value


class _Zero:
    def __init__(self, tag: Path, files: ZeroFiles, models: list[dict], optims: list[dict]) -> None:
        self.tag, self.files, self.models, self.optims = tag, files, models, optims
        self.details: list[tuple[str, str]] = [("tag", tag.name)]
        self.left_out: list[str] = []
        m0, f0 = self.models[0], self.files.models[0]
        for key in ("ds_autoep_layers", "autoep_layers"):
            if m0.get(key):
                raise FormatError(f"{f0}: {key!r} marks an AutoEP mixture-of-experts checkpoint, which ckptkit does "
                                  "not merge")
        self.osds = [_get(o, "optimizer_state_dict", f, dict) for o, f in zip(self.optims, self.files.optims,
                                                                                strict=True)]
        first, opt0 = self.osds[0], self.files.optims[0]
        if "zero_stage" not in first:
            raise FormatError(f"{opt0}: no 'zero_stage' in its optimizer_state_dict (keys "
                              f"{sorted(map(str, first))[:6]}): not a ZeRO optimizer (bf16 without ZeRO saves "
                              "BF16_Optimizer state), which ckptkit does not read")
        self.stage = first["zero_stage"]
        if self.stage not in (1, 2, 3) or (self.stage == 3) != self.files.zero3_names:
            raise FormatError(f"{opt0}: zero_stage {self.stage!r} does not fit model files "
                              f"{', '.join(f.name for f in self.files.models[:2])}")
        if first.get("ds_zero_partition_groups"):
            raise FormatError(f"{opt0}: 'ds_zero_partition_groups' marks an AutoEP checkpoint, which ckptkit does "
                              "not merge")
        self.ws = len(self.files.optims)
        for o, f in zip(self.osds, self.files.optims, strict=True):
            counts = o.get("partition_count")
            counts = counts if isinstance(counts, list) else [counts]
            if any(c != self.ws for c in counts):
                raise FormatError(f"{f}: partition_count {o.get('partition_count')!r}, but the tag holds {self.ws} "
                                  "optimizer files; partitions of other ranks are missing or the counts are tampered")
            if o.get("zero_stage") != self.stage:
                raise FormatError(f"{f}: zero_stage {o.get('zero_stage')!r}, but {opt0.name} says {self.stage}")
        self.param_shapes = [_shapes(g, f"{f0}: param_shapes[{i}]")
                             for i, g in enumerate(_get(m0, "param_shapes", f0, list))]
        for m, f in zip(self.models[1:], self.files.models[1:], strict=True):
            if [_shapes(g, f"{f}: param_shapes") for g in _get(m, "param_shapes", f, list)] != self.param_shapes:
                raise FormatError(f"{f}: param_shapes differ from {f0.name}'s; every rank saves the same")

    def manifest(self) -> Manifest:
        m0, f0 = self.models[0], self.files.models[0]
        module = _names_to(_get(m0, "module", f0, dict), object, f"{f0}: module")
        buffer_names = set(_get(m0, "buffer_names", f0, list))  # a TypeError if unhashable: the reader reports it
        trainable, need = self._slots()
        entries: dict[str, TensorEntry] = {}
        buffers = [(k, v) for k, v in module.items() if k in buffer_names]
        for k, v in buffers:
            if not isinstance(v, TensorRef):
                raise FormatError(f"{f0}: buffer {k!r} is a {type(v).__name__}, not a tensor")
            entries[k] = v.as_entry(("model", k))
        if any(v.dtype.is_floating and v.dtype.name != "float32" for _, v in buffers):
            self.details.append(("buffers", "floating buffers keep their saved dtype (zero_to_fp32 casts them to "
                                            "float32)"))
        if self.stage <= 2:  # module holds each parameter whole (stage 3: 0-element placeholders)
            for name, slot in trainable.items():
                v = module.get(name)
                if not isinstance(v, TensorRef) or v.shape != slot.param.shape:
                    found = list(v.shape) if isinstance(v, TensorRef) else type(v).__name__
                    raise FormatError(f"{f0}: param_shapes gives {name!r} shape {list(slot.param.shape)}, its module "
                                      f"entry is {found}")
        shared = _names_to(_get(m0, "shared_params", f0, dict), str, f"{f0}: shared_params")
        entries.update(self._frozen(module, buffer_names, trainable, shared))
        fp32_key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        for g in range(len(self.param_shapes)):
            vectors = self._group_vectors(fp32_key, g, need[g], [o.get(fp32_key) for o in self.osds])
            for name, slot in trainable.items():
                if slot.group == g:
                    entries[name] = _entry(("model", name), slot, vectors)
        # An alias the module holds is part of the model: its owner must be too. (Not in module: both were left
        # out of the save, with exclude_frozen_parameters.)
        tied = [(alias, owner) for alias, owner in shared.items() if alias in module and alias not in entries]
        lost = [f"{alias} -> {owner}" for alias, owner in tied if owner not in entries]
        if lost:
            raise FormatError(f"{f0}: shared_params ties {', '.join(lost[:3])}, but no such parameter was saved")
        for alias, owner in tied:  # zero_to_fp32 adds each alias last, as the owner's tensor
            entries[alias] = dataclasses.replace(entries[owner], key=key_of(("model", alias)), path=("model", alias))
        if tied:
            self.details.append(("tied", ", ".join(f"{a} = {o}" for a, o in tied)))
        tensors = list(entries.values())
        if self.stage <= 2:
            self._check_slice_mappings(trainable)
        optim_tensors, objects = self._optimizer(trainable, need)
        tensors += optim_tensors
        steps = m0.get("global_steps")  # the engine's step, which ckptkit.load returns
        self.details[1:1] = [("zero stage", str(self.stage)), ("deepspeed", str(m0.get("ds_version"))),
                             *((("global_steps", str(steps)),) if isinstance(steps, int) else ()),
                             ("model files", ", ".join(f.name for f in self.files.models[:2])
                              + (" ..." if len(self.files.models) > 2 else "")),
                             ("optimizer files", self.files.optims[0].name.replace("rank_0_", "rank_{rank}_"))]
        if self.left_out:
            self.details.append(("left out", "; ".join(self.left_out)))
        return Manifest(Format.DEEPSPEED, str(self.tag), tuple(tensors), tuple(objects), self.ws, tuple(self.details))

    def _slots(self) -> tuple[dict[str, _Slot], list[list[int]]]:
        """Where each trainable parameter lies, and how many elements of each rank's group tensor the
        parameters use (``need[group][rank]``)."""
        slots: dict[str, _Slot] = {}
        need: list[list[int]] = []
        if self.stage <= 2:
            lean = [[_length(o.get("single_partition_of_fp32_groups"), g, f)
                     for o, f in zip(self.osds, self.files.optims, strict=True)] for g in range(len(self.param_shapes))]
            paddings = self.osds[0].get("param_alignment_paddings")  # absent before DeepSpeed 0.17: no padding
            for g, shapes in enumerate(self.param_shapes):
                ranges, at = _cumulative(lean[g]), 0
                pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else [0] * len(shapes)
                if not isinstance(pads, list) or len(pads) != len(shapes):
                    raise FormatError(f"{self.files.optims[0]}: param_alignment_paddings[{g}] {pads!r:.80} for "
                                      f"{len(shapes)} parameters")
                for (name, shape), pad in zip(shapes.items(), pads, strict=True):
                    slots[name] = _Slot(g, FlatParam(name, shape, at), ranges)
                    at += math.prod(shape) + pad
                held, align = sum(lean[g]), 2 * self.ws
                # zero_to_fp32's check: the same size once padded for alignment (older DeepSpeed kept the tail).
                if at > held or -(-at // align) != -(-held // align):
                    raise FormatError(f"{self.files.models[0]}: param_shapes[{g}] lay out {at} elements, but the "
                                      f"ranks' fp32 partitions of group {g} hold {held}")
                need.append(lean[g])
            return slots, need
        lengths = [[_length(o.get("fp32_flat_groups"), g, f) for g in range(len(self.param_shapes))]
                   for o, f in zip(self.osds, self.files.optims, strict=True)]
        for r, f in enumerate(self.files.optims):
            if lengths[r] != lengths[0]:
                raise FormatError(f"{f}: fp32_flat_groups of {lengths[r]} elements, rank 0's of {lengths[0]}; every "
                                  "rank's partitions are the same size")
        for g, shapes in enumerate(self.param_shapes):
            at = 0
            for name, shape in shapes.items():
                pn, ranges = _partitioned(math.prod(shape), self.ws)
                slots[name] = _Slot(g, FlatParam(name, shape, 0), ranges, base=at)
                at += pn
            if at != lengths[0][g]:
                raise FormatError(f"{self.files.models[0]}: param_shapes[{g}] need {at} elements per rank, but the "
                                  f"ranks' fp32_flat_groups[{g}] hold {lengths[0][g]}")
            need.append([at] * self.ws)
        return slots, need

    def _group_vectors(self, key: str, g: int, need: list[int], groups: list[Any]) -> list[TensorRef]:
        leaves = []
        for r, (value, f) in enumerate(zip(groups, self.files.optims, strict=True)):
            if not isinstance(value, list) or len(value) != len(self.param_shapes):
                raise FormatError(f"{f}: {key} should list {len(self.param_shapes)} groups (one per param_shapes "
                                  f"entry of the model file), found {type(value).__name__} of rank {r}")
            leaves.append(value[g])
        return _vectors(leaves, need, f"{self.tag}: {key}[{g}]")

    def _frozen(self, module: dict, buffer_names: set[str], trainable: dict[str, _Slot],
                shared: dict[str, str]) -> dict[str, TensorEntry]:
        """Parameters the optimizer does not own, in their module dtype. Every ``module`` entry must be a buffer,
        a trained, frozen or tied parameter: one that is none of these would go missing from the model."""
        m0, f0 = self.models[0], self.files.models[0]
        shapes_value = m0.get("frozen_param_shapes")
        listed = {*buffer_names, *trainable, *shared, *(shapes_value or ())}
        rest = [k for k in module if k not in listed]
        if rest and (shapes_value is not None or self.stage == 3):
            raise FormatError(f"{f0}: module holds {', '.join(rest[:4])}, which buffer_names, param_shapes, "
                              "frozen_param_shapes and shared_params do not list")
        if shapes_value is None:
            # Stage 1 saves no frozen_param_fragments, and zero_to_fp32 leaves these out; module holds them whole,
            # each in a storage of its own (a trained parameter's entry is a view of its group's flat buffer).
            trained = {(v.span.file, v.span.offset): k for k, v in module.items() if k in trainable}
            out = {}
            for k in rest:
                v = module[k]
                if not isinstance(v, TensorRef):
                    raise FormatError(f"{f0}: module[{k!r}] is a {type(v).__name__}, not a tensor")
                if (v.span.file, v.span.offset) in trained:
                    raise FormatError(f"{f0}: module[{k!r}] is parameter {trained[(v.span.file, v.span.offset)]!r} "
                                      "under another name, which shared_params does not list")
                out[k] = v.as_entry(("model", k))
            if out:
                self.details.append(("frozen parameters", f"{len(out)} taken whole from module, in their module "
                                                          "dtype (zero_to_fp32 leaves them out)"))
            return out
        frozen = _shapes(shapes_value, f"{f0}: frozen_param_shapes")
        out = {}
        for name, shape in frozen.items():
            n = math.prod(shape)
            frags = [self._fragment(m, f, name) for m, f in zip(self.models, self.files.models, strict=True)]
            if self.stage <= 2:  # the whole tensor, sharing module[name]'s storage
                t = frags[0]
                if t.strides is not None or math.prod(t.shape) != n:
                    raise FormatError(f"{f0}: frozen_param_fragments[{name!r}] is {list(t.shape)}, frozen_param_shapes "
                                      f"says {list(shape)}")
                slot = _Slot(0, FlatParam(name, shape, 0), ((0, n),))
                out[name] = _entry(("model", name), slot, _vectors([_flat(t)], [n], f"{f0}: {name!r}"))
            else:  # every rank's partition, as for a trainable parameter
                pn, ranges = _partitioned(n, self.ws)
                if any(math.prod(t.shape) != pn for t in frags):
                    raise FormatError(f"{self.tag}: frozen_param_fragments[{name!r}] hold "
                                      f"{[math.prod(t.shape) for t in frags]} elements, ZeRO-3 partitions of "
                                      f"{list(shape)} over {self.ws} ranks hold {pn} each")
                slot = _Slot(0, FlatParam(name, shape, 0), ranges, base=0)
                vectors = _vectors([_flat(t) for t in frags], [pn] * self.ws, f"{self.tag}: {name!r}")
                out[name] = _entry(("model", name), slot, vectors)
        return out

    def _fragment(self, model: dict, file: Path, name: str) -> TensorRef:
        frags = model.get("frozen_param_fragments")
        t = frags.get(name) if isinstance(frags, dict) else None
        if not isinstance(t, TensorRef):
            raise FormatError(f"{file}: no frozen_param_fragments[{name!r}], which frozen_param_shapes lists")
        if not t.dtype.is_floating:
            raise FormatError(f"{file}: frozen_param_fragments[{name!r}] is {t.dtype}: quantized frozen weights, "
                              "which ckptkit does not dequantize")
        return t

    def _check_slice_mappings(self, trainable: dict[str, _Slot]) -> None:
        """Stage 1 and 2 also save which parameter pieces each rank's partition holds: they must be the pieces
        ``param_shapes`` lays out (a tampered shape or padding shifts every parameter after it)."""
        for r, (o, f) in enumerate(zip(self.osds, self.files.optims, strict=True)):
            mappings = o.get("param_slice_mappings")
            if mappings is None:
                continue
            for g, saved in enumerate(mappings if isinstance(mappings, list) else [mappings]):
                expected = {}
                for name, slot in trainable.items():
                    lo, hi = slot.ranges[r]
                    a, b = max(lo, slot.param.offset), min(hi, slot.param.end)
                    if slot.group == g and a < b:
                        expected[name] = (b - a, a - lo)
                found = {k: (getattr(v, "numel", None), getattr(v, "start", None))
                         for k, v in (saved.items() if isinstance(saved, dict) else ()) if isinstance(v, Record)}
                if found != expected or not isinstance(saved, dict) or len(saved) != len(found):
                    diff = sorted(k for k in found.keys() | expected.keys() if found.get(k) != expected.get(k))
                    raise FormatError(f"{f}: param_slice_mappings[{g}] of rank {r} disagree with the layout "
                                      f"param_shapes gives, at {', '.join(diff[:4]) or 'its structure'}")

    def _optimizer(self, trainable: dict[str, _Slot], need: list[list[int]]) -> tuple[list[TensorEntry],
                                                                                       list[ObjectEntry]]:
        """The Adam moments (and any other per-element state) of each parameter, named as ``get_state_dict``
        names them, from the same byte ranges as the weights."""
        inner = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        states = [o.get(inner) for o in self.osds]
        if not all(isinstance(s, dict) and isinstance(s.get("state"), dict) and isinstance(s.get("param_groups"), list)
                   for s in states):
            self.left_out.append(f"optimizer state ({inner} is not a torch optimizer state_dict: "
                                 "elastic_checkpoint layout, or stripped)")
            return [], []
        tensors: list[TensorEntry] = []
        objects: list[ObjectEntry] = []
        kinds: Counter[str] = Counter()
        for g, shapes in enumerate(self.param_shapes):
            per_rank = [_names_to(s["state"].get(g, {}), object, f"{self.tag}: {inner}['state'][{g}]") for s in states]
            for key, leaf in per_rank[0].items():
                leaves = [p.get(key) for p in per_rank]
                where = f"{self.tag}: {inner}['state'][{g}][{key!r}]"
                if isinstance(leaf, TensorRef) and len(leaf.shape) == 1:
                    vectors = _vectors(leaves, need[g], where)
                    tensors += [_entry(("optim", "state", name, key), trainable[name], vectors) for name in shapes]
                    kinds[key] += len(shapes)
                elif isinstance(leaf, TensorRef) and not leaf.shape:  # step: one per group, the same for each param
                    tensors += [leaf.as_entry(("optim", "state", name, key)) for name in shapes]
                else:
                    paths = [("optim", "state", name, key) for name in shapes]
                    objects += [plain_object(p, leaf, str(self.files.optims[0])) for p in paths]
        groups = states[0]["param_groups"]
        if len(groups) != len(self.param_shapes):
            raise FormatError(f"{self.files.optims[0]}: {len(groups)} param groups for {len(self.param_shapes)} "
                              "param_shapes groups")
        named = [{**g, "params": list(shapes)} if isinstance(g, dict) else g
                 for g, shapes in zip(groups, self.param_shapes, strict=True)]
        objects += [plain_object(p, v, str(self.files.optims[0]))
                    for p, v in flatten(named, _is_tensor, ("optim", "param_groups"))]
        self.details.append(("optimizer", ", ".join(f"{k} of {n} parameters" for k, n in kinds.items())
                             + f" in {len(groups)} groups"))
        return tensors, objects


def _is_tensor(v: Any) -> bool:
    return isinstance(v, TensorRef)


def _flat(t: TensorRef) -> TensorRef:
    """A contiguous tensor viewed as 1-D."""
    return TensorRef(t.dtype, (math.prod(t.shape),), t.span)


def _length(groups: Any, g: int, file: Path) -> int:
    if not isinstance(groups, list) or g >= len(groups) or not isinstance(groups[g], TensorRef):
        raise FormatError(f"{file}: expected a list of per-group fp32 partitions holding group {g}, found "
                          f"{type(groups).__name__}")
    t = groups[g]
    if len(t.shape) != 1:
        raise FormatError(f"{file}: fp32 partition of group {g} has shape {list(t.shape)}, expected 1-D")
    return t.shape[0]


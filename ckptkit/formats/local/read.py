"""Reading LOCAL: FSDP1 ``LOCAL_STATE_DICT`` rank files into a manifest of original parameters.

Each rank's file holds, per FSDP unit, a 1-D ShardedTensor ``<prefix>_flat_param`` with that rank's slice of
the unit's flat parameter, and the buffers (the same on every rank). With ``use_orig_params=True`` it also
holds every original parameter as a 1-D view of its part of that slice (empty where the rank holds none of
it). The flat layout (:mod:`.layout`) maps the slices back to the original parameters: the manifest lists
``layers.0.attn.weight`` with chunks that point straight into the rank files. A parameter that straddles
ranks gets chunks from each, and a slice that starts or ends mid-row becomes up to ``2 * ndim - 1`` boxes
(:func:`~ckptkit.core.boxes.range_boxes`).

The layout comes from ``flat_layout.json`` (ckptkit writes it beside every LOCAL checkpoint), else it is
derived from ``model=`` and ``auto_wrap=`` (:mod:`.derive`). A rank file may nest the model state dict
(``{"model": ..., "optim": ..., "step": ...}``); an ``optimizer.state_dict()`` beside it is read by
:mod:`.optim`. Every other entry is taken from rank 0's file. Under NO_SHARD the files hold every
parameter whole and no flat parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...codecs.sharded_tensor import ShardedTensorData, sharded_tensor_globals
from ...codecs.torchzip_read import read_archive
from ...core.manifest import Chunk, Format, Manifest, ObjectEntry, Path_, Span, TensorEntry, TensorRef, key_of
from ...core.tree import flatten
from ...errors import FormatError, IncompleteCheckpointError, UsageError
from ..base import LocalOptions
from .derive import derive_layout
from .discover import DEFAULT_RANK_FILES, rank_files
from .layout import FLAT_PARAM, LAYOUT_FILE, FlatLayout, FlatParam, FlatUnit, param_entry
from .optim import below, fits, is_flat_optim, read_replicated_optim, read_sharded_optim

__all__ = ["LocalManifest", "read_local"]


@dataclass(frozen=True)
class LocalManifest(Manifest):
    """A LOCAL checkpoint's manifest, with the flat layout it was read with, so it can be laid out again."""

    layout: FlatLayout | None = None
    rank_files: str = DEFAULT_RANK_FILES


def read_local(path: Path, options: LocalOptions) -> LocalManifest:
    root = path.absolute()
    template, files = rank_files(root, options.rank_files)
    world = len(files)
    ranks = [dict(flatten(read_archive(str(f), extra_globals=sharded_tensor_globals(str(f))), _is_leaf))
             for f in files]
    flats = [p for p, v in ranks[0].items() if _is_flat(p, v)]
    if not flats:
        return _read_replicated(root, template, files, ranks, options)
    parents = {p[:-1] for p in flats}
    if len(parents) != 1:
        raise FormatError(f"{files[0]}: flat parameters sit under several keys {sorted(map(key_of, parents))}; "
                          "ckptkit reads one FSDP model per checkpoint")
    shards = {p[-1]: [_rank_leaf(ranks[r], p, files[r], r, world) for r in range(world)] for p in flats}

    def sizes_fit(layout: FlatLayout) -> bool:
        return all(u.key in shards and shards[u.key][0].size == (layout.total(u, world),) for u in layout.units)

    # The saved sizes tell use_orig_params apart: with it, FSDP pads (alignment and world size).
    layout, source, _ = resolve_layout(root, options, world, sizes_fit)
    if layout is None:
        raise UsageError(f"{root}: this LOCAL checkpoint has no {LAYOUT_FILE}, so which parameters its flat "
                         "parameters hold is unknown; provide --model package.module:factory (with --auto-wrap) "
                         f"or a {LAYOUT_FILE}")
    _check_layout(layout, shards, world, files)  # names every mismatch, a derived layout's included
    reader = _ShardedReader(layout, next(iter(parents)), files, ranks)
    details: tuple[tuple[str, str], ...] = (
        ("rank files", template), ("flat layout", source), ("use_orig_params", str(layout.use_orig_params).lower()),
        ("param dtype", layout.param_dtype or "not recorded"), ("flat units", str(len(layout.units))))
    others = sorted({f.name for f in root.iterdir() if f.is_file()} - {f.name for f in files} - {LAYOUT_FILE})
    if others:
        details += (("not read", ", ".join(others)),)
    return LocalManifest(Format.LOCAL, str(root), tuple(reader.tensors), tuple(reader.objects), world, details,
                         layout=layout, rank_files=template)


def resolve_layout(root: Path, options: LocalOptions, world: int,
                   accept: Callable[[FlatLayout], bool]) -> tuple[FlatLayout | None, str, bool]:
    """The flat layout of the checkpoint at ``root``, where it came from, and whether ``accept`` took it.

    ``flat_layout.json`` wins. Otherwise the layout is derived from ``options.model`` at ``world`` ranks,
    with ``use_orig_params`` as given or, when unknown, the first of off and on that ``accept`` takes (the
    last tried when neither is). None when there is neither a sidecar nor a model.
    """
    sidecar = root / LAYOUT_FILE
    if sidecar.is_file():
        layout = FlatLayout.from_json(sidecar.read_bytes(), where=str(sidecar))
        return layout, LAYOUT_FILE, accept(layout)
    if options.model is None:
        return None, f"no {LAYOUT_FILE} and no --model", False
    dtype = f", param dtype {options.param_dtype}" if options.param_dtype else ""
    source = f"derived from {options.model} (auto-wrap {options.auto_wrap}{dtype})"
    for uop in [options.use_orig_params] if options.use_orig_params is not None else [False, True]:
        layout = derive_layout(options.model, options.auto_wrap, world_size=world, use_orig_params=uop,
                               param_dtype=options.param_dtype)
        if accept(layout):
            return layout, source, True
    if options.param_dtype is None and options.use_orig_params is not False:
        _suggest_param_dtype(root, options.model, options.auto_wrap, world, accept)
    return layout, source, False


def _suggest_param_dtype(root: Path, model: str, auto_wrap: str, world: int,
                         accept: Callable[[FlatLayout], bool]) -> None:
    """Raise the error that names ``--param-dtype`` when the checkpoint fits the layout FSDP gives under
    ``MixedPrecision(param_dtype=bf16 or fp16)``: that layout aligns to 8 elements where fp32 aligns to 4, so
    the saved sizes differ while the dtype (float32 either way) does not."""
    mixed = derive_layout(model, auto_wrap, world_size=world, use_orig_params=True, param_dtype="bfloat16")
    if accept(mixed):
        raise UsageError(f"{root}: the flat parameters fit the layout FSDP1 gives {model} (auto-wrap {auto_wrap}) "
                         "with use_orig_params under mixed precision, not in the model's own dtype; "
                         "pass --param-dtype bf16 (fp16 lays out the same) with --use-orig-params")


def _read_replicated(root: Path, template: str, files: list[Path], ranks: list[dict],
                     options: LocalOptions) -> LocalManifest:
    """NO_SHARD: FSDP1 keeps no flat parameter in the state dict, and every rank saves it whole."""
    leaves = ranks[0]
    if any(isinstance(v, ShardedTensorData) for v in leaves.values()):
        raise FormatError(f"{files[0]}: ShardedTensors but no '{FLAT_PARAM}'; not an FSDP1 LOCAL_STATE_DICT file")

    def shapes(leaves: dict) -> dict:
        return {p: (v.dtype, v.shape) if isinstance(v, TensorRef) else None for p, v in leaves.items()}

    for f, other in zip(files[1:], ranks[1:], strict=True):
        if shapes(other) != shapes(leaves):
            raise FormatError(f"{f}: holds other entries than {files[0].name}; NO_SHARD ranks hold the same state")
    details = [("rank files", template),
               ("sharding", f"NO_SHARD: every rank holds every parameter whole; {files[0].name} is read")]
    optims = {p[:1] for p in leaves if is_flat_optim(leaves, p[:1])}
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    if optims:
        state = below(leaves, (*next(iter(optims)), "state"))
        layout, source, fit = resolve_layout(root, options, 1, lambda layout: fits(layout, state))
        if layout is None:
            details.append(("optimizer state", f"carried as saved, per parameter index ({source} to name them)"))
        else:
            if not fit and source != LAYOUT_FILE:
                raise FormatError(f"{root}: the optimizer state fits neither use_orig_params layout of "
                                  f"{options.model} (auto-wrap {options.auto_wrap}); check --model and --auto-wrap")
            details.append(("flat layout", source))
            for top in optims:
                read_replicated_optim(top, leaves, layout, files[0], tensors, objects)
            leaves = {p: v for p, v in leaves.items() if p[:1] not in optims}
    tensors += [v.as_entry(p) for p, v in leaves.items() if isinstance(v, TensorRef)]
    objects += [ObjectEntry(key_of(p), p, v) for p, v in leaves.items() if not isinstance(v, TensorRef)]
    return LocalManifest(Format.LOCAL, str(root), tuple(tensors), tuple(objects), len(files), tuple(details),
                         rank_files=template)


def _is_leaf(v: Any) -> bool:
    return isinstance(v, (TensorRef, ShardedTensorData))


def _is_flat(path: Path_, v: Any) -> bool:
    last = path[-1] if path else None
    return (isinstance(v, ShardedTensorData) and isinstance(last, str)
            and (last == FLAT_PARAM or last.endswith("." + FLAT_PARAM)))


def _rank_leaf(leaves: dict, path: Path_, file: Path, rank: int, world: int) -> ShardedTensorData:
    v = leaves.get(path)
    if not isinstance(v, ShardedTensorData):
        raise IncompleteCheckpointError(f"{file}: no ShardedTensor {key_of(path)!r}, which rank 0's file has")
    if (v.rank, v.world_size) != (rank, world):
        raise FormatError(f"{file}: {key_of(path)!r} was saved by rank {v.rank} of {v.world_size}, but the file is "
                          f"rank {rank} of {world} by its name; are rank files missing or misnamed?")
    return v


def _check_layout(layout: FlatLayout, shards: dict[str, list[ShardedTensorData]], world: int,
                  files: list[Path]) -> None:
    """The flat parameters in the files are the layout's units, of its sizes and split; else one
    :class:`FormatError` lists the differences."""
    units = {u.key: u for u in layout.units}
    problems = [f"{k!r} is in the rank files but not in the layout" for k in shards if k not in units]
    problems += [f"layout unit {k!r} is not in the rank files" for k in units if k not in shards]
    for key in (k for k in units if k in shards):
        u, want = units[key], layout.total(units[key], world)
        for r, st in enumerate(shards[key]):
            if st.size != (want,) or st.dtype != shards[key][0].dtype:
                dtype = f", param dtype {layout.param_dtype}" if layout.param_dtype else ""
                problems.append(f"{files[r].name}: {key!r} is {st.dtype} of size {list(st.size)}, the layout "
                                f"(use_orig_params={str(layout.use_orig_params).lower()}{dtype}) gives "
                                f"{shards[key][0].dtype} of size [{want}]")
                break
            lo, hi = layout.shard_ranges(u, world)[r]
            boxes = [(b.offsets, b.sizes) for b, t in st.local if t.strides is None]
            if len(boxes) != len(st.local) or boxes != ([((lo,), (hi - lo,))] if hi > lo else []):
                problems.append(f"{files[r].name}: {key!r} holds shards {[b[0] + b[1] for b in boxes]} (offset, size); "
                                f"expected one contiguous shard of elements [{lo}, {hi})")
    if problems:
        raise FormatError("the flat layout does not match the checkpoint: " + "; ".join(problems[:8]) +
                          ("" if len(problems) <= 8 else f"; and {len(problems) - 8} more"))


class _ShardedReader:
    """The tensors and objects of a sharded LOCAL manifest, from each rank file's leaves (``{path: leaf}``)."""

    def __init__(self, layout: FlatLayout, parent: Path_, files: list[Path], ranks: list[dict]) -> None:
        self.layout, self.parent, self.files, self.ranks = layout, parent, files, ranks
        self.tensors: list[TensorEntry] = []
        self.objects: list[ObjectEntry] = []
        world = len(files)
        views = {p.fqn for u in layout.units for p in u.params} | {a for u in layout.units for a, _ in u.shared}
        # An optimizer saved beside a nested model state dict: {"model": ..., "optim": optimizer.state_dict()}.
        tops = {p[:1] for p in ranks[0] if parent and p[:1] != parent[:1]}
        optims = {top for top in tops if is_flat_optim(ranks[0], top)}
        done: set[Path_] = set()
        for path, leaf in ranks[0].items():
            if path[:1] in optims:
                if path[:1] not in done:
                    done.add(path[:1])
                    read_sharded_optim(path[:1], ranks, files, layout, world, self.tensors, self.objects)
            elif _is_flat(path, leaf):
                self._unit(layout.unit(path[-1]))
            elif path[:-1] == parent and path[-1] in views:
                self._check_view(path, leaf, files[0])  # a view of this rank's part of a flat parameter
            elif isinstance(leaf, ShardedTensorData):
                self.tensors.append(self._sharded(path))
            elif isinstance(leaf, TensorRef):
                self.tensors.append(leaf.as_entry(path))
            else:
                self.objects.append(ObjectEntry(key_of(path), path, leaf))

    def _check_view(self, path: Path_, leaf: Any, file: Path) -> None:
        """``leaf`` under a name the layout gives a parameter must be ``use_orig_params``' 1-D view of the flat
        parameter; anything else is a buffer of that name, which reading through the layout would replace."""
        name = str(path[-1])
        unit = next(u for u in self.layout.units if any(p.fqn == name for p in u.params) or
                    any(a == name for a, _ in u.shared))
        flat = self.ranks[0][self.parent + (unit.key,)]
        if not (self.layout.use_orig_params and isinstance(leaf, TensorRef) and len(leaf.shape) == 1
                and leaf.dtype == flat.dtype):
            found = f"{leaf.dtype} {list(leaf.shape)}" if isinstance(leaf, TensorRef) else type(leaf).__name__
            raise FormatError(f"{file}: the flat layout names parameter {key_of(path)!r} of unit {unit.key!r} after "
                              f"buffer {key_of(path)!r} ({found}) in the rank files; a parameter and a buffer cannot "
                              "share a name")

    def _unit(self, unit: FlatUnit) -> None:
        path = (*self.parent, unit.key)
        dtype, ranges = self.ranks[0][path].dtype, self.layout.shard_ranges(unit, len(self.files))
        # Each rank's slice; param_entry asks only of ranks with a non-empty range, which _check_layout saw hold one.
        spans: dict[int, Span] = {r: leaves[path].local[0][1].span for r, leaves in enumerate(self.ranks)
                                  if leaves[path].local}

        def locate(r: int, start: int, p: FlatParam) -> tuple[str, int]:
            span = spans[r]
            return span.file, span.offset + (p.offset + start - ranges[r][0]) * dtype.itemsize

        by_fqn = {p.fqn: param_entry((*self.parent, p.fqn), p, dtype, ranges, functools.partial(locate, p=p))
                  for p in unit.params}
        for alias, fqn in unit.shared:  # tied weights: the full state dict holds both names
            by_fqn[alias] = dataclasses.replace(by_fqn[fqn], key=key_of((*self.parent, alias)),
                                                path=(*self.parent, alias))
        self.tensors += by_fqn.values()

    def _sharded(self, path: Path_) -> TensorEntry:
        """A ShardedTensor that is not a flat parameter (``FSDP.optim_state_dict`` under LOCAL saves these)."""
        first = self.ranks[0][path]
        chunks = []
        for r, leaves in enumerate(self.ranks):
            st = leaves.get(path)
            if not isinstance(st, ShardedTensorData) or st.size != first.size or st.dtype != first.dtype:
                raise IncompleteCheckpointError(f"{self.files[r]}: {key_of(path)!r} should be a {first.dtype} "
                                                f"ShardedTensor of size {list(first.size)}, as in rank 0's file")
            chunks += [Chunk(b.offsets, b.sizes, t.span, t.strides) for b, t in st.local]
        entry = TensorEntry(key_of(path), path, first.dtype, first.size, tuple(chunks))
        entry.validate()
        return entry

"""LOCAL: FSDP1 ``LOCAL_STATE_DICT`` checkpoints, one ``torch.save`` file per rank.

Each rank's file holds, per FSDP unit, a 1-D ShardedTensor ``<prefix>_flat_param`` with that rank's slice of
the unit's flat parameter, and the buffers (the same on every rank). With ``use_orig_params=True`` it also
holds every original parameter as a 1-D view of its part of that slice (empty where the rank holds none of
it). The flat layout (:mod:`ckptkit.formats.local.layout`) maps the slices back to the original parameters: the
manifest lists ``layers.0.attn.weight`` with chunks that point straight into the rank files. A parameter
that straddles ranks gets chunks from each, and a slice that starts or ends mid-row becomes up to
``2 * ndim - 1`` boxes (:func:`~ckptkit.formats.local.layout.range_boxes`).

Rank files are found by name: a group of ``.pt``/``.pth``/``.bin``/``.ckpt`` files whose names differ in one
run of digits counting 0..N-1 (``rank0.pt``, ``model_rank_3.pt``, ``local_1.bin``, ``__2.pt``), and whose
rank-0 file pickles a ShardedTensor. ``rank_files="shard_{rank}.pt"`` names them explicitly: a file name in
which ``{rank}`` stands for the decimal rank (leading zeros allowed when reading).

The layout comes from ``flat_layout.json`` (ckptkit writes it beside every LOCAL checkpoint), else it is
derived from ``model=`` and ``auto_wrap=``. A rank file may nest the model state dict
(``{"model": ..., "optim": ..., "step": ...}``). An ``optimizer.state_dict()`` saved beside it (state keyed by
the index of a flat parameter, or with ``use_orig_params`` of an original parameter, holding this rank's
part) is read as per-parameter state keyed by name, as ``FSDP.optim_state_dict`` names it under
``FULL_STATE_DICT``, and flattened again on writing. Every other entry is taken from rank 0's file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...codecs.sharded_tensor import ShardBox, ShardedTensorData, sharded_tensor, sharded_tensor_globals
from ...codecs.torchzip_read import PartsTensor, archive_parts, is_archive, read_archive
from ...core.tree import flatten, unflatten
from ...core.dtypes import DType
from ...errors import FormatError, IncompleteCheckpointError, UsageError
from .layout import FLAT_PARAM, LAYOUT_FILE, FlatLayout, FlatParam, FlatUnit, derive_layout, range_boxes
from ...core.manifest import Chunk, Format, Manifest, ObjectEntry, Path_, Span, TensorEntry, TensorRef, key_of
from ...core.plan import FilePlan, Literal, Part, Region, WritePlan
from ..base import FormatIO, WriteOptions, cast_for, regions_in
from ..full import SUFFIXES

__all__ = ["DEFAULT_RANK_FILES", "LocalIO", "LocalManifest", "LocalOptions", "is_rank_file", "output_layout"]

DEFAULT_RANK_FILES = "rank{rank}.pt"
_RANK = "{rank}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalOptions:
    """How to find and interpret a LOCAL checkpoint, and which layout to write one with."""

    rank_files: str | None = None
    """File name pattern with ``{rank}``, e.g. ``shard_{rank}.pt``; None finds rank files by their names."""
    model: str | None = None
    """``package.module:factory`` building the model, to derive the flat layout where no sidecar has it."""
    auto_wrap: str = "none"
    """The wrap policy FSDP was given: ``none``, ``size:<min_num_params>`` or ``block:<module.path:Class>``."""
    use_orig_params: bool | None = None
    """How FSDP wrapped the model; None tries both against a checkpoint's sizes, and means False for output."""

    def __post_init__(self) -> None:
        if self.rank_files is not None:
            _pattern(self.rank_files)


@dataclass(frozen=True)
class LocalManifest(Manifest):
    """A LOCAL checkpoint's manifest, with the flat layout it was read with, so it can be laid out again."""

    layout: FlatLayout | None = None
    rank_files: str = DEFAULT_RANK_FILES


def output_layout(manifest: Manifest, options: LocalOptions, world_size: int) -> FlatLayout | None:
    """The layout to write ``manifest`` as LOCAL with, when it does not carry one: derived from
    ``options.model`` (this imports torch). None where the manifest's own serves or no model is given."""
    if isinstance(manifest, LocalManifest) or options.model is None:
        return None
    return derive_layout(options.model, options.auto_wrap, world_size=world_size,
                         use_orig_params=bool(options.use_orig_params))


def _pattern(pattern: str) -> re.Pattern:
    if pattern.count(_RANK) != 1 or "/" in pattern or "\\" in pattern:
        raise UsageError(f"--rank-files {pattern!r}: expected a file name with exactly one {_RANK}, e.g. shard_{_RANK}.pt")
    head, tail = pattern.split(_RANK)
    return re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))


def is_rank_file(path: Path) -> bool:
    """Whether ``path`` is a ``torch.save`` file whose pickle names ShardedTensor: one rank's slice of a LOCAL
    checkpoint, unreadable on its own."""
    return is_archive(str(path)) and _pickle_names(path, (b"ShardedTensor",))


def _starts_local_group(path: Path) -> bool:
    """Whether ``path`` can be rank 0 of a LOCAL checkpoint: a ShardedTensor slice or, under NO_SHARD, a
    whole state dict whose metadata names FSDP1's wrapper (on its own, such a file is plain FULL)."""
    return is_archive(str(path)) and _pickle_names(path, (b"ShardedTensor", b"_fsdp_wrapped_module"))


def _pickle_names(path: Path, words: tuple[bytes, ...]) -> bool:
    """Whether the archive's pickle contains any of ``words`` (read as bytes; nothing is unpickled)."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = next((n for n in z.namelist() if n.endswith("data.pkl") and n.count("/") <= 1), None)
            data = z.read(pkl) if pkl is not None else b""
            return any(w in data for w in words)
    except (OSError, zipfile.BadZipFile):
        return False


def _groups(root: Path) -> dict[str, list[Path]]:
    """Name templates (``rank{rank}.pt``) whose files count ranks 0..N-1, each with its files in rank order."""
    by_template: dict[str, dict[int, Path]] = {}
    for f in sorted(root.iterdir()):
        if f.is_file() and f.name.endswith(SUFFIXES):
            for m in re.finditer(r"\d+", f.name):
                template = f.name[:m.start()] + _RANK + f.name[m.end():]
                by_template.setdefault(template, {}).setdefault(int(m.group()), f)
    return {t: [files[r] for r in range(len(files))] for t, files in by_template.items()
            if sorted(files) == list(range(len(files)))}


def _local_groups(root: Path) -> dict[str, list[Path]]:
    return {t: fs for t, fs in _groups(root).items()
            if (len(fs) > 1 and _starts_local_group(fs[0])) or is_rank_file(fs[0])}


def _rank_files(root: Path, pattern: str | None) -> tuple[str, list[Path]]:
    if pattern is not None:
        rx = _pattern(pattern)
        found = {int(m.group(1)): f for f in sorted(root.iterdir()) if (m := rx.fullmatch(f.name))}
        if not found:
            raise IncompleteCheckpointError(f"{root}: no file matches --rank-files {pattern!r}")
        missing = sorted(set(range(max(found) + 1)) - set(found))
        if missing:
            raise IncompleteCheckpointError(f"{root}: the rank files {pattern!r} of ranks {missing} are missing "
                                            f"(found {len(found)} files up to rank {max(found)})")
        return pattern, [found[r] for r in range(len(found))]
    local = _local_groups(root)
    if len(local) != 1:
        found = ", ".join(sorted(local)) or "no per-rank torch.save files holding a ShardedTensor"
        raise FormatError(f"{root}: cannot tell which files are the LOCAL rank files (found {found}); "
                          f"name them with --rank-files, e.g. --rank-files 'rank{_RANK}.pt'")
    return next(iter(local.items()))


class LocalIO(FormatIO):
    format = Format.LOCAL

    def __init__(self, options: LocalOptions | None = None) -> None:
        self.options = options or LocalOptions()

    @classmethod
    def detect(cls, path: Path) -> bool:
        return path.is_dir() and bool(_local_groups(path))

    def read(self, path: Path) -> Manifest:
        root = path.absolute()
        template, files = _rank_files(root, self.options.rank_files)
        world = len(files)
        ranks = [dict(flatten(read_archive(str(f), extra_globals=sharded_tensor_globals(str(f))), _is_leaf))
                 for f in files]
        flats = [p for p, v in ranks[0].items() if _is_flat(p, v)]
        parents = {p[:-1] for p in flats}
        if not flats:
            return self._read_replicated(root, template, files, ranks)
        if len(parents) != 1:
            raise FormatError(f"{files[0]}: flat parameters sit under several keys {sorted(map(key_of, parents))}; "
                              "ckptkit reads one FSDP model per checkpoint")
        shards = {p[-1]: [_rank_leaf(ranks[r], p, files[r], r, world) for r in range(world)] for p in flats}
        layout, source = self._layout(root, shards, world)
        _check_layout(layout, shards, world, files)
        reader = _Reader(layout, next(iter(parents)), files, ranks)
        details = (("rank files", template), ("flat layout", source),
                   ("use_orig_params", str(layout.use_orig_params).lower()), ("flat units", str(len(layout.units))))
        others = sorted({f.name for f in root.iterdir() if f.is_file()} - {f.name for f in files} - {LAYOUT_FILE})
        if others:
            details += (("not read", ", ".join(others)),)
        return LocalManifest(Format.LOCAL, str(root), tuple(reader.tensors), tuple(reader.objects), world, details,
                             layout=layout, rank_files=template)

    def _read_replicated(self, root: Path, template: str, files: list[Path], ranks: list[dict]) -> Manifest:
        """NO_SHARD: FSDP1 keeps no flat parameter in the state dict, and every rank saves it whole."""
        leaves = ranks[0]
        if any(isinstance(v, ShardedTensorData) for v in leaves.values()):
            raise FormatError(f"{files[0]}: ShardedTensors but no '{FLAT_PARAM}'; not an FSDP1 LOCAL_STATE_DICT file")
        shape = lambda leaves: {p: (v.dtype, v.shape) if isinstance(v, TensorRef) else None for p, v in leaves.items()}  # noqa: E731
        for f, other in zip(files[1:], ranks[1:]):
            if shape(other) != shape(leaves):
                raise FormatError(f"{f}: holds other entries than {files[0].name}; NO_SHARD ranks hold the same state")
        details = [("rank files", template),
                   ("sharding", f"NO_SHARD: every rank holds every parameter whole; {files[0].name} is read")]
        optims = {p[:1] for p in leaves if _is_flat_optim(leaves, p[:1])}
        tensors, objects = [], []
        if optims:
            layout, source = self._replicated_layout(root, leaves, optims)
            if layout is None:
                details.append(("optimizer state", f"carried as saved, per {source}"))
            else:
                details.append(("flat layout", source))
                for top in optims:
                    _unflatten_replicated_optim(top, leaves, layout, files[0], tensors, objects)
                leaves = {p: v for p, v in leaves.items() if p[:1] not in optims}
        tensors += [v.as_entry(p) for p, v in leaves.items() if isinstance(v, TensorRef)]
        objects += [ObjectEntry(key_of(p), p, v) for p, v in leaves.items() if not isinstance(v, TensorRef)]
        return LocalManifest(Format.LOCAL, str(root), tuple(tensors), tuple(objects), len(files), tuple(details),
                             rank_files=template)

    def _replicated_layout(self, root: Path, leaves: dict, optims: set) -> tuple[FlatLayout | None, str]:
        """The layout that names a NO_SHARD optimizer's parameter indices, or None and why there is none."""
        sidecar = root / LAYOUT_FILE
        if sidecar.is_file():
            return FlatLayout.from_json(sidecar.read_bytes(), where=str(sidecar)), LAYOUT_FILE
        o = self.options
        if o.model is None:
            return None, f"parameter index (no {LAYOUT_FILE} and no --model to name the indices)"
        top = next(iter(optims))
        for uop in [o.use_orig_params] if o.use_orig_params is not None else [False, True]:
            layout = derive_layout(o.model, o.auto_wrap, world_size=1, use_orig_params=uop)
            if _fits(layout, _below(leaves, (*top, "state"))):
                return layout, f"derived from {o.model} (auto-wrap {o.auto_wrap})"
        raise FormatError(f"{root}: the optimizer state fits neither use_orig_params layout of {o.model} "
                          f"(auto-wrap {o.auto_wrap}); check --model and --auto-wrap")

    def _layout(self, root: Path, shards: dict[str, list[ShardedTensorData]], world: int) -> tuple[FlatLayout, str]:
        sidecar = root / LAYOUT_FILE
        if sidecar.is_file():
            return FlatLayout.from_json(sidecar.read_bytes(), where=str(sidecar)), LAYOUT_FILE
        o = self.options
        if o.model is None:
            raise UsageError(f"{root}: this LOCAL checkpoint has no {LAYOUT_FILE}, so which parameters its flat "
                             "parameters hold is unknown; provide --model package.module:factory (with --auto-wrap) "
                             f"or a {LAYOUT_FILE}")
        # The saved sizes tell use_orig_params apart: with it, FSDP pads (alignment and world size).
        for uop in [o.use_orig_params] if o.use_orig_params is not None else [False, True]:
            layout = derive_layout(o.model, o.auto_wrap, world_size=world, use_orig_params=uop)
            if all(u.key in shards and shards[u.key][0].size == (layout.total(u, world),) for u in layout.units):
                break
        return layout, f"derived from {o.model} (auto-wrap {o.auto_wrap})"  # _check_layout names any mismatch

    def plan(self, manifest: Manifest, options: WriteOptions) -> WritePlan:
        layout = options.flat_layout or (manifest.layout if isinstance(manifest, LocalManifest) else None)
        if layout is None:
            raise UsageError(f"{manifest.root}: writing LOCAL needs the model's flat-parameter layout; pass --model "
                             "package.module:factory with --auto-wrap (and --use-orig-params if FSDP wraps the model "
                             "with use_orig_params=True)")
        pattern = options.rank_files or (manifest.rank_files if isinstance(manifest, LocalManifest) else DEFAULT_RANK_FILES)
        _pattern(pattern)
        writer = _Writer(manifest, layout, options.world_size, options.cast)
        files = []
        for rank in range(options.world_size):
            name = pattern.replace(_RANK, str(rank))
            files.append(FilePlan(name, archive_parts(writer.rank_tree(rank), name=os.path.splitext(name)[0])))
        files.append(FilePlan(LAYOUT_FILE, (Literal(layout.to_json()),)))
        return WritePlan(tuple(files))


# --------------------------------------------------------------------------------------------------------
# Reading


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


def _check_layout(layout: FlatLayout, shards: dict[str, list[ShardedTensorData]], world: int, files: list[Path]) -> None:
    """The flat parameters in the files are the layout's units, of its sizes and split; else one
    :class:`FormatError` lists the differences."""
    units = {u.key: u for u in layout.units}
    problems = [f"{k!r} is in the rank files but not in the layout" for k in shards if k not in units]
    problems += [f"layout unit {k!r} is not in the rank files" for k in units if k not in shards]
    for key in (k for k in units if k in shards):
        u, want = units[key], layout.total(units[key], world)
        for r, st in enumerate(shards[key]):
            if st.size != (want,) or st.dtype != shards[key][0].dtype:
                problems.append(f"{files[r].name}: {key!r} is {st.dtype} of size {list(st.size)}, the layout "
                                f"(use_orig_params={str(layout.use_orig_params).lower()}) gives "
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


def _pieces(param: FlatParam, ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int, int]]:
    """``(rank, start, stop)``: which of ``param``'s flattened elements each rank's flat slice holds."""
    out = []
    for r, (lo, hi) in enumerate(ranges):
        a, b = max(lo, param.offset), min(hi, param.end)
        if a < b:
            out.append((r, a - param.offset, b - param.offset))
    return out


def _param_entry(path: Path_, p: FlatParam, dtype: DType, ranges: tuple[tuple[int, int], ...],
                 locate: Callable[[int, int], tuple[str, int]]) -> TensorEntry:
    """``p`` (or a state of it) as chunks: ``locate(rank, start)`` says where, in which file, the rank's part
    starting at ``p``'s flattened element ``start`` begins."""
    chunks = []
    for r, a, b in _pieces(p, ranges):
        file, offset = locate(r, a)
        for offsets, sizes in range_boxes(p.shape, a, b):
            n = _numel(sizes) * dtype.itemsize
            chunks.append(Chunk(offsets, sizes, Span(file, offset, n)))
            offset += n
    entry = TensorEntry(key_of(path), path, dtype, p.shape, tuple(chunks))
    entry.validate()
    return entry


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _below(leaves: dict, prefix: Path_) -> dict[Any, dict[Path_, Any]]:
    """The leaves under ``prefix``, grouped by the path element right below it: ``{k: {rest of path: leaf}}``."""
    out: dict = {}
    n = len(prefix)
    for path, leaf in leaves.items():
        if path[:n] == prefix and len(path) > n:
            out.setdefault(path[n], {})[path[n + 1:]] = leaf
    return out


def _is_flat_optim(leaves: dict, top: Path_) -> bool:
    """An ``optimizer.state_dict()``: ``state`` keyed by int parameter indices, ``param_groups`` listing them."""
    groups = _below(leaves, (*top, "param_groups"))
    return (bool(groups) and all(isinstance(k, int) for k in _below(leaves, (*top, "state")))
            and all(isinstance(g.get(("params",)), list) and all(isinstance(i, int) for i in g[("params",)])
                    for g in groups.values()))


def _fits(layout: FlatLayout, state: dict[Any, dict[Path_, Any]]) -> bool:
    """Whether NO_SHARD optimizer ``state`` ({index: {name: leaf}}) has the shapes ``layout`` gives its indices."""
    slots = layout.param_order if layout.use_orig_params else tuple(u.key for u in layout.units)
    for i, per in state.items():
        if not 0 <= i < len(slots):
            return False
        want = (next(p.shape for u in layout.units for p in u.params if p.fqn == slots[i]) if layout.use_orig_params
                else (layout.unit(slots[i]).params[-1].end,))
        if any(isinstance(v, TensorRef) and v.shape and v.shape != want for v in per.values()):
            return False
    return True


def _unflatten_replicated_optim(top: Path_, leaves: dict, layout: FlatLayout, file: Path,
                                tensors: list[TensorEntry], objects: list[ObjectEntry]) -> None:
    """A NO_SHARD ``optimizer.state_dict()`` as state per original parameter, keyed by its name.

    With use_orig_params the state is already per original parameter, by index; without, each flat
    parameter's state is one vector over the whole (unsharded, unpadded) flat parameter, cut here at each
    parameter's offset.
    """
    uop = layout.use_orig_params
    slots = layout.param_order if uop else tuple(u.key for u in layout.units)
    if not _fits(layout, _below(leaves, (*top, "state"))):
        raise FormatError(f"{file}: optimizer state {key_of(top)!r} does not fit the flat layout "
                          f"({len(slots)} {'parameters' if uop else 'flat parameters'})")
    at = {p.fqn: p for u in layout.units for p in u.params}
    for i, per in _below(leaves, (*top, "state")).items():
        params = [slots[i]] if uop else [p.fqn for p in layout.unit(slots[i]).params]
        for fqn in params:
            for name, v in per.items():
                path = (*top, "state", fqn, *name)
                if not isinstance(v, TensorRef):
                    objects.append(ObjectEntry(key_of(path), path, v))
                elif uop or not v.shape:  # whole tensors: per-parameter state, or a step counter
                    tensors.append(v.as_entry(path))
                else:
                    p = at[fqn]
                    span = Span(v.span.file, v.span.offset + p.offset * v.dtype.itemsize, p.numel * v.dtype.itemsize)
                    tensors.append(TensorEntry(key_of(path), path, v.dtype, p.shape,
                                               (Chunk((0,) * len(p.shape), p.shape, span),)))
    for gi, group in _below(leaves, (*top, "param_groups")).items():
        for sub, value in group.items():
            if sub == ("params",):
                value = [slots[i] for i in value] if uop else [p.fqn for i in value for p in layout.unit(slots[i]).params]
            path = (*top, "param_groups", gi, *sub)
            objects.append(ObjectEntry(key_of(path), path, value))
    for path, leaf in leaves.items():
        if path[:1] != top or path[1:2] in (("state",), ("param_groups",)):
            continue
        if isinstance(leaf, TensorRef):
            tensors.append(leaf.as_entry(path))
        else:
            objects.append(ObjectEntry(key_of(path), path, leaf))


class _Reader:
    """The tensors and objects of a LOCAL manifest, from each rank file's leaves (``{path: leaf}``)."""

    def __init__(self, layout: FlatLayout, parent: Path_, files: list[Path], ranks: list[dict]) -> None:
        self.layout, self.parent, self.files, self.ranks = layout, parent, files, ranks
        self.tensors: list[TensorEntry] = []
        self.objects: list[ObjectEntry] = []
        self.ranges = {u.key: layout.shard_ranges(u, len(files)) for u in layout.units}
        views = {p.fqn for u in layout.units for p in u.params} | {a for u in layout.units for a, _ in u.shared}
        # An optimizer saved beside a nested model state dict: {"model": ..., "optim": optimizer.state_dict()}.
        tops = {p[:1] for p in ranks[0] if parent and p[:1] != parent[:1]}
        optims = {top for top in tops if _is_flat_optim(ranks[0], top)}
        done: set[Path_] = set()
        for path, leaf in ranks[0].items():
            if path[:1] in optims:
                if path[:1] not in done:
                    done.add(path[:1])
                    self._optimizer(path[:1])
            elif _is_flat(path, leaf):
                self._unit(layout.unit(path[-1]))
            elif path[:-1] == parent and path[-1] in views:
                continue  # use_orig_params: a view of this rank's part of a flat parameter, read through that
            elif isinstance(leaf, ShardedTensorData):
                self.tensors.append(self._sharded(path))
            elif isinstance(leaf, TensorRef):
                self.tensors.append(leaf.as_entry(path))
            else:
                self.objects.append(ObjectEntry(key_of(path), path, leaf))

    def _unit(self, unit: FlatUnit) -> None:
        path = (*self.parent, unit.key)
        dtype, ranges = self.ranks[0][path].dtype, self.ranges[unit.key]
        slices = [leaves[path].local[0][1] if leaves[path].local else None for leaves in self.ranks]

        def locate(r: int, start: int, p: FlatParam) -> tuple[str, int]:
            span = slices[r].span
            return span.file, span.offset + (p.offset + start - ranges[r][0]) * dtype.itemsize

        by_fqn = {p.fqn: _param_entry((*self.parent, p.fqn), p, dtype, ranges, lambda r, a, p=p: locate(r, a, p))
                  for p in unit.params}
        for alias, fqn in unit.shared:  # tied weights: the full state dict holds both names
            by_fqn[alias] = dataclasses.replace(by_fqn[fqn], key=key_of((*self.parent, alias)), path=(*self.parent, alias))
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

    def _optimizer(self, top: Path_) -> None:
        """Each rank's ``optimizer.state_dict()`` as state per original parameter, keyed by its name."""
        layout = self.layout
        slots = layout.param_order if layout.use_orig_params else tuple(u.key for u in layout.units)
        owner = {p.fqn: (u, p) for u in layout.units for p in u.params}
        groups = _below(self.ranks[0], (*top, "param_groups"))
        for g in groups.values():
            ids = g[("params",)]
            if not all(0 <= i < len(slots) for i in ids):
                raise FormatError(f"{self.files[0]}: {key_of(top)!r} param_groups name parameter indices {ids}, but the "
                                  f"layout has {len(slots)} {'parameters' if layout.use_orig_params else 'flat parameters'}")
        state = [_below(leaves, (*top, "state")) for leaves in self.ranks]
        for i, slot in enumerate(slots):
            per_rank = [s.get(i, {}) for s in state]
            names = list(dict.fromkeys(n for s in per_rank for n in s))
            unit, params = (owner[slot][0], [owner[slot][1]]) if layout.use_orig_params else \
                (layout.unit(slot), list(layout.unit(slot).params))
            for p in params:
                for name in names:
                    self._state(top, unit, p, name, [s.get(name) for s in per_rank])
        for gi, g in groups.items():
            for sub, value in g.items():
                if sub == ("params",):
                    value = [slots[i] for i in value] if layout.use_orig_params else \
                        [p.fqn for i in value for p in layout.unit(slots[i]).params]
                path = (*top, "param_groups", gi, *sub)
                self.objects.append(ObjectEntry(key_of(path), path, value))
        for path, leaf in self.ranks[0].items():
            if path[:1] == top and path[1:2] not in (("state",), ("param_groups",)):
                self.objects.append(ObjectEntry(key_of(path), path, leaf))

    def _state(self, top: Path_, unit: FlatUnit, p: FlatParam, name: Path_, values: list[Any]) -> None:
        path = (*top, "state", p.fqn, *name)
        first = next(v for v in values if v is not None)
        if not (isinstance(first, TensorRef) and first.shape):  # step counters: the same on every rank
            if isinstance(first, TensorRef):
                self.tensors.append(first.as_entry(path))
            else:
                self.objects.append(ObjectEntry(key_of(path), path, first))
            return
        ranges, uop = self.ranges[unit.key], self.layout.use_orig_params
        for r, a, b in _pieces(p, ranges):
            t = values[r]
            # A rank's state is its whole flat slice (padded to the chunk size); with use_orig_params, just
            # its part of this parameter.
            need = (b - a) if uop else ranges[r][1] - ranges[r][0]
            if (not isinstance(t, TensorRef) or t.dtype != first.dtype or len(t.shape) != 1 or t.strides is not None
                    or t.shape[0] < need or (uop and t.shape[0] != need) or t.span.length < need * t.dtype.itemsize):
                found = f"{t.dtype} {list(t.shape)}" if isinstance(t, TensorRef) else type(t).__name__
                raise FormatError(f"{self.files[r]}: optimizer state {key_of(name)!r} of {p.fqn!r} is {found}; "
                                  f"expected a 1-D {first.dtype} tensor of {need}{'' if uop else ' or more'} elements")

        def locate(r: int, start: int) -> tuple[str, int]:
            span = values[r].span
            skip = 0 if uop else p.offset + start - ranges[r][0]
            return span.file, span.offset + skip * first.dtype.itemsize

        self.tensors.append(_param_entry(path, p, first.dtype, ranges, locate))


# --------------------------------------------------------------------------------------------------------
# Writing


def _zeros(n: int, dtype: DType) -> list[Part]:
    return [Literal(bytes(n * dtype.itemsize))] if n > 0 else []


class _Writer:
    """Each rank's LOCAL state: flat slices (and, with use_orig_params, views) from the manifest's tensors."""

    def __init__(self, manifest: Manifest, layout: FlatLayout, world: int, cast: DType | None) -> None:
        self.manifest, self.layout, self.world, self.cast = manifest, layout, world, cast
        self.ranges = {u.key: layout.shard_ranges(u, world) for u in layout.units}
        self.owner = {p.fqn: (u, p) for u in layout.units for p in u.params}
        self.alias = {a: fqn for u in layout.units for a, fqn in u.shared}
        self.parent = self._model_parent()
        by_path = {t.path: t for t in manifest.tensors}
        self.params = {fqn: by_path[(*self.parent, fqn)] for fqn in self.owner}
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
        parents = {p[:-1] for p in paths if isinstance(p[-1], str) and p[-1] in self.owner}
        for parent in sorted(parents, key=len):
            if all((*parent, n) in paths for n in self.owner):
                return parent
        have = [t.key for t in self.manifest.tensors[:4]]
        raise FormatError(f"{self.manifest.root}: no tensor for the flat layout's parameter "
                          f"{next(iter(self.owner))!r}{' and others' if len(self.owner) > 1 else ''} (the checkpoint has "
                          f"{have}...); the layout must be the one of this model, keyed as its state dict is")

    def _is_named_optim(self, o: ObjectEntry) -> bool:
        """``param_groups`` of an optimizer state keyed by parameter name (FSDP's full optim state dict)."""
        p = o.path
        if not (len(p) == 4 and p[:1] != self.parent[:1] and p[1] == "param_groups" and p[3] == "params"):
            return False
        names = o.load()
        return isinstance(names, list) and all(isinstance(n, str) and n in self.owner for n in names)

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
            parts += [Region(t, o, s, cast_for(t.dtype, self.cast)) for o, s in range_boxes(p.shape, a - p.offset, b - p.offset)]
            at = b
        return parts + _zeros(hi - at, dtype)  # world-size padding at the end

    def _view(self, fqn: str, rank: int, entry_of: Callable[[FlatParam], TensorEntry], dtype: DType) -> PartsTensor:
        """This rank's part of a parameter (use_orig_params), flattened."""
        unit, p = self.owner[fqn]
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
            if t.path[:-1] == self.parent and (name in self.owner or name in self.alias):
                unit = self.owner[self.alias.get(name, name)][0]
                if unit.key not in placed:
                    placed.add(unit.key)
                    items += self._unit_items(unit, rank)
            else:
                items.append((t.path, Region.whole(t, cast_for(t.dtype, self.cast))))
        for o in self.manifest.objects:
            if o.path[:1] not in self.optims:
                items.append((o.path, regions_in(o.load(), self.cast)))
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
                unit, p = self.owner[fqn]
                lo, hi = self.ranges[unit.key][rank]
                if fqn in by_param and max(lo, p.offset) < min(hi, p.end):  # torch keeps no state for empty parts
                    state[i] = self._state_of(by_param[fqn], lambda name, dtype, fqn=fqn: self._view(
                        fqn, rank, lambda q: by_param[q.fqn][name], dtype))
        else:
            for i, unit in enumerate(layout.units):
                have = [p.fqn for p in unit.params if p.fqn in by_param]
                if not have:
                    continue
                if len(have) != len(unit.params):
                    missing = [p.fqn for p in unit.params if p.fqn not in by_param]
                    raise FormatError(f"{self.manifest.root}: optimizer state has no entry for {missing[:3]}, which share "
                                      f"flat parameter {unit.key!r} with parameters that have one")
                lo, hi = self.ranges[unit.key][rank]
                # torch's per-rank flat state is the padded chunk: every rank holds ``step`` elements.
                step = -(-layout.total(unit, self.world) // self.world)

                def flat(name: Path_, dtype: DType, unit: FlatUnit = unit, lo: int = lo, hi: int = hi, step: int = step) -> PartsTensor:
                    parts = self._parts(unit, lo, hi, lambda q: by_param[q.fqn][name], dtype)
                    return PartsTensor(dtype, tuple(parts + _zeros(step - (hi - lo), dtype)))

                state[i] = self._state_of(by_param[have[0]], flat)
        slots = {fqn: i for i, fqn in enumerate(layout.param_order)} if layout.use_orig_params else \
            {p.fqn: i for i, u in enumerate(layout.units) for p in u.params}
        groups: dict[int, list[tuple[Path_, Any]]] = {}
        rest: list[tuple[Path_, Any]] = []
        for o in self.manifest.objects:
            if o.path[:2] == (*top, "param_groups"):
                value = o.load()
                if o.path[3:] == ("params",):
                    value = list(dict.fromkeys(slots[n] for n in value))
                groups.setdefault(o.path[2], []).append((o.path[3:], value))
            elif o.path[:1] == top and o.path[1:2] != ("state",):
                rest.append((o.path[1:], regions_in(o.load(), self.cast)))
        out = {"state": state, "param_groups": [unflatten(groups[g]) for g in sorted(groups)]}
        out.update(unflatten(rest) if rest else {})
        return out

    def _named_state(self, top: Path_) -> dict[str, dict[Path_, TensorEntry | ObjectEntry]]:
        """The optimizer state under ``top``, per parameter name, checked against the layout."""
        by_param: dict[str, dict[Path_, TensorEntry | ObjectEntry]] = {}
        for e in (*self.manifest.tensors, *self.manifest.objects):
            if e.path[:2] != (*top, "state") or len(e.path) < 4:
                continue
            fqn = e.path[2]
            if fqn not in self.owner:
                raise FormatError(f"{self.manifest.root}: optimizer state {e.key!r} is for {fqn!r}, which the flat "
                                  "layout does not hold")
            shape = self.owner[fqn][1].shape
            if isinstance(e, TensorEntry) and e.shape and e.shape != shape:
                raise FormatError(f"{self.manifest.root}: optimizer state {e.key!r} has shape {list(e.shape)}, its "
                                  f"parameter {list(shape)}; only states shaped like the parameter can be sharded")
            by_param.setdefault(fqn, {})[e.path[3:]] = e
        return by_param

    def _state_of(self, entries: dict[Path_, Any], sliced: Callable[[Path_, DType], PartsTensor]) -> dict:
        """One slot's state: tensors shaped like the parameter are sliced, step counters copied."""
        out: list[tuple[Path_, Any]] = []
        for name, e in entries.items():
            if isinstance(e, TensorEntry) and e.shape:
                out.append((name, sliced(name, cast_for(e.dtype, self.cast) or e.dtype)))
            elif isinstance(e, TensorEntry):
                out.append((name, Region.whole(e, cast_for(e.dtype, self.cast))))
            else:
                out.append((name, regions_in(e.load(), self.cast)))
        return unflatten(out)

"""Megatron-LM's legacy ``torch`` checkpoint format (``--ckpt-format torch``), read as one model.

Megatron-LM's ``save_checkpoint`` writes, for a run at tensor-parallel size T and pipeline size P::

    latest_checkpointed_iteration.txt          the iteration saved last ("10"), or "release"
    iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt

each rank file a ``torch.save`` of ``{args, checkpoint_version, iteration, model, rng_state, optimizer, ...}``
(``_PPP`` only when P > 1). ``model`` is that rank's ``state_dict_for_save_checkpoint()``: per-layer keys
numbered within its pipeline stage (``decoder.layers.0.…``), and each tensor-parallel weight as that rank's
shard. This reader joins them into the global model and presents it as megatron-core's ``torch_dist`` does:
layer-stacked keys (``decoder.layers.self_attention.linear_qkv.weight [layers, rows, hidden]``), so that the
Megatron presets map it. Every chunk of a joined tensor is a byte range of one rank file; nothing is copied.

- Tensor-parallel shards join along the dim megatron-core's layers split: dim 0 for the column-parallel
  ``linear_qkv`` and ``linear_fc1`` and the vocab-parallel ``embedding.word_embeddings`` and ``output_layer``
  (vocabulary padded as ``args.padded_vocab_size``), dim 1 for the row-parallel ``linear_proj`` and
  ``linear_fc2``; norms and the row-parallel layers' biases are replicated (rank 0's are read). A gated
  ``linear_fc1`` (SwiGLU) holds on each rank its gate rows, then its up rows: the global tensor is every
  rank's gate rows, then every rank's up rows, as ``torch_dist`` stores it.
- Pipeline stages' layers are renumbered by ``args.num_layers / args.pipeline_model_parallel_size``.
- ``args``, ``iteration`` and ``checkpoint_version`` are kept; each rank's ``rng_state`` and optimizer state
  (its local shards' state) are left out, and named in the manifest's ``left out`` fact.

Refused, in one line each: a single rank file of a run with T > 1 or P > 1 (it holds a part of each weight);
a missing rank file, or two directories of one rank (``mp_rank_00`` and ``mp_rank_00_000``); uneven or virtual
pipeline stages; expert-parallel rank files; a tensor-parallel tensor whose name has no known split; the layers of
one key saved in different dtypes. A run directory whose tracker names a ``torch_dist`` iteration is pointed at it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...codecs.torchzip_read import read_archive
from ...core.manifest import Chunk, Format, Manifest, ObjectEntry, Span, TensorEntry, TensorRef
from ...core.tree import flatten
from ...errors import FormatError, IncompleteCheckpointError, UsageError
from ..base import ReadOnlyIO, plain_object
from ..run_args import RUN_ARGS_GLOBALS
from .torch_dist import CONFIG

__all__ = ["FILE", "TRACKER", "MegatronLegacyIO", "legacy_args"]

TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_KEPT = ("args", "checkpoint_version", "iteration")
_COLUMN = re.compile(r"(.*\.)?(linear_qkv|linear_fc1)\.(weight|bias)|embedding\.word_embeddings\.weight"
                     r"|output_layer\.weight")
_ROW = re.compile(r"(.*\.)?(linear_proj|linear_fc2)\.weight")
_REPLICATED = re.compile(r".*(layernorm\.(weight|bias)|layer_norm_(weight|bias)|(linear_proj|linear_fc2)\.bias)"
                         r"|embedding\.position_embeddings\.weight|(.*\.)?router\.weight")
_GATED = "gated"


def _rank_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if _RANK_DIR.fullmatch(p.name) and (p / FILE).is_file()]


class MegatronLegacyIO(ReadOnlyIO):
    format = Format.MEGATRON_LEGACY

    @classmethod
    def detect(cls, path: Path) -> bool:
        if path.is_file():
            return path.name == FILE and bool(_RANK_DIR.fullmatch(path.parent.name))
        return path.is_dir() and ((path / TRACKER).is_file() or bool(_rank_dirs(path)))

    def read(self, path: Path) -> Manifest:
        path = path.absolute()
        if path.is_file():
            return _read_rank_file(path)
        if (path / TRACKER).is_file():
            path = _iteration_dir(path)
        return _Join(path, _rank_files(path)).manifest()


def _iteration_dir(root: Path) -> Path:
    tracker = root / TRACKER
    text = tracker.read_text(errors="replace").strip()[:40]
    if text == "release":
        name = "release"
    elif text.isdigit():
        name = f"iter_{int(text):07d}"
    else:
        raise FormatError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
    if (root / name / CONFIG).is_file():
        raise UsageError(f"{root} is a Megatron-LM run directory whose iteration {text} ({name}) is a megatron-core "
                         f"torch_dist checkpoint; pass {root / name}")
    if not (root / name).is_dir() or not _rank_dirs(root / name):
        raise IncompleteCheckpointError(f"{tracker} names iteration {text}, but {root / name} holds no "
                                        f"mp_rank_*/{FILE}")
    return root / name


def _rank_files(root: Path) -> dict[tuple[int, int], Path]:
    """The rank files of the iteration directory ``root`` by (tensor rank, pipeline rank); two directories of
    one rank (``mp_rank_00`` and ``mp_rank_00_000``) are refused, naming both."""
    files: dict[tuple[int, int], Path] = {}
    for d in sorted(_rank_dirs(root)):
        at = _coordinates(d)
        if at in files:
            raise FormatError(f"{root}: {files[at].parent.name} and {d.name} are both tensor rank {at[0]}, "
                              f"pipeline rank {at[1]}; remove the one that is not of this run")
        files[at] = d / FILE
    return files


def _coordinates(rank_dir: Path) -> tuple[int, int]:
    m = _RANK_DIR.fullmatch(rank_dir.name)
    assert m is not None
    if m.group(3):
        raise FormatError(f"{rank_dir}: an expert-parallel rank file (mp_rank_TT_PPP_EEE); ckptkit joins "
                          "tensor- and pipeline-parallel legacy checkpoints only")
    return int(m.group(1)), int(m.group(2) or 0)


def _load(file: Path) -> dict:
    tree = read_archive(str(file), extra_globals=RUN_ARGS_GLOBALS)
    if not isinstance(tree, dict) or "args" not in tree:
        raise FormatError(f"{file}: expected Megatron-LM's saved state (a dict with args, model, ...), found "
                          f"{type(tree).__name__}{' without args' if isinstance(tree, dict) else ''}")
    return tree


def _sizes(file: Path, args: Any) -> tuple[int, int]:
    fields = vars(args) if hasattr(args, "__dict__") else {}
    tp, pp = fields.get("tensor_model_parallel_size", 1), fields.get("pipeline_model_parallel_size", 1)
    if not (isinstance(tp, int) and isinstance(pp, int) and tp >= 1 and pp >= 1):
        raise FormatError(f"{file}: args.tensor_model_parallel_size {tp!r:.20} and pipeline_model_parallel_size "
                          f"{pp!r:.20} are not positive counts")
    return tp, pp


def _read_rank_file(file: Path) -> Manifest:
    """A rank file given alone: the whole model where the run had one rank per model, else refused."""
    tree = _load(file)
    tp, pp = _sizes(file, tree["args"])
    if tp > 1 or pp > 1:
        raise UsageError(f"{file} is one rank's file of a Megatron-LM checkpoint saved at tensor-parallel size {tp} "
                         f"and pipeline size {pp} (its args): it holds a part of each weight, not a model; pass "
                         f"the iteration directory {file.parent.parent}")
    return _Join(file.parent.parent, {(0, 0): file}, {(0, 0): tree}).manifest()


def legacy_args(root: Path) -> tuple[Path, Any] | None:
    """The rank file whose ``args`` are read, and those ``args``, of the legacy checkpoint at ``root`` (a
    checkpoint directory, an ``iter_*`` directory or a rank file); None where ``root`` is none.

    Raises:
        FormatError, IncompleteCheckpointError: as :meth:`MegatronLegacyIO.read`.
    """
    if not root.exists() or not MegatronLegacyIO.detect(root):
        return None
    if root.is_dir() and (root / TRACKER).is_file():
        root = _iteration_dir(root)
    files = {} if root.is_file() else _rank_files(root)
    file = files[min(files)] if files else root
    return file, _load(file)["args"]


class _Join:
    """The global model of an iteration directory's rank files, ``files`` by (tensor rank, pipeline rank)
    (``trees``: those already read)."""

    def __init__(self, root: Path, files: dict[tuple[int, int], Path],
                 trees: dict[tuple[int, int], dict] | None = None) -> None:
        self.root, self.files = root, files
        self.trees = {at: (trees or {}).get(at) or _load(f) for at, f in sorted(files.items())}
        self.first = self.trees[min(self.trees)]
        self.args = self.first["args"]
        self.tp, self.pp = _sizes(files[min(files)], self.args)
        self.gated = bool(getattr(self.args, "swiglu", False) or getattr(self.args, "gated_linear_unit", False))
        self.per_stage = self._layers_per_stage()
        missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "")
                   for t in range(self.tp) for p in range(self.pp) if (t, p) not in files]
        if missing or len(files) != self.tp * self.pp:
            raise IncompleteCheckpointError(
                f"{root}: args say tensor-parallel size {self.tp} x pipeline size {self.pp}; "
                + (f"missing {', '.join(missing[:4])}" if missing else f"found {len(files)} rank directories"))

    def _layers_per_stage(self) -> int:
        fields = vars(self.args)
        layers = fields.get("num_layers")
        uneven = [k for k in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                              "num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size",
                              "pipeline_model_parallel_layout") if fields.get(k) is not None]
        if not isinstance(layers, int) or layers % self.pp or uneven:
            found = f"{uneven[0]}={fields[uneven[0]]!r:.30}" if uneven else f"num_layers={layers!r:.20}"
            raise FormatError(f"{self.files[min(self.files)]}: {found} at pipeline size {self.pp}; ckptkit joins "
                              "pipeline stages of num_layers / pipeline size layers each")
        return layers // self.pp

    def manifest(self) -> Manifest:
        parts: dict[str, dict[int | None, dict[int, tuple[Path, TensorRef]]]] = {}
        objects: dict[str, tuple[ObjectEntry, bool]] = {}
        for (t, p), tree in self.trees.items():
            file = self.files[(t, p)]
            if not isinstance(tree.get("model"), dict):
                found = ", ".join(k for k in map(str, tree) if k.startswith("model")) or "no model"
                raise FormatError(f"{file}: expected one 'model' state dict, found {found} (virtual pipeline "
                                  "stages are not supported)")
            for key, layer, leaf in self._leaves(file, p, tree["model"]):
                if isinstance(leaf, TensorRef) and not key.endswith("._extra_state"):
                    parts.setdefault(key, {}).setdefault(layer, {})[t] = (file, leaf)
                    continue
                # A module's _extra_state (TE's FP8 metadata, None without TE) is an object of each rank's.
                name = key if layer is None else f"decoder.layers.{layer}.{key.removeprefix('decoder.layers.')}"
                if t == 0:
                    objects[name] = (plain_object((name,), leaf, str(file)), False)
                elif name in objects and objects[name][0].value != leaf:
                    objects[name] = (objects[name][0], True)
        tensors = [self._tensor(key, by_layer) for key, by_layer in parts.items()]
        first = self.files[min(self.files)]
        top = [plain_object((k,), self.first[k], str(first)) for k in _KEPT if k in self.first]
        return Manifest(Format.MEGATRON_LEGACY, str(self.root), tuple(tensors),
                        (*(o for o, _ in objects.values()), *top), self.tp * self.pp,
                        self._details(objects))

    def _leaves(self, file: Path, stage: int, model: dict) -> Iterator[tuple[str, int | None, Any]]:
        """Each leaf of a rank's model as (key, global layer or None, leaf), layer keys stacked."""
        for path, leaf in flatten(model, lambda v: isinstance(v, TensorRef)):
            key = ".".join(map(str, path))
            m = _LAYER.fullmatch(key)
            if m is None:
                yield key, None, leaf
                continue
            local = int(m.group(1))
            if local >= self.per_stage:
                raise FormatError(f"{file}: {key!r} is layer {local} of a pipeline stage of {self.per_stage} layers")
            yield f"decoder.layers.{m.group(2)}", stage * self.per_stage + local, leaf

    def _details(self, objects: dict[str, tuple[ObjectEntry, bool]]) -> tuple[tuple[str, str], ...]:
        first = self.trees[min(self.trees)]
        left = sorted({str(k) for tree in self.trees.values() for k in tree if k not in (*_KEPT, "model")})
        notes = [f"{', '.join(left)} of each rank file (per-rank state)"] if left else []
        differing = [k for k, (_, differs) in objects.items() if differs]
        if differing:
            notes.append(f"tensor-parallel ranks' own values of {', '.join(differing[:3])}"
                         f"{' and more' if len(differing) > 3 else ''} (rank 0's are kept)")
        optim = sorted({p.name for f in self.files.values() for p in f.parent.iterdir() if p.name != FILE})
        if optim:
            notes.append(f"{', '.join(optim)} beside the rank files")
        details = [("megatron-lm", f"legacy torch format, iteration {first.get('iteration')!r:.20}, tensor-parallel "
                                   f"{self.tp} x pipeline {self.pp} ({len(self.files)} rank files), layers stacked")]
        return (*details, ("left out", "; ".join(notes))) if notes else tuple(details)

    def _tensor(self, key: str, by_layer: dict[int | None, dict[int, tuple[Path, TensorRef]]]) -> TensorEntry:
        if None in by_layer:
            if len(by_layer) > 1:
                raise FormatError(f"{self.root}: {key!r} is both a layer's and the model's")
            shape, chunks = self._joined(key, by_layer[None])
            entry = TensorEntry(key, (key,), by_layer[None][0][1].dtype, shape, tuple(chunks))
        else:
            layers = sorted(n for n in by_layer if n is not None)
            total = self.per_stage * self.pp
            if layers != list(range(total)):
                gone = sorted(set(range(total)) - set(layers))
                raise FormatError(f"{self.root}: {key.replace('layers.', f'layers.{gone[0]}.')!r} is missing: its "
                                  f"other layers have it (layers that differ are not supported yet)")
            joined = [self._joined(f"{key} of layer {n}", by_layer[n]) for n in layers]
            self._one_dtype(key, by_layer)
            shapes = {shape for shape, _ in joined}
            if len(shapes) != 1:
                raise FormatError(f"{self.root}: {key!r} has shapes {sorted(shapes)} across layers; ckptkit stacks "
                                  "layers of one shape")
            chunks = [Chunk((n, *c.offsets), (1, *c.sizes), c.span) for n, (_, cs) in enumerate(joined) for c in cs]
            entry = TensorEntry(key, (key,), by_layer[layers[0]][0][1].dtype, (len(layers), *shapes.pop()),
                                tuple(chunks))
        entry.validate()
        return entry

    def _one_dtype(self, key: str, by_layer: dict[int | None, dict[int, tuple[Path, TensorRef]]]) -> None:
        """Refuse layers of one key saved in different dtypes: a stack has one, and reading a layer's bytes as
        another dtype's would give other values (Megatron-LM's own load casts each into its parameter)."""
        first = by_layer[0][0][1].dtype
        for n, ranks in sorted(by_layer.items(), key=lambda item: item[0] or 0):
            file, ref = ranks[0]
            if ref.dtype != first:
                raise FormatError(f"{file}: {key!r} of layer {n} is {ref.dtype.name} where layer 0's is "
                                  f"{first.name}; ckptkit stacks the layers of a key in one dtype: save them in one "
                                  "dtype (as the model's parameters hold them)")

    def _joined(self, key: str, ranks: dict[int, tuple[Path, TensorRef]]) -> tuple[tuple[int, ...], list[Chunk]]:
        """The global shape of one tensor and its chunks, from its tensor-parallel ranks' shards."""
        file, ref = ranks[min(ranks)]
        if sorted(ranks) != list(range(self.tp)):
            raise IncompleteCheckpointError(f"{self.root}: {key!r} is held by tensor ranks {sorted(ranks)} of "
                                            f"{self.tp}")
        for f, r in ranks.values():
            if r.strides is not None:
                raise FormatError(f"{f}: {key!r} is stored with strides {list(r.strides)}; ckptkit joins "
                                  "row-major shards")
            if (r.shape, r.dtype) != (ref.shape, ref.dtype):
                raise FormatError(f"{f}: {key!r} is {r.dtype.name} {list(r.shape)} where tensor rank 0's is "
                                  f"{ref.dtype.name} {list(ref.shape)}")
        dim = self._split(key.split(" of layer ")[0], file) if self.tp > 1 else None
        if dim is None:
            return ref.shape, [Chunk((0,) * len(ref.shape), ref.shape, ref.span)]
        if dim == _GATED:
            return self._gated(key, file, ranks)
        assert isinstance(dim, int)
        shape = list(ref.shape)
        shape[dim] *= self.tp
        chunks = [Chunk(tuple(t * r.shape[d] if d == dim else 0 for d in range(len(r.shape))), r.shape, r.span)
                  for t, (_, r) in sorted(ranks.items())]
        return tuple(shape), chunks

    def _gated(self, key: str, file: Path, ranks: dict[int, tuple[Path, TensorRef]]) -> tuple[tuple[int, ...],
                                                                                            list[Chunk]]:
        """SwiGLU's ``linear_fc1``: each rank's gate rows go to the global gate half, its up rows to the up half."""
        shape = ranks[0][1].shape
        if not shape or shape[0] % 2:
            raise FormatError(f"{file}: {key!r} of shape {list(shape)} has no gate and up halves")
        half, row = shape[0] // 2, math.prod(shape[1:]) * ranks[0][1].dtype.itemsize
        chunks = []
        for t, (_, r) in sorted(ranks.items()):
            for which in (0, 1):
                span = Span(r.span.file, r.span.offset + which * half * row, half * row)
                chunks.append(Chunk((which * half * self.tp + t * half, *(0,) * (len(shape) - 1)),
                                    (half, *shape[1:]), span))
        return (shape[0] * self.tp, *shape[1:]), chunks

    def _split(self, key: str, file: Path) -> int | str | None:
        name = key.removeprefix("decoder.layers.")
        if _COLUMN.fullmatch(name):
            return _GATED if self.gated and "linear_fc1." in name else 0
        if _ROW.fullmatch(name):
            return 1
        if _REPLICATED.fullmatch(name):
            return None
        raise FormatError(f"{file}: {key!r} has no known tensor-parallel split (column-parallel linear_qkv/"
                          "linear_fc1, row-parallel linear_proj/linear_fc2, vocab-parallel embedding and "
                          "output_layer, replicated norms); ckptkit cannot join it")

"""VERL: the FSDP checkpoints verl's ``FSDPCheckpointManager`` writes, read (not written) without torch.

A verl actor or critic directory holds, per rank R of W (verl 0.9 ``utils/checkpoint/fsdp_checkpoint_manager.py``):

- ``model_world_size_W_rank_R.pt``: ``torch.save(model.state_dict())``, every parameter a DTensor (FSDP2, and
  FSDP1 under ``SHARDED_STATE_DICT`` with a device mesh): ``Shard(0)`` on a 1-D mesh, ``(Replicate(), Shard(0))``
  on verl's 2-D HSDP mesh;
- ``optim_world_size_W_rank_R.pt``: ``optimizer.state_dict()``, whose state is DTensors under FSDP2 and each
  FSDP1 unit's flat-parameter slice under FSDP1;
- ``extra_state_world_size_W_rank_R.pt``: LR scheduler and RNG state (numpy pickles);
- ``fsdp_config.json`` (``{"FSDP_version", "world_size"}``) and ``huggingface/`` (config and tokenizer).

Each DTensor's spec (global shape, mesh, this rank's coordinate, placements) gives the box of the global tensor
its local tensor holds (:mod:`ckptkit.codecs.dtensor`); the boxes of every rank must tile the tensor exactly
once, one replica read per ``Replicate`` mesh dim. The manifest is laid out as ``ckptkit.save`` lays out a
training state: ``model.<fqn>``, and the optimizer as torch's ``get_state_dict`` names it, ``optim.state.<fqn>.*``
with ``param_groups`` listing names, where the parameter order maps indices to names without doubt; otherwise
the state keeps its indices and ``inspect`` says why. FSDP1 optimizer files and ``extra_state`` are left out
and named in the manifest's ``left out`` fact.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ..codecs.dtensor import DTensorData, dtensor_globals
from ..codecs.torchzip_read import read_archive
from ..core.manifest import Chunk, Format, Manifest, ObjectEntry, Path_, TensorEntry, TensorRef, key_of
from ..core.tree import flatten
from ..errors import CheckpointError, FormatError, IncompleteCheckpointError, UsageError
from .base import ReadOnlyIO, plain_object

__all__ = ["VerlIO", "read_verl"]

CONFIG = "fsdp_config.json"
HF_DIR = "huggingface"
_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt")
_ROLES = ("actor", "critic")
_MAX_JSON = 1 << 20


def _is_model_file(path: Path) -> bool:
    m = _FILE.fullmatch(path.name)
    return m is not None and m.group(1) == "model"


def _holds_model_files(path: Path) -> bool:
    return path.is_dir() and any(_is_model_file(p) for p in path.iterdir())


class VerlIO(ReadOnlyIO):
    format = Format.VERL

    @classmethod
    def detect(cls, path: Path) -> bool:
        if path.is_file():
            return bool(_FILE.fullmatch(path.name))  # read() names the directory to pass instead
        return _holds_model_files(path) or any(_holds_model_files(path / role) for role in _ROLES)

    def read(self, path: Path) -> Manifest:
        if path.is_file():
            raise UsageError(f"{path} is one rank's file of a verl checkpoint; pass its directory {path.parent}")
        if not _holds_model_files(path):
            roles = [role for role in _ROLES if _holds_model_files(path / role)]
            raise UsageError(f"{path} is a verl step directory; pass the checkpoint of one role: "
                             + " or ".join(str(path / role) for role in roles))
        return read_verl(path.absolute())


def read_verl(root: Path) -> Manifest:
    """The manifest of the verl checkpoint directory ``root`` (see the module docstring)."""
    try:
        return _read(root)
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        # Every structure read is checked on its way in; this catches the combination no check foresaw.
        raise FormatError(f"{root}: malformed verl checkpoint ({type(e).__name__}: {e})") from e


def _read(root: Path) -> Manifest:
    files, world = _rank_files(root)
    details: list[tuple[str, str]] = [("rank files", f"model_world_size_{world}_rank_{{rank}}.pt")]
    details += _fsdp_config(root, world)
    left_out = []
    models = [_load(f) for f in files["model"]]
    reader = _Ranks(files["model"], world)
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    params: dict[str, TensorEntry] = {}  # sharded parameters in model.parameters() order, ties once
    seen: set[tuple] = set()
    for path, leaves in _aligned(models, files["model"]):
        entry = reader.entry(("model", *path), leaves)
        if not isinstance(entry, TensorEntry):
            objects.append(entry)
            continue
        tensors.append(entry)
        if isinstance(leaves[0], DTensorData):  # a parameter (buffers stay plain tensors under FSDP)
            # A tied parameter is one DTensor under two names; its local tensors are the same bytes.
            where = tuple((leaf.local.span.file, leaf.local.span.offset) for leaf in leaves)
            if where not in seen:
                seen.add(where)
                params[key_of(path)] = entry
    details.append(("placements", "; ".join(f"{layout} ({n} tensors)" for layout, n in reader.layouts.items())))
    if "optim" in files:
        optim = _Optimizer(_Ranks(files["optim"], world), params)
        tensors += optim.tensors
        objects += optim.objects
        details.append(("optimizer", optim.summary))
        left_out += optim.left_out
    if "extra_state" in files:
        left_out.append(f"extra_state_world_size_{world}_rank_*.pt (LR scheduler and RNG state, numpy pickles)")
    assets = root / HF_DIR
    hf_assets = str(assets) if (assets / "config.json").is_file() else None
    if hf_assets:
        details.append(("hf assets", f"{HF_DIR}/ ({', '.join(sorted(p.name for p in assets.iterdir()))})"))
    if left_out:
        details.append(("left out", "; ".join(left_out)))
    return Manifest(Format.VERL, str(root), tuple(tensors), tuple(objects), world, tuple(details),
                    hf_assets=hf_assets)


def _rank_files(root: Path) -> tuple[dict[str, list[Path]], int]:
    """Each kind's files in rank order, and the world size their names give; every rank's file must be there."""
    found: dict[str, dict[int, Path]] = {}
    worlds: dict[int, str] = {}
    for f in sorted(root.iterdir()):
        m = _FILE.fullmatch(f.name)
        if m and f.is_file():
            kind, world, rank = m.group(1), int(m.group(2)), int(m.group(3))
            worlds.setdefault(world, f.name)
            found.setdefault(kind, {})[rank] = f
    if len(worlds) != 1:
        raise FormatError(f"{root}: file names give world sizes {sorted(worlds)} (e.g. "
                          f"{', '.join(worlds.values())}); one verl checkpoint has one world size")
    world = next(iter(worlds))
    for kind, ranks in found.items():
        missing = sorted(set(range(world)) - set(ranks))
        extra = sorted(set(ranks) - set(range(world)))
        if missing or extra:
            what = f"ranks {missing} are missing" if missing else f"ranks {extra} are beyond the world size"
            raise IncompleteCheckpointError(f"{root}: {kind}_world_size_{world}_rank_*.pt: {what} "
                                            f"(found {len(ranks)} files for world size {world})")
    return {kind: [ranks[r] for r in range(world)] for kind, ranks in found.items()}, world


def _fsdp_config(root: Path, world: int) -> list[tuple[str, str]]:
    path = root / CONFIG
    if not path.is_file():
        return []
    try:
        if path.stat().st_size > _MAX_JSON:
            raise ValueError(f"{path.stat().st_size} bytes")
        config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a {type(config).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: not verl's FSDP config JSON ({e})") from e
    if config.get("world_size", world) != world:
        raise FormatError(f"{path}: says world_size {config['world_size']!r}, but the rank files are named for "
                          f"world size {world}")
    version = config.get("FSDP_version")
    return [("wrapper", f"FSDP{version} ({CONFIG})")] if version in (1, 2) else []


def _load(file: Path) -> Any:
    return read_archive(str(file), extra_globals=dtensor_globals(str(file)))


def _is_leaf(v: Any) -> bool:
    return isinstance(v, (TensorRef, DTensorData))


def _aligned(trees: list[Any], files: list[Path]) -> list[tuple[Path_, list[Any]]]:
    """Each leaf path of rank 0's tree with the leaf of every rank; all ranks must hold the same paths."""
    ranks = [dict(flatten(t, _is_leaf)) for t in trees]
    for f, leaves in zip(files, ranks, strict=True):
        odd = next((p for p in leaves if not all(isinstance(k, (str, int)) for k in p)), None)
        if odd is not None:
            raise FormatError(f"{f}: a state-dict key is {odd!r:.80}, not a name or index; is the file corrupt?")
    for f, leaves in zip(files[1:], ranks[1:], strict=True):
        if leaves.keys() != ranks[0].keys():
            diff = sorted(map(key_of, leaves.keys() ^ ranks[0].keys()))
            raise FormatError(f"{f}: holds other keys than {files[0].name} ({', '.join(diff[:5])}); every rank "
                              "saves the same state dict")
    return [(path, [leaves[path] for leaves in ranks]) for path in ranks[0]]


class _Ranks:
    """Turns one leaf path of every rank's file into a manifest entry, checking the ranks agree."""

    def __init__(self, files: list[Path], world: int) -> None:
        self.files, self.world = files, world
        self.layouts: Counter[str] = Counter()

    def entry(self, path: Path_, leaves: list[Any]) -> TensorEntry | ObjectEntry:
        first = leaves[0]
        if isinstance(first, DTensorData):
            return self._sharded(path, leaves)
        if isinstance(first, TensorRef):  # a buffer or an unsharded tensor: every rank saves it whole
            for f, leaf in zip(self.files, leaves, strict=True):
                if not isinstance(leaf, TensorRef) or (leaf.dtype, leaf.shape) != (first.dtype, first.shape):
                    raise FormatError(f"{f}: {key_of(path[1:])!r} is {_kind(leaf)}, but {_kind(first)} in "
                                      f"{self.files[0].name}")
            return first.as_entry(path)
        return plain_object(path, first, str(self.files[0]))

    def _sharded(self, path: Path_, leaves: list[Any]) -> TensorEntry:
        first, key = leaves[0], key_of(path[1:])
        chunks: list[Chunk] = []
        holders: dict[tuple[int, ...], Path] = {}
        for f, leaf in zip(self.files, leaves, strict=True):
            if (not isinstance(leaf, DTensorData) or (leaf.dtype, leaf.shape, leaf.mesh.shape, leaf.placements)
                    != (first.dtype, first.shape, first.mesh.shape, first.placements)):
                raise FormatError(f"{f}: {key!r} is {_kind(leaf)}, but {_kind(first)} in {self.files[0].name}")
            if math.prod(leaf.mesh.shape) != self.world:
                raise FormatError(f"{f}: {key!r} lies on a mesh of {math.prod(leaf.mesh.shape)} ranks "
                                  f"({leaf.mesh.describe()}), but the files are named for world size {self.world}")
            if leaf.mesh.coordinate in holders:
                raise FormatError(f"{f}: {key!r} was saved at mesh coordinate {list(leaf.mesh.coordinate)}, as in "
                                  f"{holders[leaf.mesh.coordinate].name}; are rank files copied or misnamed?")
            holders[leaf.mesh.coordinate] = f
            try:
                offsets, sizes = leaf.box()
            except CheckpointError as e:
                raise FormatError(f"{f}: {key!r}: {e}") from e
            if sizes != leaf.local.shape:
                raise FormatError(f"{f}: {key!r} holds a local tensor of shape {list(leaf.local.shape)}, but its "
                                  f"placements {_placements(leaf)} at coordinate {list(leaf.mesh.coordinate)} give "
                                  f"{list(sizes)}")
            replica = any(p.kind == "replicate" and c for p, c in zip(leaf.placements, leaf.mesh.coordinate,
                                                                       strict=True))
            if math.prod(sizes) and not replica:  # one replica is read; the others hold the same box
                chunks.append(Chunk(offsets, sizes, leaf.local.span, leaf.local.strides))
        entry = TensorEntry(key_of(path), path, first.dtype, first.shape, tuple(chunks))
        entry.validate()
        self.layouts[f"mesh {first.mesh.describe()}: {_placements(first)}"] += 1
        return entry


def _placements(d: DTensorData) -> str:
    return "(" + ", ".join(map(str, d.placements)) + ")"


def _kind(leaf: Any) -> str:
    if isinstance(leaf, DTensorData):
        return f"a {leaf.dtype} DTensor of shape {list(leaf.shape)} placed {_placements(leaf)}"
    if isinstance(leaf, TensorRef):
        return f"a {leaf.dtype} tensor of shape {list(leaf.shape)}"
    return f"a {type(leaf).__name__}"


class _Optimizer:
    """The ranks' ``optimizer.state_dict()`` files as ``optim.*`` entries, or what was left out and why."""

    def __init__(self, ranks: _Ranks, params: dict[str, TensorEntry]) -> None:
        files = ranks.files
        self.tensors: list[TensorEntry] = []
        self.objects: list[ObjectEntry] = []
        self.left_out: list[str] = []
        pattern = files[0].name.replace("rank_0.pt", "rank_*.pt")
        trees = [_load(f) for f in files]
        for f, tree in zip(files, trees, strict=True):
            if not (isinstance(tree, dict) and isinstance(tree.get("state"), dict)
                    and isinstance(tree.get("param_groups"), list)):
                raise FormatError(f"{f}: expected an optimizer.state_dict() ({{'state': ..., 'param_groups': ...}}), "
                                  f"found {_kind(tree) if not isinstance(tree, dict) else sorted(map(str, tree))}")
        first = trees[0]
        state = dict(flatten(first["state"], _is_leaf)).values()
        if (any(isinstance(v, TensorRef) and v.shape for v in state)
                and not any(isinstance(v, DTensorData) for v in state)):
            # FSDP1 steps each unit's flat parameter: every rank holds a 1-D slice of the unit's parameters
            # concatenated, and nothing in the files says which parameters those are.
            self.summary = "not read: FSDP1 state of flat parameters, whose parameter layout the files do not record"
            self.left_out.append(f"{pattern} (FSDP1 optimizer state: per-rank slices of flat parameters, unnamed)")
            return
        names = self._names(first, params)
        for path, leaves in _aligned([t["state"] for t in trees], files):
            index, rest = path[0], path[1:]
            entry = ranks.entry(("optim", "state", names.get(index, index), *rest), leaves)
            if isinstance(entry, TensorEntry):
                self.tensors.append(entry)
            else:
                self.objects.append(entry)
        groups = [{**g, "params": [names[p] for p in g["params"]]} if names else g for g in first["param_groups"]]
        group_leaves = flatten(groups, _is_leaf, ("optim", "param_groups"))
        self.objects += [plain_object(p, v, str(files[0])) for p, v in group_leaves]

    def _names(self, optim: dict, params: dict[str, TensorEntry]) -> dict[Any, str]:
        """Parameter index to name, where the model's parameter order gives it beyond doubt: ``state_dict()``
        numbers parameters group after group, which is ``model.parameters()`` order (verl's) only for one group."""
        groups = optim["param_groups"]
        order = list(params.values())
        why = None
        if len(groups) != 1 or not isinstance(groups[0], dict):
            why = f"{len(groups)} param groups, whose parameter order the files do not record"
        elif groups[0].get("params") != list(range(len(order))):
            why = f"param group indices {groups[0].get('params')!r:.60} for the model's {len(order)} sharded parameters"
        else:
            for index, leaves in optim["state"].items():
                shapes = {v.shape for v in (leaves.values() if isinstance(leaves, dict) else ())
                          if isinstance(v, DTensorData)}
                if index not in range(len(order)) or shapes - {order[index].shape}:
                    why = f"the state of parameter {index!r} does not fit the model's parameter of that index"
                    break
        if why:
            self.summary = f"state kept by parameter index: {why}"
            return {}
        self.summary = f"{len(order)} parameters, named in the model's parameter order"
        return {i: key_of(t.path[1:]) for i, t in enumerate(order)}

"""Megatron-core's ``torch_dist`` checkpoints: a DCP directory plus two files of megatron-core's own.

``dist_checkpointing.save`` with the ``torch_dist`` backend writes the sharded tensors (global, layer-stacked:
Megatron reshards at load time) as DCP, and beside them:

- ``metadata.json``: which backends wrote the checkpoint. megatron-core's loader recognises a distributed
  checkpoint by it, and reads the sharded part with the backend it names. ckptkit reads ``torch_dist`` only and
  refuses any other name (``zarr``, a future backend) rather than read the DCP part of it as the whole.
- ``common.pt``: a ``torch.save`` of the state that is not sharded (Megatron-LM's ``args``, an
  ``argparse.Namespace``, its ``iteration``, ``checkpoint_version``). Read through the allow-list, which admits
  the ``Namespace`` as data (built by NEWOBJ + BUILD, never called) and nothing that executes.

``dist_checkpointing.load`` returns ``common.pt``'s contents merged at the top level of the state dict, beside
the sharded keys; ckptkit reads them the same way, as entries marked ``sidecar="common.pt"``, so that a FULL
output holds what megatron's own load returns and a DCP output writes them back into ``common.pt``.

megatron-core 0.19 writes no ``common.pt``: the same dict is a ``ShardedObject`` keyed ``common_state`` inside the
DCP files (the bytes entry ``common_state/shard_0_1``, a ``torch.save`` of ``[dict]``), and ``metadata.json``
no longer names a common backend. Its loader still takes a ``common.pt`` where there is one. ckptkit reads the
object's entries as ``common.pt``'s, marked ``sidecar="common_state"``, and writes them back the way they came.

Megatron also stores its save plans in ``.metadata`` (``Metadata.all_local_plans``, torch's ``SavePlan``
records): :data:`PLAN_GLOBALS` admits them as plain records for the DCP reader, which ignores them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...codecs.pickle_read import EnumStandIn, allow_plain_records, keep_call
from ...codecs.torchzip_read import read_archive
from ...codecs.torchzip_write import archive_parts
from ...core.dtypes import DType
from ...core.manifest import Manifest, ObjectEntry, TensorEntry, TensorRef, key_of
from ...core.plan import Part, Region
from ...core.tree import flatten, unflatten
from ...errors import FormatError
from ..base import cast_for, regions_in
from ..run_args import RUN_ARGS_GLOBALS

__all__ = ["COMMON", "COMMON_STATE", "COMMON_STATE_KEY", "CONFIG", "CONFIG_BYTES", "PLAN_GLOBALS",
           "common_parts", "config_bytes", "config_of_args", "extra_states", "hf_fields", "in_dcp", "is_megatron",
           "read_common", "read_config"]

COMMON = "common.pt"
CONFIG = "metadata.json"
_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
CONFIG_BYTES = json.dumps(_CONFIG).encode()
"""``metadata.json`` as megatron-core 0.16 writes it for ``torch_dist`` (``json.dump`` of its
``CheckpointingConfig``)."""
COMMON_STATE = "common_state"
"""The sidecar mark of megatron-core 0.19's common state, kept inside the DCP files."""
COMMON_STATE_KEY = "common_state/shard_0_1"
"""Its DCP key: the ``ShardedObject``'s key, index and count."""
_CONFIG_0_19 = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}

_PLANNER = "torch.distributed.checkpoint.planner"
_WRITE_ITEM_TYPES = {"TENSOR": 1, "SHARD": 2, "BYTE_IO": 3}
PLAN_GLOBALS = {
    **allow_plain_records(_PLANNER, "SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData"),
    (_PLANNER, "WriteItemType"): EnumStandIn(_WRITE_ITEM_TYPES, keep_call(_PLANNER, "WriteItemType")),
}
"""torch's save-plan records (frozen dataclasses, no ``__setstate__``) as Megatron leaves them in ``.metadata``."""

_MAX_CONFIG = 1 << 20


def read_config(root: Path) -> str | None:
    """A line for ``inspect`` saying which backends ``root/metadata.json`` names; None where there is none.

    Raises:
        FormatError: the file is not JSON of megatron-core's config, or names a backend other than
            ``torch_dist`` (or a common backend other than ``torch``).
    """
    path = root / CONFIG
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > _MAX_CONFIG:
            raise ValueError(f"{path.stat().st_size} bytes")
        config = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: not megatron-core's checkpoint config JSON ({e})") from None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: expected a JSON object naming sharded_backend, found {type(config).__name__}")
    sharded, common = config.get("sharded_backend"), config.get("common_backend", "torch")
    if sharded != "torch_dist" or common != "torch":
        raise FormatError(f"{path}: megatron-core checkpoint with sharded_backend {sharded!r:.40} and common_backend "
                          f"{common!r:.40}; ckptkit reads 'torch_dist' with 'torch' only")
    return f"megatron-core torch_dist (version {config.get('sharded_backend_version')!r:.20})"


def read_common(root: Path, objects: Sequence[ObjectEntry]) -> tuple[list[TensorEntry], list[ObjectEntry], str,
                                                                      str]:
    """The common state's entries at the top level, as ``dist_checkpointing.load`` merges them: ``root/common.pt``'s,
    marked ``sidecar="common.pt"``, else those of the ``common_state`` object among the DCP ``objects`` (read
    from ``root``), marked ``sidecar="common_state"``; and the mark and a line for ``inspect``.

    Raises:
        FormatError: there is neither, or one is damaged or holds no dict.
        UnsafeCheckpointError: its pickle names a class outside the allow-list.
    """
    path = root / COMMON
    if path.is_file():
        tree, mark = read_archive(str(path), extra_globals=RUN_ARGS_GLOBALS), COMMON
    else:
        blob = next((o.blob for o in objects if o.key == COMMON_STATE_KEY and o.blob is not None), None)
        if blob is None:
            raise FormatError(f"{root}: {CONFIG} names a megatron-core checkpoint, but there is neither {COMMON} "
                              f"nor the {COMMON_STATE_KEY!r} entry megatron-core 0.19 keeps its common state in")
        where = f"{blob.file}: {COMMON_STATE_KEY!r}"
        held = read_archive(blob.file, blob.offset, blob.length, where=where, extra_globals=RUN_ARGS_GLOBALS)
        if not (isinstance(held, list) and len(held) == 1):  # torch.save of the ShardedObject's [data]
            raise FormatError(f"{where}: megatron-core saves a list of one dict there, found {held!r:.60}")
        tree, path, mark = held[0], Path(where), COMMON_STATE
    if not isinstance(tree, dict):
        raise FormatError(f"{path}: megatron-core's common state is a dict, found {type(tree).__name__}")
    tensors: list[TensorEntry] = []
    entries: list[ObjectEntry] = []
    for p, leaf in flatten(tree, lambda v: isinstance(v, TensorRef)) if tree else ():
        if isinstance(leaf, TensorRef):
            tensors.append(dataclasses.replace(leaf.as_entry(p), sidecar=mark))
        else:
            entries.append(ObjectEntry(key_of(p), p, leaf, sidecar=mark))
    names = ", ".join(sorted(map(str, tree))[:8]) or "empty"
    return tensors, entries, mark, f"megatron-core's common state: {len(tree)} entries ({names})"


_ARGS = {  # Megatron-LM's argument -> HF config.json's field, for the head and layer counts a preset needs
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "kv_channels": "head_dim", "ffn_hidden_size": "intermediate_size", "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size", "padded_vocab_size": "vocab_size",
}


def config_of_args(args: Any) -> dict | None:
    """The model's counts from Megatron-LM's run arguments ``args`` (as read), under HF ``config.json``'s field
    names; None where ``args`` is not Megatron-LM's."""
    if args is None or not hasattr(args, "num_attention_heads"):
        return None
    return hf_fields(vars(args))


def hf_fields(fields: dict) -> dict:
    """Megatron-LM's arguments ``fields`` (by name) as the HF ``config.json`` fields that give a preset the
    model's counts."""
    config = {hf: fields[name] for name, hf in _ARGS.items() if fields.get(name) is not None}
    groups = fields.get("num_query_groups") if fields.get("group_query_attention") else None
    config["num_key_value_heads"] = groups or fields.get("num_attention_heads")
    if "untie_embeddings_and_output_weights" in fields:
        config["tie_word_embeddings"] = not fields["untie_embeddings_and_output_weights"]
    return config


_LINEAR = re.compile(r"(decoder\.layers\.(\d+\.)?.*\.linear_\w+?)\.weight(_w)?")
_EXPERTS = re.compile(r"\.experts\.experts\.(\d+\.)?")


def extra_states(tensors: Sequence[TensorEntry]) -> list[ObjectEntry]:
    """The ``_extra_state`` entries megatron-core's loader asks for beside ``tensors`` (named as in a
    ``torch_dist`` checkpoint): one per linear layer of each layer (and expert), as ``ShardedObject``s keyed
    ``<module>._extra_state/shard_<index>_<count>`` with the layer (``n``) or layer and expert (``n.e``) index of
    a layer-stacked tensor; of a per-layer one (``decoder.layers.0.``), the expert index, or ``0_1``, as of one
    expert's own (``singleton_local_shards``; a gated ``linear_fc1`` there is ``weight_w`` and ``weight_v``, one
    module). Their value is what megatron-core saves for a layer with no FP8 state."""
    out = []
    for t in tensors:
        m = _LINEAR.fullmatch(t.key)
        if m is None:
            continue
        experts = _EXPERTS.search(t.key)  # stacked, or (singleton_local_shards) one expert's own
        stacked = (0 if m.group(2) else 1) + (1 if experts and not experts.group(1) else 0)
        dims = tuple(t.shape[:stacked]) or (1,)
        count = ".".join(map(str, dims))
        for index in itertools.product(*map(range, dims)):
            key = f"{m.group(1)}._extra_state/shard_{'.'.join(map(str, index))}_{count}"
            out.append(ObjectEntry(key, (key,), [None]))
    return out


def is_megatron(manifest: Manifest) -> bool:
    """Whether ``manifest`` was read from a megatron-core ``torch_dist`` checkpoint."""
    return any(k == CONFIG for k, _ in manifest.details) or any(e.sidecar in (COMMON, COMMON_STATE)
                                                                 for e in manifest.entries)


def in_dcp(manifest: Manifest) -> bool:
    """Whether ``manifest``'s common state came from inside the DCP files (megatron-core 0.19), where it goes back."""
    return any(e.sidecar == COMMON_STATE for e in manifest.entries) or any(
        k == COMMON_STATE for k, _ in manifest.details)


def config_bytes(manifest: Manifest) -> bytes:
    """``metadata.json`` as the megatron-core that wrote ``manifest``'s layout writes it."""
    return json.dumps(_CONFIG_0_19).encode() if in_dcp(manifest) else CONFIG_BYTES


def common_parts(manifest: Manifest, cast: DType | None) -> tuple[Part, ...]:
    """The common state: the entries read from one, nested again (an empty dict where there were none); as
    ``common.pt`` holds it, or as megatron-core 0.19's ``common_state`` object does (``[dict]``)."""
    mark = COMMON_STATE if in_dcp(manifest) else COMMON
    items = [(t.path, Region.whole(t, cast_for(t.dtype, cast))) for t in manifest.tensors if t.sidecar == mark]
    items += [(o.path, regions_in(o.value, cast)) for o in manifest.objects if o.sidecar == mark]
    tree = unflatten(items) if items else {}
    return archive_parts([tree] if mark == COMMON_STATE else tree)

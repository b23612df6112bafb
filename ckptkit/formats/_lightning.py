"""Lightning's ``meta.pt``: the non-tensor state Lightning keeps beside a sharded checkpoint's DCP files, read
as data and written back beside a DCP output."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..codecs.torchzip_read import read_archive
from ..codecs.torchzip_write import archive_parts
from ..core.dtypes import DType
from ..core.manifest import Manifest, ObjectEntry, Span, TensorEntry, TensorRef, bytes_entry, key_of
from ..core.plan import Part, Region
from ..core.tree import flatten, unflatten
from ..errors import FormatError, UnsafeCheckpointError
from .base import cast_for, object_value, regions_in
from .run_args import RUN_ARGS_GLOBALS

__all__ = ["META", "meta_parts", "read_meta"]

META = "meta.pt"
"""Lightning's file of non-tensor state beside a sharded checkpoint's DCP files."""


def read_meta(path: Path, groups: set[str]) -> tuple[list[TensorEntry], list[ObjectEntry], str]:
    """``meta.pt``'s entries, flattened as a FULL file's are, less the groups the DCP holds too; and a line
    for ``inspect``."""
    try:  # hparams as an argparse.Namespace (Lightning's, Megatron-LM's args) are admitted as data
        tree = read_archive(str(path), extra_globals=RUN_ARGS_GLOBALS)
    except UnsafeCheckpointError as e:
        # Lightning pickles user classes there too. The archive and the pickle's structure were checked before
        # the first global was refused; the bytes go on untouched, never run.
        opaque = ObjectEntry(META, (META,), blob=Span(str(path), 0, path.stat().st_size), sidecar=META)
        return [], [opaque], f"not readable as data, carried as it is ({e})"
    if not isinstance(tree, dict):
        raise FormatError(f"{path}: Lightning's meta.pt holds a dict of non-tensor state, found {type(tree).__name__}")
    kept = {k: v for k, v in tree.items() if str(k) not in groups}
    tensors, objects = [], []
    for p, leaf in flatten(kept, lambda v: isinstance(v, TensorRef)) if kept else ():  # {} flattens to itself
        if isinstance(leaf, TensorRef):
            tensors.append(dataclasses.replace(leaf.as_entry(p), sidecar=META))
        else:
            objects.append(ObjectEntry(key_of(p), p, leaf, sidecar=META))
    mirrored = len(tree) - len(kept)
    return tensors, objects, (f"Lightning's non-tensor state: {len(kept)} entries"
                              + (f", and {mirrored} mirrored from the DCP entries" if mirrored else ""))


def meta_parts(manifest: Manifest, meta_groups: tuple[str, ...] | None, cast: DType | None) -> tuple[Part, ...]:
    """``meta.pt``: the entries read from one, and the top-level groups ``meta_groups`` names, floating tensors
    cast to ``cast``."""
    blob = next((o.blob for o in manifest.objects if o.sidecar == META and o.blob is not None), None)
    if blob is not None:
        return (Region.whole(bytes_entry(blob, META)),)
    groups = set(meta_groups or ())
    items = [(t.path, Region.whole(t, cast_for(t.dtype, cast)))
             for t in manifest.tensors if t.sidecar == META or str(t.path[0]) in groups]
    items += [(o.path, regions_in(object_value(o), cast))
              for o in manifest.objects if o.sidecar == META or str(o.path[0]) in groups]
    return archive_parts(unflatten(items) if items else {})

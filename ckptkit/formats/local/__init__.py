"""LOCAL: FSDP1 ``LOCAL_STATE_DICT`` checkpoints, one ``torch.save`` file per rank.

The package holds one idea a module: :mod:`.discover` (which files are the rank files), :mod:`.layout`
(the flat-parameter layout, torch-free), :mod:`.derive` (the layout read from FSDP itself), :mod:`.read`,
:mod:`.optim` (per-rank optimizer state) and :mod:`.write`. It offers :class:`LocalIO` (the reader and writer),
its :class:`LocalWriteOptions`, the :class:`LocalManifest` it reads, and :func:`is_rank_file`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...codecs.torchzip_write import archive_parts
from ...core.manifest import Format, Manifest
from ...core.plan import Bytes, FilePlan, WritePlan
from ...errors import UsageError
from ..base import RANK, FormatIO, FormatOptions, LocalOptions, Target, rank_pattern
from .derive import derive_layout
from .discover import DEFAULT_RANK_FILES, is_rank_file, local_groups
from .layout import LAYOUT_FILE, FlatLayout
from .read import LocalManifest, read_local
from .write import RankWriter

__all__ = ["LocalIO", "LocalManifest", "LocalWriteOptions", "is_rank_file"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalWriteOptions(FormatOptions):
    world_size: int = 1
    layout: FlatLayout | None = None
    """The model's flat-parameter layout: the one the manifest was read with, or one derived from the model."""
    rank_files: str = DEFAULT_RANK_FILES
    """File names, a pattern with ``{rank}``."""


class LocalIO(FormatIO):
    """Reads and writes LOCAL checkpoints as ``options`` (its :class:`LocalOptions`) say: rank file names, and
    the model whose flat-parameter layout they hold."""

    format = Format.LOCAL
    names = ("local",)
    ranked = True

    def __init__(self, options: LocalOptions | None = None) -> None:
        self.local = options or LocalOptions()

    @classmethod
    def detect(cls, path: Path) -> bool:
        return path.is_dir() and bool(local_groups(path))

    def read(self, path: Path) -> Manifest:
        return read_local(path, self.local)

    def options(self, target: Target, manifest: Manifest) -> LocalWriteOptions:
        """The source's layout and rank file names where it is LOCAL; else the layout derived from the model
        (this imports torch) and ``rank{rank}.pt``."""
        local = self.local
        layout = manifest.layout if isinstance(manifest, LocalManifest) else None
        if layout is None and local.model is not None:
            layout = derive_layout(local.model, local.auto_wrap, world_size=target.world_size,
                                   use_orig_params=bool(local.use_orig_params), param_dtype=local.param_dtype)
        names = local.rank_files or (manifest.rank_files if isinstance(manifest, LocalManifest) else DEFAULT_RANK_FILES)
        return LocalWriteOptions(world_size=target.world_size, layout=layout, rank_files=names)

    def plan(self, manifest: Manifest, options: LocalWriteOptions) -> WritePlan:
        if options.layout is None:
            raise UsageError(f"{manifest.root}: writing LOCAL needs the model's flat-parameter layout; pass --model "
                             "package.module:factory with --auto-wrap (and --use-orig-params if FSDP wraps the model "
                             "with use_orig_params=True, --param-dtype under mixed precision)")
        rank_pattern(options.rank_files)
        writer = RankWriter(manifest, options.layout, options.world_size, options.cast)
        files = []
        for rank in range(options.world_size):
            name = options.rank_files.replace(RANK, str(rank))
            files.append(FilePlan(name, archive_parts(writer.rank_tree(rank), name=os.path.splitext(name)[0])))
        files.append(FilePlan(LAYOUT_FILE, (Bytes(options.layout.to_json()),)))
        return WritePlan(tuple(files), commit=LAYOUT_FILE)

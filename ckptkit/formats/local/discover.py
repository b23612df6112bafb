"""Which files of a directory are the rank files of a LOCAL checkpoint.

Rank files are found by name: a group of ``.pt``/``.pth``/``.bin``/``.ckpt`` files whose names differ in one
run of digits counting 0..N-1 (``rank0.pt``, ``model_rank_3.pt``, ``local_1.bin``, ``__2.pt``), and whose
rank-0 file is an FSDP1 state: its pickle names a ShardedTensor or a ``_flat_param``, or (NO_SHARD, where
every rank saves whole tensors) FSDP1's wrapper module. ``rank_files="shard_{rank}.pt"`` names them
explicitly: a file name in which ``{rank}`` stands for the decimal rank (leading zeros allowed when reading).

Telling a rank file apart reads the zip directory and the head and tail of its ``data.pkl`` record;
nothing is unpickled here.
"""

from __future__ import annotations

import re
import struct
import zipfile
from pathlib import Path
from typing import BinaryIO

from ...codecs.torchzip_read import ARCHIVE_MAGIC
from ...errors import FormatError, IncompleteCheckpointError
from ..base import RANK, rank_pattern
from ..full import SUFFIXES

__all__ = ["DEFAULT_RANK_FILES", "is_rank_file", "local_groups", "rank_files"]

DEFAULT_RANK_FILES = "rank{rank}.pt"
_PEEK = 64 << 10
# Words a LOCAL rank file's pickle holds: a sharded flat parameter, or NO_SHARD's module names.
_SHARDED_WORDS = (b"ShardedTensor", b"_flat_param")
_LOCAL_WORDS = (*_SHARDED_WORDS, b"_fsdp_wrapped_module")


def _pickle_edges(path: Path) -> bytes:
    """The first and last 64 KiB of the ``data.pkl`` record of a ``torch.save`` file, or b"" if it is none.

    The zip directory gives the record's place (torch writes its sizes there, not in the local header).
    """
    def pread(f: BinaryIO, n: int, offset: int) -> bytes:
        f.seek(offset)
        return f.read(n)

    try:
        with path.open("rb") as f:
            if f.read(4) != ARCHIVE_MAGIC:
                return b""
            info = next((i for i in zipfile.ZipFile(f).infolist()
                         if i.filename.endswith("data.pkl") and i.filename.count("/") <= 1), None)
            if info is None:
                return b""
            head = pread(f, 30, info.header_offset)
            if len(head) < 30:
                return b""
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            start = info.header_offset + 30 + name_len + extra_len
            data = pread(f, min(info.file_size, _PEEK), start)
            if info.file_size > _PEEK:
                data += pread(f, _PEEK, start + info.file_size - _PEEK)
            return data
    except (OSError, zipfile.BadZipFile, ValueError):
        return b""


def _names_any(path: Path, words: tuple[bytes, ...]) -> bool:
    data = _pickle_edges(path)
    return any(w in data for w in words)


def is_rank_file(path: Path) -> bool:
    """Whether ``path`` is one rank's slice of a LOCAL checkpoint (a sharded flat parameter), unreadable alone."""
    return _names_any(path, _SHARDED_WORDS)


def _groups(root: Path) -> dict[str, list[Path]]:
    """Name templates (``rank{rank}.pt``) whose files count ranks 0..N-1, each with its files in rank order."""
    by_template: dict[str, dict[int, Path]] = {}
    for f in sorted(root.iterdir()):
        if f.is_file() and f.name.endswith(SUFFIXES):
            for m in re.finditer(r"\d+", f.name):
                template = f.name[:m.start()] + RANK + f.name[m.end():]
                by_template.setdefault(template, {}).setdefault(int(m.group()), f)
    return {t: [files[r] for r in range(len(files))] for t, files in by_template.items()
            if sorted(files) == list(range(len(files)))}


def local_groups(root: Path) -> dict[str, list[Path]]:
    """The groups of ``root`` that can be a LOCAL checkpoint: a NO_SHARD state (two or more ranks, FSDP1's
    module names) or a sharded one (flat parameters)."""
    return {t: fs for t, fs in _groups(root).items()
            if (len(fs) > 1 and _names_any(fs[0], _LOCAL_WORDS)) or is_rank_file(fs[0])}


def rank_files(root: Path, pattern: str | None) -> tuple[str, list[Path]]:
    """The rank files' name pattern and the files in rank order: named by ``pattern``, else found by name."""
    if pattern is not None:
        rx = rank_pattern(pattern)
        found = {int(m.group(1)): f for f in sorted(root.iterdir()) if (m := rx.fullmatch(f.name))}
        if not found:
            raise IncompleteCheckpointError(f"{root}: no file matches --rank-files {pattern!r}")
        missing = sorted(set(range(max(found) + 1)) - set(found))
        if missing:
            raise IncompleteCheckpointError(f"{root}: the rank files {pattern!r} of ranks {missing} are missing "
                                            f"(found {len(found)} files up to rank {max(found)})")
        return pattern, [found[r] for r in range(len(found))]
    local = local_groups(root)
    if len(local) != 1:
        found_text = ", ".join(sorted(local)) or "no per-rank torch.save files holding a ShardedTensor"
        raise FormatError(f"{root}: cannot tell which files are the LOCAL rank files (found {found_text}); "
                          f"name them with --rank-files, e.g. --rank-files 'rank{RANK}.pt'")
    return next(iter(local.items()))

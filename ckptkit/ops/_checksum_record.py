"""``ckptkit.json``'s structure, checked as untrusted input: :func:`parse_record` takes the parsed JSON document
and gives a :class:`Record`, or raises ``ValueError`` naming the first field that is not what ckptkit writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import dtypes
from ..core.manifest import Format
from ..errors import FormatError

__all__ = ["VERSION", "Box", "Record", "parse_record"]

VERSION = 2
_MAX_DIMS = 64
_HEX = re.compile(r"[0-9a-f]{8}")
_FORMS = tuple(f.value for f in Format)

Box = tuple[tuple[int, ...], tuple[int, ...], int]
"""``(offsets, sizes, crc32)`` of one box of a tensor."""


@dataclass(frozen=True)
class Record:
    """``ckptkit.json``, checked for structure (not yet against the checkpoint)."""

    path: Path
    format: str
    world_size: int
    step: int | None
    save: int | None
    tensors: dict[str, tuple[dtypes.DType, tuple[int, ...], tuple[Box, ...]]]
    objects: dict[str, int]
    files: dict[str, dict[str, int]]


def _int(v: Any, what: str, *, none: bool = False) -> Any:
    if v is None and none:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{what} should be a non-negative integer, found {v!r:.60}")
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > _MAX_DIMS:
        raise ValueError(f"{what} should be a list of at most {_MAX_DIMS} integers, found {v!r:.60}")
    return tuple(_int(n, what) for n in v)


def _crc(v: Any, what: str) -> int:
    if not isinstance(v, str) or not _HEX.fullmatch(v):
        raise ValueError(f"{what} should be 8 lowercase hex digits, found {v!r:.60}")
    return int(v, 16)


def _dict(v: Any, what: str) -> dict:
    if not isinstance(v, dict):
        raise ValueError(f"{what} should be an object, found {type(v).__name__}")
    return v


_KEYS = {"format", "version", "world_size", "step", "save", "checksum", "tensors", "objects", "files"}


def _box(c: dict, what: str) -> Box:
    if c.keys() != {"offsets", "sizes", "crc32"}:
        raise ValueError(f"{what} chunks need offsets, sizes and crc32, found {sorted(map(str, c))[:4]}")
    return _ints(c["offsets"], f"{what} offsets"), _ints(c["sizes"], f"{what} sizes"), _crc(c["crc32"], f"{what} crc32")


def parse_record(path: Path, doc: Any) -> Record:
    """The ``ckptkit.json`` document ``doc``, read from ``path``, checked for structure.

    Args:
        path: Where the document was read from, kept in the record.
        doc: The document, as ``json.loads`` gives it.

    Returns:
        The record, not yet checked against the checkpoint.

    Raises:
        ValueError: A field is missing, unknown, or not what ckptkit writes.
    """
    doc = _dict(doc, "the document")
    unknown = sorted(map(str, doc.keys() - _KEYS))
    if unknown:
        raise ValueError(f"unknown fields {unknown[:3]}")
    version = doc.get("version", 1)
    missing = sorted((_KEYS if version == VERSION else {"format", "world_size", "step", "tensors"}) - doc.keys())
    if missing:
        raise ValueError(f"missing fields {missing}")
    if doc.get("checksum", "crc32") != "crc32":
        raise ValueError(f"checksum {doc.get('checksum')!r:.40} is not one ckptkit computes (crc32)")
    form = doc.get("format")
    if form not in _FORMS:
        raise ValueError(f"format should be one of {', '.join(_FORMS)}, found {form!r:.60}")
    if version not in (1, VERSION):
        raise ValueError(f"version {version!r:.20} is not one this ckptkit reads (1, {VERSION})")
    tensors = {}
    for key, t in _dict(doc.get("tensors", {}), "tensors").items():
        t = _dict(t, f"tensors[{key!r}]")
        if t.keys() - {"dtype", "shape", "chunks", "crc32"}:
            raise ValueError(f"tensors[{key!r}] has unknown fields {sorted(map(str, t))[:4]}")
        name = t.get("dtype")
        if not isinstance(name, str):
            raise ValueError(f"tensors[{key!r}].dtype should be a torch dtype name, found {name!r:.60}")
        try:
            dtype = dtypes.by_name(name, where=f"tensors[{key!r}]")
        except FormatError as e:
            raise ValueError(str(e)) from None
        shape = _ints(t.get("shape"), f"tensors[{key!r}].shape")
        if version == 1:  # one CRC of the whole tensor
            boxes: tuple[Box, ...] = (((0,) * len(shape), shape, _crc(t.get("crc32"), f"tensors[{key!r}].crc32")),)
        else:
            chunks = t.get("chunks")
            if not isinstance(chunks, list):
                raise ValueError(f"tensors[{key!r}].chunks should be a list")
            boxes = tuple(_box(_dict(c, f"tensors[{key!r}].chunks"), f"tensors[{key!r}]") for c in chunks)
        tensors[key] = (dtype, shape, boxes)
    objects = {k: _crc(v, f"objects[{k!r}]") for k, v in _dict(doc.get("objects", {}), "objects").items()}
    files = {}
    for name, crcs in _dict(doc.get("files", {}), "files").items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ValueError(f"files names {name!r:.60}, not a plain file name")
        files[name] = {k: _crc(v, f"files[{name!r}][{k!r}]") for k, v in _dict(crcs, f"files[{name!r}]").items()}
    return Record(path, form, _int(doc.get("world_size"), "world_size"), _int(doc.get("step"), "step", none=True),
                  _int(doc.get("save"), "save", none=True), tensors, objects, files)

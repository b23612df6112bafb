"""``torch.save`` archives read as data: their pickles become trees with :class:`TensorRef` leaves.

A ``torch.save`` file is a zip of stored (uncompressed) records: ``data.pkl`` names each tensor's storage by
a persistent id, and ``data/<key>`` holds the storage bytes, 64-byte aligned. Reading needs no torch: the
central directory gives record offsets (:mod:`._zip`) and :class:`SafeUnpickler` rebuilds tensors as byte
spans, through the allow-list of :mod:`._torch_globals`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ..core.manifest import Span, TensorRef
from ..errors import FormatError
from ..io.sources import opened
from ._torch_globals import (
    OBJECT_GLOBALS,
    WEIGHTS_ONLY_GLOBALS,
    Storage,
    StorageTag,
    Tag,
    check_weights_only_opcodes,
    storage_loader,
)
from ._zip import EDGE, Window, records
from .pickle_read import SafeUnpickler, check_tree

__all__ = ["ARCHIVE_MAGIC", "ArchiveCache", "archive_edges", "is_archive", "load_blob", "read_archive"]


def archive_edges(start: int, length: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The byte ranges (start, end) :func:`read_archive` reads first from an archive of ``length`` bytes at
    ``start``: a reader of remote chunks fetches them ahead."""
    tail_at = max(0, length - EDGE)
    return (start, start + min(length, EDGE)), (start + tail_at, start + length)


ARCHIVE_MAGIC = b"PK\x03\x04"


def is_archive(path: str, offset: int = 0) -> bool:
    with opened(path) as (pread, _):
        return pread(4, offset) == ARCHIVE_MAGIC


def read_archive(path: str, start: int = 0, length: int | None = None, *, where: str = "",
                 extra_globals: dict | None = None, pread: Callable[[int, int], bytes] | None = None,
                 tree: bool = True) -> Any:
    """Unpickle the archive's ``data.pkl`` with tensors as :class:`TensorRef` byte spans into ``path``.

    ``pread``, ``os.pread`` bound to an open ``path`` (:meth:`Files.pread`), saves an open per call when
    reading many chunks of one file; ``path`` may be a URL. ``tree`` checks that what the pickle built can be
    walked as a tree (:func:`check_tree`); a caller that only takes one tensor out of it (a DCP chunk) may skip
    that.
    """
    where = where or path
    with contextlib.ExitStack() as stack:
        if pread is None:
            pread, size = stack.enter_context(opened(path))
            length = size - start if length is None else length
        assert length is not None, "a caller passing pread passes the archive's length"
        value, data, _, _ = _parse(Window(pread, start, length), path, where, extra_globals)
    if tree:
        check_tree(value, where, budget=len(data) + 1000, refuse=(Storage, StorageTag, Tag))
    return value


def _parse(window: Window, path: str, where: str, extra_globals: dict | None, *,
           weights_only: bool = False) -> tuple[Any, bytes, dict[str, Span], list[Storage]]:
    """The archive's value, its ``data.pkl``, its records, and the storages the pickle named. ``weights_only``:
    held to what ``torch.load(weights_only=True)`` unpickles."""
    start = window.start
    spans = records(window, path, where)
    if "data.pkl" not in spans:
        raise FormatError(f"{where}: no data.pkl record; not a torch.save archive "
                          "(legacy pre-1.6 files are not supported)")
    window.seek(spans["data.pkl"].offset - start)
    data = window.read(spans["data.pkl"].length)
    storages: list[Storage] = []
    persistent_load = storage_loader(spans, where, storages)
    allowed = WEIGHTS_ONLY_GLOBALS if weights_only else {**OBJECT_GLOBALS, **(extra_globals or {})}
    value = SafeUnpickler(data, allowed, where=where, persistent_load=persistent_load).load_checked()
    if weights_only:
        check_weights_only_opcodes(data, where)
    return value, data, spans, storages


class _Framing:
    """A checked tensor archive's bytes outside its tensor data (``head`` before it, ``tail`` after it), the
    ranges among them that may differ between archives of this framing (:attr:`Window.holes`), and the
    tensor it holds (offsets relative to the archive).

    A hole is *active* once an archive differed there (torch.save's serialization id and the CRC-32s of its
    records do, from chunk to chunk); only active holes are skipped when comparing, so archives that are
    all alike (ckptkit's) cost two compares each."""

    __slots__ = ("head", "tail", "length", "holes", "active", "pieces", "texts", "dtype", "shape", "strides",
                 "offset", "nbytes")

    def __init__(self, head: bytes, tail: bytes, holes: list[tuple[int, int, bool]], ref: TensorRef,
                 start: int) -> None:
        self.head, self.tail, self.length = head, tail, len(head) + ref.span.length + len(tail)
        self.dtype, self.shape, self.strides = ref.dtype, ref.shape, ref.strides
        self.offset, self.nbytes = ref.span.offset - start, ref.span.length
        self.holes, self.active = holes, list[tuple[int, int, bool]]()
        self.pieces, self.texts = self._split(self.active)

    def _at(self, a: int, b: int) -> tuple[bool, int, int | None]:
        """Bytes ``[a, b)`` of the archive as a slice ``(in tail, from, to)`` of an archive's head or tail;
        offsets into the tail count from the archive's end, so that a longer tail read does not move them."""
        return (False, a, b) if b <= self.offset else (True, a - self.length, (b - self.length) or None)

    def _split(self, holes: list[tuple[int, int, bool]]) -> tuple[list[tuple[bool, int, bytes]],
                                                                     list[tuple[bool, int, int | None]]]:
        """The pieces to compare (where, as :meth:`_at` says, and the bytes expected there) between ``holes``
        and the data; the text to decode."""
        lo, hi = self.offset, self.offset + self.nbytes
        pieces, at = [], 0
        for a, b in sorted([*((a, b) for a, b, _ in holes), (lo, hi), (self.length, self.length)]):
            if a > at:
                in_tail, start, _ = self._at(at, a)
                pieces.append((in_tail, start, self.head[at:a] if a <= lo else self.tail[at - hi:a - hi]))
            at = max(at, b)
        return pieces, [self._at(a, b) for a, b, text in holes if text]

    def matches(self, head: bytes, tail: bytes, *, loose: bool = False) -> bool:
        """Whether an archive of this length that starts with ``head`` and ends with ``tail`` (each at least
        as long as this framing's; both may be the whole archive) is framed as this one. ``loose``: all holes
        skipped, not only the active ones; the holes where the archive differs become active."""
        if not (loose or self.active):  # archives all alike (ckptkit's)
            return head.startswith(self.head) and tail.endswith(self.tail)
        pieces, texts = self._split(self.holes) if loose else (self.pieces, self.texts)
        for in_tail, a, want in pieces:
            if not (tail if in_tail else head).startswith(want, a):  # compares in place, without a copy
                return False
        for in_tail, a, b in texts:
            try:
                (tail if in_tail else head)[a:b].decode("utf-8")
            except UnicodeDecodeError:  # the full read names the fault
                return False
        if loose:
            self.active = [h for h in self.holes if h in self.active or self._differs(head, tail, h)]
            self.pieces, self.texts = self._split(self.active)
        return True

    def _differs(self, head: bytes, tail: bytes, hole: tuple[int, int, bool]) -> bool:
        """Whether the archive's bytes in ``hole`` differ from this framing's."""
        in_tail, a, b = self._at(hole[0], hole[1])
        hi = self.offset + self.nbytes
        mine = self.tail[hole[0] - hi:hole[1] - hi] if in_tail else self.head[a:b]
        return (tail if in_tail else head)[a:b] != mine

    def ref(self, path: str, start: int) -> TensorRef:
        return TensorRef(self.dtype, self.shape, Span(path, start + self.offset, self.nbytes), self.strides)


class ArchiveCache:
    """The one-tensor archives of a DCP checkpoint (one per chunk), each checked in full once per framing.

    ``torch.save`` writes the same bytes around the tensor data of every chunk of one dtype and shape: local
    headers, ``data.pkl``, the small records, the central directory, all with offsets relative to the archive,
    except for a serialization id of the same length and the records' CRC-32s, which torch never checks.
    :meth:`read` parses and checks an archive as :func:`read_archive` does, and remembers its bytes outside
    the tensor data when the checks read none of the data. :meth:`lookup` then takes any archive of the same
    length whose bytes outside the data are those same bytes, but for those holes (a serialization id must
    still be UTF-8 text, as torch decodes it): the checks, a function of exactly those bytes, would find the
    same tensor at the same place. It costs a read of the head and the tail and a compare, instead of a zip
    and pickle parse (a 1M-chunk checkpoint has 1M archives).
    """

    _KEEP = 8  # framings remembered per archive length; a checkpoint has a handful (one per dtype and shape)
    _WHOLE = 16384  # archives up to this size are read in one piece

    def __init__(self) -> None:
        self._by_length: dict[int, tuple[int, int, list[_Framing]]] = {}  # (longest head, longest tail, framings)

    def lookup(self, pread: Callable[[int, int], bytes], path: str, start: int, length: int) -> TensorRef | None:
        """The tensor of the archive at ``start`` if its framing is one already checked, else None."""
        framing = self.find(pread, start, length)
        return None if framing is None else framing.ref(path, start)

    def find(self, pread: Callable[[int, int], bytes], start: int, length: int) -> _Framing | None:
        """:meth:`lookup`'s framing, which tells the tensor's dtype, shape, strides, and ``offset`` and ``nbytes``
        in the archive, without making a :class:`TensorRef`."""
        known = self._by_length.get(length)
        if known is None:
            return None
        head_len, tail_len, framings = known
        if length <= self._WHOLE:
            head = tail = pread(length, start)  # offsets into the tail count from the end: the whole serves
            if len(head) != length:  # the file ends early; the full read says so
                return None
        else:
            head, tail = pread(head_len, start), pread(tail_len, start + length - tail_len)
            if len(tail) != tail_len or len(head) != head_len:
                return None
        for f in framings:
            if f.matches(head, tail):
                return f
        for f in framings:
            if f.holes and f.matches(head, tail, loose=True):
                return f
        return None

    def read(self, path: str, start: int, length: int, *, pread: Callable[[int, int], bytes], where: str) -> Any:
        """:func:`read_archive` of the archive at ``start`` (``tree=False``), remembering its framing; its pickle
        held to what ``torch.load(weights_only=True)`` reads, as DCP loads a chunk."""
        window = Window(pread, start, length)
        value, _, _, storages = _parse(window, path, where or path, None, weights_only=True)
        _, _, framings = self._by_length.get(length, (0, 0, []))
        if isinstance(value, TensorRef) and len(storages) == 1 and len(framings) < self._KEEP:
            lo, hi = storages[0].span.offset - start, storages[0].span.offset - start + storages[0].span.length
            if 0 <= lo <= hi <= length and all(end <= lo or begin >= hi for begin, end in window.reads):
                head, tail = pread(lo, start), pread(length - hi, start + hi)
                if len(head) == lo and len(tail) == length - hi:
                    framings.append(_Framing(head, tail, _holes(window, head, tail, lo, hi), value, start))
                    self._by_length[length] = (max(len(f.head) for f in framings),
                                               max(len(f.tail) for f in framings), framings)
        return value


def _holes(window: Window, head: bytes, tail: bytes, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """The window's holes outside the tensor data ``[lo, hi)``, and the CRC-32 of every data descriptor that
    follows its record with the descriptor's signature (torch reads sizes and CRCs from the central directory
    only), unless the checks read those bytes for something else: a window's hole is read once, by the check
    that found it; a record that overlaps it (a pickle that is also the serialization id, a version on a
    CRC-32) reads it again, and then it must not differ between archives."""
    length = hi + len(tail)

    def at(a: int, b: int) -> bytes:
        return head[a:b] if b <= lo else tail[a - hi:b - hi] if a >= hi else b""

    def readers(a: int, b: int) -> int:
        return sum(start < b and end > a for start, end in window.reads)

    holes = [h for h in window.holes if readers(h[0], h[1]) == 1]
    for d in window.descriptors:
        if d + 8 <= length and at(d, d + 4) == b"PK\x07\x08" and not readers(d + 4, d + 8):
            holes.append((d + 4, d + 8, False))
    return [h for h in holes if h[1] <= lo or h[0] >= hi]


def load_blob(span: Span, *, where: str, extra_globals: dict | None = None) -> Any:
    return read_archive(span.file, span.offset, span.length, where=where, extra_globals=extra_globals)

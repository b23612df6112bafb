"""The zip layer of a ``torch.save`` archive, held to what torch's reader (miniz, then PyTorchStreamReader)
accepts: the end records, the central directory, each record's local header, and the small records torch
reads before the pickle (version, byte order, alignment, serialization id).

:func:`records` gives each record's name and byte span; :class:`Window` is the archive as a file of its own,
noting what the checks read and which bytes may differ between archives of one framing.
"""

from __future__ import annotations

import io
import re
import struct
from collections.abc import Callable

from ..core.manifest import Span
from ..errors import FormatError

__all__ = ["EDGE", "Window", "records"]

EDGE = 4096
"""Bytes read once at each end of an archive (:class:`Window`)."""


class Window(io.RawIOBase):
    """``length`` bytes of an open file from ``start``, as a file of its own (the zip directory is at the end).
    The first and last 4 KiB are read once: for a DCP chunk they hold every header :func:`records` reads, so
    parsing costs two reads instead of a dozen seeks."""

    def __init__(self, pread: Callable[[int, int], bytes], start: int, length: int) -> None:
        self._pread, self.start, self.length, self._pos = pread, start, length, 0
        self.reads: list[tuple[int, int]] = []
        """Every byte range the parser asked for, so that :class:`~ckptkit.codecs.torchzip_read.ArchiveCache`
        knows what its checks saw."""
        self.holes: list[tuple[int, int, bool]] = []
        """Byte ranges ``(start, end, text)`` whose values neither torch nor the checks use (CRC-32s), or use
        only as UTF-8 text (``text``: the serialization id): what may differ between archives of one framing."""
        self.descriptors: list[int] = []
        """Where the data descriptors of records written with one (flag bit 3) would begin."""
        self._head = pread(min(length, EDGE), start)
        tail_at = max(0, length - EDGE)
        self._tail_at, self._tail = tail_at, pread(length - tail_at, start + tail_at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: 0, 1: self._pos, 2: self.length}[whence] + offset
        return self._pos

    def read(self, n: int = -1, *, seen: bool = True) -> bytes:
        """``n`` bytes from the position; ``seen=False`` leaves them out of :attr:`reads` (the caller notes the
        part its result depends on)."""
        end = self.length if n is None or n < 0 else min(self.length, self._pos + n)
        if end <= self._pos:
            return b""
        if seen:
            self.reads.append((self._pos, end))
        if end <= len(self._head):
            data = self._head[self._pos:end]
        elif self._pos >= self._tail_at:
            data = self._tail[self._pos - self._tail_at:end - self._tail_at]
        else:
            data = self._pread(end - self._pos, self.start + self._pos)
        self._pos += len(data)
        return data



_EOCD = struct.Struct("<4sHHHHIIH")                 # end of central directory, 22 bytes
_EOCD64_LOCATOR = struct.Struct("<4sIQI")           # 20 bytes, just before it in a zip64 archive
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")             # 56 bytes
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")     # central directory entry, 46 bytes
_LOCAL = struct.Struct("<4sHHHHHIIIHH")             # local file header, 30 bytes
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_MAX_VERSION = 10  # torch 2.13 reads archive versions 1 to 10 (kMaxSupportedFileFormatVersion)


def _zip64_values(extra: bytes, wanted: int) -> list[int]:
    """The 8-byte values a zip64 extra field holds (the sizes and offset that did not fit in 32 bits)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            body = extra[pos + 4:pos + 4 + size]
            return list(struct.unpack_from(f"<{wanted}Q", body)) if len(body) >= 8 * wanted else []
        pos += 4 + size
    return []


_Bad = Callable[[str], FormatError]
"""Makes the error for an archive torch's reader refuses, from what is wrong with it."""


def records(window: Window, path: str, where: str) -> dict[str, Span]:
    """Record name to the span of its bytes, read from the zip's central directory and held to what torch's
    reader (miniz, then PyTorchStreamReader) accepts: one disk, a central directory exactly where the end
    record puts it, stored records whose local headers are where the directory says, every record in one
    ``archive_name/`` directory. What Python's zipfile forgives (data before the archive, say), torch does not.

    Args:
        window: The archive, as :class:`Window` gives it.
        path: The file the spans are into.
        where: What the errors name.

    Returns:
        Each record's name, less the archive's directory, to the span of its bytes in ``path``.

    Raises:
        FormatError: The archive is not one torch's reader takes.
    """
    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: not a torch.save archive torch can read ({what})")

    count, cd_size, cd_offset = _directory(window, bad)
    window.seek(cd_offset)
    cd = window.read(cd_size)
    out: dict[str, Span] = {}
    prefix = None
    folded: set[bytes] = set()
    pos = 0
    for _ in range(count):
        pos, raw, name, flags, size, offset = _central_entry(window, cd, cd_offset, pos, bad)
        data = _local_data(window, name, offset, size, bad)
        first, slash, _ = name.partition("/")
        prefix = prefix if prefix is not None else first + slash
        if not slash or not name.startswith(prefix):
            raise bad(f"record {name} is not in the directory {prefix or name!r} every record shares")
        if name[len(prefix):].partition("\0")[0] == "constants.pkl":  # torch lists the names as C strings
            raise bad(f"record {name}: torch.load takes an archive with a constants.pkl for TorchScript, and "
                      "loads it with torch.jit.load (or, with weights_only=True, refuses it)")
        if raw.lower() in folded:  # miniz finds a name by binary search, ignoring (ASCII) case: any of them
            raise bad(f"two records named {name} (in any case); torch's zip reader may read either")
        folded.add(raw.lower())
        out[name[len(prefix):]] = Span(path, window.start + data, size)
        if flags & 0x8:
            window.descriptors.append(data + size)
    _check_small_records(out, window, bad)
    return out


def _directory(window: Window, bad: _Bad) -> tuple[int, int, int]:
    """The central directory's entry count, size and offset, from the end records (zip64's where present),
    held to one disk and to a directory that ends where its end record is."""
    length = window.length
    # The end record is the archive's last 22 bytes unless a comment follows it (up to 64 KiB): look in the
    # window's tail first, which a remote read fetched already, and further back only if it is not there.
    for tail_len in (min(length, EDGE), min(length, _EOCD.size + 0xFFFF)):
        window.seek(length - tail_len)
        tail = window.read(tail_len, seen=False)
        at = tail.rfind(b"PK\x05\x06")
        if at >= 0 and at + _EOCD.size <= len(tail):
            break
    else:
        raise bad("no end of central directory record; truncated?")
    _, disk, cd_disk, on_disk, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    eocd = length - tail_len + at
    window.reads.append((eocd, length))  # the last signature: what lies before it cannot change where it is
    if eocd + _EOCD.size + comment != length:
        raise bad(f"{length - eocd - _EOCD.size - comment} bytes after the end of the central directory")
    end_of_cd = eocd
    window.seek(max(0, eocd - _EOCD64_LOCATOR.size))
    locator = window.read(_EOCD64_LOCATOR.size) if eocd >= _EOCD64_LOCATOR.size else b""
    if locator[:4] == b"PK\x06\x07":  # torch's writer (miniz) always adds the zip64 records, and its reader uses them
        _, _, where64, disks = _EOCD64_LOCATOR.unpack(locator)
        window.seek(where64)
        record = window.read(_EOCD64.size)
        if len(record) != _EOCD64.size or record[:4] != b"PK\x06\x06" or where64 + _EOCD64.size > eocd:
            raise bad("a damaged zip64 end record")
        _, size64, _, _, disk, cd_disk, on_disk, count, cd_size, cd_offset = _EOCD64.unpack(record)
        if disks != 1 or size64 < _EOCD64.size - 12:  # miniz refuses either; its size leaves out 12 bytes
            raise bad(f"a zip64 end record of {size64} bytes, on {disks} disks; torch's reader takes one disk and "
                      f"at least {_EOCD64.size - 12} bytes")
        end_of_cd = where64
    elif _U16 in (disk, cd_disk, on_disk, count) or _U32 in (cd_size, cd_offset):
        raise bad("zip64 values without a zip64 end record")
    if disk != 0 or cd_disk != 0 or on_disk != count:
        raise bad("parts of it on other disks")
    if cd_size < count * _CENTRAL.size or cd_offset + cd_size != end_of_cd:
        raise bad(f"the central directory at {cd_offset} ({cd_size} bytes) does not end where its end record is")
    return count, cd_size, cd_offset


def _central_entry(window: Window, cd: bytes, cd_offset: int, pos: int,
                   bad: _Bad) -> tuple[int, bytes, str, int, int, int]:
    """The central directory entry at ``pos`` of ``cd``: where the next one begins, the record's raw and
    decoded name, its flags, size and offset; a record torch would not read as stored bytes is refused."""
    if pos + _CENTRAL.size > len(cd):
        raise bad("the central directory is shorter than its entries")
    (sig, _, _, flags, method, _, _, _, comp, size, name_len, extra_len, comment_len, entry_disk, _, attributes,
     offset) = _CENTRAL.unpack_from(cd, pos)
    window.holes.append((cd_offset + pos + 16, cd_offset + pos + 20, False))  # the CRC-32: torch never checks it
    raw = cd[pos + _CENTRAL.size:pos + _CENTRAL.size + name_len]
    extra = cd[pos + _CENTRAL.size + name_len:pos + _CENTRAL.size + name_len + extra_len]
    pos += _CENTRAL.size + name_len + extra_len + comment_len
    if sig != b"PK\x01\x02" or pos > len(cd):
        raise bad("a damaged central directory entry")
    try:
        name = raw.decode("utf-8")  # torch hands record names to Python as UTF-8 text
    except UnicodeDecodeError:
        raise bad(f"record name {raw!r:.60} is not UTF-8") from None
    # miniz takes a record for a directory by its DOS attributes or a name ending in "/", and then reads none
    # of its bytes, nor says so. torch looks up no name ending in "/" but a storage's (see storage_loader):
    # entries that zip -r writes for the folders are never read.
    if attributes & 0x10 and not name.endswith("/"):
        raise bad(f"record {name} is a directory to torch's zip reader, which reads none of its bytes")
    wide = [v for v in (size, comp, offset) if v == _U32]
    if wide:
        values = iter(_zip64_values(extra, len(wide)))
        size, comp, offset = (next(values, -1) if v == _U32 else v for v in (size, comp, offset))
    if method != 0 or flags & 0x2061:  # encrypted, patch data, strong encryption, masked: miniz refuses them
        raise bad(f"record {name} is compressed or encrypted; torch.save archives store records raw")
    if comp != size or entry_disk != 0 or offset < 0 or offset + _LOCAL.size + size > window.length:
        raise bad(f"record {name} has inconsistent sizes or lies outside the archive")
    return pos, raw, name, flags, size, offset


def _local_data(window: Window, name: str, offset: int, size: int, bad: _Bad) -> int:
    """Where record ``name``'s bytes begin, after its local header at ``offset``."""
    window.seek(offset)
    head = window.read(_LOCAL.size)
    if len(head) != _LOCAL.size or head[:4] != b"PK\x03\x04":
        raise bad(f"no local header where the directory puts record {name}")
    local_name, local_extra = struct.unpack_from("<HH", head, 26)
    data = offset + _LOCAL.size + local_name + local_extra
    if data + size > window.length:
        raise bad(f"record {name} runs past the end of the archive")
    return data


def _check_small_records(spans: dict[str, Span], window: Window, bad: _Bad) -> None:
    """The records torch reads before the pickle: the format version, the byte order, the alignment."""
    start = window.start

    def read(name: str) -> bytes | None:
        span = spans.get(name)
        if span is None:
            return None
        if span.length > 256:  # torch parses or decodes all of it: a check of a part would not be torch's
            raise bad(f"record {name} holds {span.length} bytes; ckptkit reads up to 256 (torch.save "
                      "writes a few)")
        window.seek(span.offset - start)
        return window.read(span.length)

    version = read(".data/version") if ".data/version" in spans else read("version")
    number = re.match(rb"\s*[-+]?\d+", version or b"")
    if version is None or number is None or not 1 <= int(number.group()) <= _MAX_VERSION:
        raise bad(f"its version record is {version!r:.40}; torch reads versions 1 to {_MAX_VERSION}")
    order = read("byteorder")
    if order not in (None, b"little"):
        raise bad(f"byte order {order!r:.40}; ckptkit reads little-endian archives (torch would byte-swap a "
                  "big-endian one)")
    alignment = read(".storage_alignment")
    if alignment is not None and not re.fullmatch(rb"\s*[-+]?\d+\s*", alignment):
        raise bad(f"storage alignment {alignment!r:.40} is not a number")
    serial = read(".data/serialization_id")
    if serial:  # torch.save writes a new one into every archive; torch.load only decodes it
        at = spans[".data/serialization_id"].offset - start
        window.holes.append((at, at + len(serial), True))
    try:
        (serial or b"").decode("utf-8")  # torch hands it to Python as text
    except UnicodeDecodeError:
        raise bad(f"serialization id {serial!r:.60} is not UTF-8 text") from None

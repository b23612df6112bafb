"""A local destination: a staging directory beside DST, moved into place in one step; what dead runs left.

1. :func:`stage` recovers what dead runs left in DST's directory (:func:`recover`), then makes an empty
   staging directory ``.NAME.ckptkit-partial-HOST-PID`` beside DST: on the same filesystem, so that the
   commit is a rename. HOST and PID say whose it is, so a later run can tell a leftover from a run in flight.
2. The writers fill ``staging.path``.
3. :meth:`Staging.commit` carries the files of the old DST the output keeps (a model folder's tokenizer:
   :func:`carry`, hard links) into the staging directory, writes the completion marker (saves), then moves the
   result into place in one step:
   ``renameat2(RENAME_EXCHANGE)`` swaps it with an existing DST (``replace=True``), so DST is never missing,
   and ``renameat2(RENAME_NOREPLACE)`` refuses a DST that another run put there meanwhile. The old copy,
   now under the staging name, is removed afterwards; the directory is fsynced with ``fsync`` or a marker.
4. :meth:`Staging.abort` removes the staging directory on any failure.

A kill between any two steps leaves DST as it was before or as it is after, plus at most a staging name of a
process that is gone; the next :func:`stage` or :func:`recover` in that directory removes it and says so in
one line on stderr. Only leftovers of this host whose process has died are touched (checkpoints live on
shared filesystems; another host's PIDs mean nothing here), and not one whose directory a live process still
holds an ``flock`` on (a process of another PID namespace on this host).

Where the filesystem refuses ``renameat2`` (EINVAL: NFS and other network filesystems; ENOSYS: old kernels),
the same steps run as two plain renames under an ``flock`` of DST's directory: no-replace then holds against
other ckptkit runs (not against other programs), and a kill between the renames leaves the old copy under
``.NAME.ckptkit-old-HOST-PID``, which recovery renames back if DST is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from ....errors import UsageError

__all__ = ["COMPLETE", "LEFTOVER", "Staging", "carry", "check_destination", "recover", "stage"]

COMPLETE = ".ckptkit-complete"
"""The completion marker a save's step directory holds (written by :meth:`Staging.commit`)."""
LEFTOVER = re.compile(r"\.(?P<name>.+)\.ckptkit-(?P<kind>partial|old)-(?P<host>.+)-(?P<pid>\d+)")
"""The name of what a run owns beside its DST: a staging directory, an old copy, an object store's marker."""



# --------------------------------------------------------------------------------------------------------
# Names, owners, locks


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"


def owned_name(name: str, kind: str) -> str:
    return f".{name}.ckptkit-{kind}-{host_name()}-{os.getpid()}"


def pid_gone(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _try_lock(fd: int) -> bool | None:
    """Take an exclusive flock without waiting: True taken, False held by another process, None unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _held_by_live_process(path: Path) -> bool:
    """Whether a live process holds the flock a run keeps on its staging directory while it works."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False  # not a directory we can open (a file, or gone): nobody holds it
    try:
        return _try_lock(fd) is False
    finally:
        os.close(fd)


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An flock on ``directory`` for the renames and recovery in it; best effort where flock is unsupported."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(OSError):  # NFS without locking, Lustre's noflock: carry on unlocked
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: Path) -> None:
    """Remove a file, link or directory tree; never follows a symbolic link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def announce(message: str) -> None:
    print(f"ckptkit: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------
# Atomic renames


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2_function():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None  # not glibc 2.28+ (musl, macOS): the fallback below
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _renameat2_function()


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``: True done; False where this system or filesystem cannot (the caller falls
    back). Raises OSError for every other failure, EEXIST and ENOENT included."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


# --------------------------------------------------------------------------------------------------------
# Staging and commit


class Staging:
    """A staging directory beside ``dst``, owned by this process until :meth:`commit` or :meth:`abort`.

    ``owner=False`` is another rank's view of rank 0's staging directory: it writes there, nothing more.
    """

    def __init__(self, dst: Path, path: Path, lock_fd: int | None = None, owner: bool = True) -> None:
        self.dst, self.path, self._lock_fd, self.owner = dst, path, lock_fd, owner

    def commit(self, *, replace: bool, file: str | None = None, marker: str | None = None,
               fsync: bool = False, keep: tuple[str, ...] = ()) -> Path:
        """Move the staged output (or its one ``file``) to ``dst`` in one step and return ``dst``.

        ``replace=False`` refuses a DST that exists by now (exit 2); ``replace=True`` swaps it out atomically,
        the files and folders of the old DST named in ``keep`` carried into the output first (hard links where
        the filesystem has them), so that DST is the old folder or the new one with them, never a mix.
        ``marker`` is written as the completion marker first; ``fsync`` makes the staged tree durable first.
        """
        if replace and keep and file is None:
            try:
                carry(self.dst, self.path, keep)
            except BaseException:
                self.abort()
                raise
        if marker is not None:
            write_file(self.path / COMPLETE, marker, fsync=True)
        if fsync:
            for directory, _, _ in os.walk(self.path):
                fsync_dir(Path(directory))
        src = self.path / file if file else self.path
        try:
            with _directory_lock(self.dst.parent):
                if replace:
                    _swap_in(src, self.dst)
                else:
                    _move_in(src, self.dst)
            if fsync or marker is not None:
                # The rename made durable: asked for, or a save's step (its marker is). Without the files'
                # own fsync it would buy nothing, and on ext4 it waits for the journal to commit.
                fsync_dir(self.dst.parent)
        except BaseException:
            self.abort()
            raise
        self._finish()
        return self.dst

    def abort(self) -> None:
        """Remove the staging directory; ``dst`` is left as it was."""
        if self.owner:
            self._finish()

    def _finish(self) -> None:
        # What is left under the staging name is the old DST (after a swap), the empty directory around a
        # single file, or nothing.
        try:
            if _exists(self.path):
                remove_path(self.path)
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.abort()


def carry(old: Path, new: Path, keep: tuple[str, ...]) -> None:
    """Put the files and folders ``keep`` names (relative paths, a folder's ending in ``/``) of the directory
    ``old`` at the same places in ``new``: hard links (the same bytes, nothing copied), copies where the
    filesystem has no links, links as links. One that is gone meanwhile is skipped."""
    for rel in keep:
        src, dst = old / rel.rstrip("/"), new / rel.rstrip("/")
        if not _exists(src) or _exists(dst):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.is_dir():
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def stage(dst: Path | str, *, replace: bool) -> Staging:
    """Recover leftovers beside ``dst``, then make and own a fresh staging directory for it.

    ``replace=False`` refuses an existing DST here already, before anything is written (and again at commit).
    """
    dst = Path(dst).absolute()
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _check_writable(dst)  # says why, in DST's words
        raise _cannot_stage(dst, e) from e
    recover(dst.parent)
    if not replace and _exists(dst):
        raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    path = dst.parent / owned_name(dst.name, "partial")
    if _exists(path):  # a staging name of this very PID, from a process before us that had it
        remove_path(path)
    try:
        path.mkdir()
    except OSError as e:
        _check_writable(dst)
        raise _cannot_stage(dst, e) from e
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    _try_lock(fd)
    return Staging(dst, path, fd)


def _already_exists(dst: Path) -> UsageError:
    return UsageError(f"{dst} already exists (another run wrote it meanwhile?); pass --overwrite "
                      "(overwrite=True) to replace it")


def _move_in(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, refusing an existing ``dst`` (held under the directory lock)."""
    try:
        if _rename2(src, dst, _RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise _already_exists(dst) from None
    if src.is_file() and not src.is_symlink():
        try:
            os.link(src, dst)  # atomic no-replace for one file wherever hard links work
            src.unlink()
            return
        except FileExistsError:
            raise _already_exists(dst) from None
        except OSError:
            pass
    if _exists(dst):
        raise _already_exists(dst)
    os.rename(src, dst)


def _swap_in(src: Path, dst: Path) -> None:
    """Put ``src`` at ``dst``; the old ``dst``, if any, ends up at ``src``'s name. DST is never missing."""
    try:
        if _rename2(src, dst, _RENAME_EXCHANGE):
            return
    except FileNotFoundError:
        if not _exists(src):
            raise
        _move_in(src, dst)  # there was no DST to swap with
        return
    if not _exists(dst):
        os.rename(src, dst)
        return
    old = dst.parent / owned_name(dst.name, "old")
    os.rename(dst, old)  # a kill from here to the next rename: recover() renames ``old`` back
    os.rename(src, dst)
    os.rename(old, src)


def recover(directory: Path | str) -> list[str]:
    """Finish or undo what runs of this host that are gone left in ``directory``: restore a DST whose old copy
    sits under ``.NAME.ckptkit-old-*`` while DST is missing, and remove every other leftover. Says so on stderr
    in one line; returns what it did."""
    directory = Path(directory)
    done: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return done
    host = host_name()
    leftovers = [(e, m) for e in entries if (m := LEFTOVER.fullmatch(e.name)) and m["host"] == host
                 and pid_gone(int(m["pid"]))]
    if not leftovers:
        return done
    with _directory_lock(directory):
        for entry, m in leftovers:
            path = Path(entry.path)
            if not _exists(path) or _held_by_live_process(path):
                continue
            target = directory / m["name"]
            if m["kind"] == "old" and not _exists(target):
                os.rename(path, target)
                done.append(f"restored {target} from {path.name}")
            else:
                remove_path(path)
                done.append(f"removed {path.name}")
    if done:
        fsync_dir(directory)
        announce(f"{directory}: cleaned up after runs that are gone: {'; '.join(done)}")
    return done


def check_destination(dst: Path | str, *, overwrite: bool, sources: tuple[object, ...] = ()) -> Path:
    """Refuse a destination that exists (unless ``overwrite``), or that is, holds or lies inside any of
    ``sources``: the input the user named and every file read from it (those of other storages are never a
    local place). Returns DST made absolute."""
    dst = Path(dst).absolute()
    places = {dst.parent.resolve() / dst.name, dst.resolve()}  # where the rename lands; what a link names
    for src in sources:
        if not isinstance(src, (str, os.PathLike)):
            continue  # a path of another storage (a URL's) is never a local place
        src = Path(src).resolve()
        for d in places:
            if d == src or src in d.parents or d in src.parents:
                raise UsageError(f"destination {dst} overlaps the input {src}; ckptkit never writes into its input "
                                 "(nor next to what it reads, where the output would change what the input means)")
    if _exists(dst) and not overwrite:
        raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    _check_writable(dst)
    return dst


def _check_writable(dst: Path) -> None:
    """Refuse a DST that cannot be made, before anything is written, naming DST (not the staging directory
    beside it, where the write would fail): one inside a file, or in a directory this process may not write."""
    place = dst.parent
    while not place.exists() and place != place.parent:  # the directories made for DST start below ``place``
        place = place.parent
    if not place.is_dir():
        raise UsageError(f"{dst}: {place} is a file, not a directory; name a DST outside it")
    if not os.access(place, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(place).f_flag & os.ST_RDONLY)
        why = "is on a read-only filesystem" if read_only else "is not writable by this user"
        raise UsageError(f"{dst}: cannot write there: {place} {why}; name a DST on a filesystem you can write to")


def _cannot_stage(dst: Path, e: OSError) -> UsageError:
    """The error of a staging directory that could not be made, naming DST rather than the staging name."""
    return UsageError(f"{dst}: cannot write there ({e.strerror or e}, making its staging directory "
                      f"{Path(e.filename).name if e.filename else 'beside it'}); name another DST")



def write_file(path: Path, text: str, *, fsync: bool) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())



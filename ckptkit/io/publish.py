"""Publishing outputs: the one module that stages, commits, aborts and recovers them.

Every output ckptkit writes (a conversion's DST, a save's step directory) takes four steps:

1. :func:`stage` recovers what dead runs left in DST's directory (:func:`recover`), then makes an empty
   staging directory ``.NAME.ckptkit-partial-HOST-PID`` beside DST: on the same filesystem, so that the
   commit is a rename. HOST and PID say whose it is, so a later run can tell a leftover from a run in flight.
2. The writers fill ``staging.path``.
3. :meth:`Staging.commit` writes the completion marker (saves), then moves the result into place in one step:
   ``renameat2(RENAME_EXCHANGE)`` swaps it with an existing DST (``replace=True``), so DST is never missing,
   and ``renameat2(RENAME_NOREPLACE)`` refuses a DST that another run put there meanwhile. The old copy,
   now under the staging name, is removed afterwards; the directory is fsynced.
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

On an object store (no rename, no flock) the steps would map to: stage = a fresh prefix; commit = write the
checkpoint's commit file last (DCP's ``.metadata``, the HF index, or the single file); abort = delete the
prefix; recover = delete prefixes of writers that are gone.

Run directories (``ckptkit.save(..., step=N)``) add, after the commit: ``latest`` (a file naming the newest
step directory, written atomically) and rotation (:func:`rotate`), which keeps the most recent *saves*, counted
by the save number in each step's completion marker, and never the step just published.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import FormatError, IncompleteCheckpointError, UsageError

__all__ = ["COMPLETE", "LATEST", "Staging", "StepDir", "check_destination", "complete_steps", "next_save",
           "point_latest", "recover", "resolve", "rotate", "stage", "step_dir"]

COMPLETE = ".ckptkit-complete"
LATEST = "latest"
_STEP = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.ckptkit-(?P<kind>partial|old)-(?P<host>.+)-(?P<pid>\d+)")
_SMALL_FILE = 4096  # latest and the completion marker are a line each; anything longer is not ours


# --------------------------------------------------------------------------------------------------------
# Names, owners, locks


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"


def _owned_name(name: str, kind: str) -> str:
    return f".{name}.ckptkit-{kind}-{_host()}-{os.getpid()}"


def _pid_gone(pid: int) -> bool:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Remove a file, link or directory tree; never follows a symbolic link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _note(message: str) -> None:
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
               fsync: bool = False) -> Path:
        """Move the staged output (or its one ``file``) to ``dst`` in one step and return ``dst``.

        ``replace=False`` refuses a DST that exists by now (exit 2); ``replace=True`` swaps it out atomically.
        ``marker`` is written as the completion marker first; ``fsync`` makes the staged tree durable first.
        """
        if marker is not None:
            _write_file(self.path / COMPLETE, marker, fsync=True)
        if fsync:
            for directory, _, _ in os.walk(self.path):
                _fsync_dir(Path(directory))
        src = self.path / file if file else self.path
        try:
            with _directory_lock(self.dst.parent):
                if replace:
                    _swap_in(src, self.dst)
                else:
                    _move_in(src, self.dst)
            _fsync_dir(self.dst.parent)
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
                _remove(self.path)
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.abort()


def stage(dst: Path | str, *, replace: bool) -> Staging:
    """Recover leftovers beside ``dst``, then make and own a fresh staging directory for it.

    ``replace=False`` refuses an existing DST here already, before anything is written (and again at commit).
    """
    dst = Path(dst).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    recover(dst.parent)
    if not replace and _exists(dst):
        raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    path = dst.parent / _owned_name(dst.name, "partial")
    if _exists(path):  # a staging name of this very PID, from a process before us that had it
        _remove(path)
    path.mkdir()
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
    old = dst.parent / _owned_name(dst.name, "old")
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
    host = _host()
    leftovers = [(e, m) for e in entries if (m := _LEFTOVER.fullmatch(e.name)) and m["host"] == host
                 and _pid_gone(int(m["pid"]))]
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
                _remove(path)
                done.append(f"removed {path.name}")
    if done:
        _fsync_dir(directory)
        _note(f"{directory}: cleaned up after runs that are gone: {'; '.join(done)}")
    return done


def check_destination(dst: Path | str, *, overwrite: bool, sources: tuple[Path | str, ...] = ()) -> Path:
    """Refuse a destination that exists (unless ``overwrite``), or that is, holds or lies inside any of
    ``sources``: the input the user named and every file read from it. Returns DST made absolute."""
    dst = Path(dst).absolute()
    places = {dst.parent.resolve() / dst.name, dst.resolve()}  # where the rename lands; what a link names
    for src in sources:
        src = Path(src).resolve()
        for d in places:
            if d == src or src in d.parents or d in src.parents:
                raise UsageError(f"destination {dst} overlaps the input {src}; ckptkit never writes into its input "
                                 "(nor next to what it reads, where the output would change what the input means)")
    if _exists(dst) and not overwrite:
        raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    return dst


# --------------------------------------------------------------------------------------------------------
# Run directories: step directories, latest, rotation


@dataclass(frozen=True)
class StepDir:
    step: int
    path: Path
    save: int | None
    """The save number from the completion marker; None for a step saved before ckptkit recorded it."""

    @property
    def order(self) -> tuple[int, int]:
        return (-1 if self.save is None else self.save, self.step)

    @property
    def nbytes(self) -> int:
        total = 0
        for directory, _, files in os.walk(self.path):  # os.walk does not follow links into other trees
            total += sum(os.lstat(os.path.join(directory, f)).st_size for f in files)
        return total


def step_dir(root: Path | str, step: int) -> Path:
    if step < 0:
        raise UsageError(f"step must be >= 0, got {step}")
    return Path(root) / f"step-{step:08d}"


def marker_text(*, save: int, step: int | None) -> str:
    """The completion marker of a save: which save it was, so that rotation can tell the most recent ones."""
    return json.dumps({"save": save, "step": step}) + "\n"


def _read_small(path: Path) -> str | None:
    """A regular file's text, or None for a link, a directory, or anything longer than a line."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _SMALL_FILE:
            return None
        return path.read_text(errors="replace")
    except OSError:
        return None


def _save_number(marker: Path) -> int | None:
    text = _read_small(marker)
    try:
        save = json.loads(text)["save"] if text else None
    except (ValueError, TypeError, KeyError, RecursionError):
        return None  # "complete\n" from before save numbers, or a marker that is not ours
    return save if isinstance(save, int) and not isinstance(save, bool) and save >= 0 else None


def _is_complete(path: Path) -> bool:
    return _read_small(path / COMPLETE) is not None


def complete_steps(root: Path | str) -> list[StepDir]:
    """Complete step directories directly under ``root``, oldest save first. Partial ones (no marker) and
    symbolic links are ignored: a step directory is a real directory inside the run directory."""
    root = Path(root)
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for e in entries:
        m = _STEP.fullmatch(e.name)
        if m and e.is_dir(follow_symlinks=False) and _is_complete(Path(e.path)):
            found.append(StepDir(int(m.group(1)), Path(e.path), _save_number(Path(e.path) / COMPLETE)))
    return sorted(found, key=lambda s: s.order)


def next_save(root: Path | str) -> int:
    """The save number for a new save under ``root``: one more than any complete step's."""
    return 1 + max((s.save for s in complete_steps(root) if s.save is not None), default=0)


def _write_file(path: Path, text: str, *, fsync: bool) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def point_latest(root: Path, step: Path) -> None:
    """Make ``root/latest`` name ``step`` (a directory in ``root``), atomically."""
    tmp = root / _owned_name(LATEST, "partial")
    _write_file(tmp, step.name + "\n", fsync=True)
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def resolve(path: Path | str) -> Path:
    """A checkpoint directory from ``path``: the step ``latest`` names when ``path`` is a run directory, the
    most recently saved complete step when it has no ``latest``, else ``path`` itself.

    ``latest`` is checked as untrusted: it must be a file naming a step directory inside ``path``, not a
    symbolic link, and that step must be complete.
    """
    path = Path(path)
    pointer = path / LATEST
    if not _exists(pointer):
        steps = complete_steps(path)
        return steps[-1].path if steps else path
    text = _read_small(pointer)
    if text is None:
        raise FormatError(f"{pointer}: expected a small file naming a step directory (ckptkit writes "
                          "'step-NNNNNNNN'), found a link, a directory or a large file")
    name = text.strip()
    if not _STEP.fullmatch(name):
        raise FormatError(f"{pointer}: names {name[:80]!r}; expected a step directory of {path} "
                          "('step-NNNNNNNN'), not a path")
    target = path / name
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{pointer} names {name}, which does not exist") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise FormatError(f"{pointer} names {name}, which is not a directory of {path} (a symbolic link?); "
                          "ckptkit follows latest only to a step directory inside the run directory")
    if not _is_complete(target):
        raise IncompleteCheckpointError(f"{pointer} names {name}, which is not a complete checkpoint")
    return target


def rotate(root: Path | str, *, keep: Path, keep_last: int | None = None,
           max_total_bytes: int | None = None) -> list[Path]:
    """Remove complete steps of the least recent saves beyond ``keep_last`` or ``max_total_bytes``; never
    ``keep`` (the step just published). Never follows a link. Returns the removed paths."""
    if keep_last is not None and keep_last < 1:
        raise UsageError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    steps = complete_steps(root)
    sizes = {s.path: s.nbytes for s in steps} if max_total_bytes is not None else {}
    count, total = len(steps), sum(sizes.values())
    removed = []
    for victim in [s for s in steps if s.path != Path(keep)]:
        over_count = keep_last is not None and count > keep_last
        over_size = max_total_bytes is not None and total > max_total_bytes
        if not (over_count or over_size):
            break
        # Out of sight first, in one rename: a kill mid-delete leaves a leftover that recover() removes,
        # never a half-deleted step that still looks complete.
        trash = root / _owned_name(victim.path.name, "partial")
        os.rename(victim.path, trash)
        _remove(trash)
        removed.append(victim.path)
        count, total = count - 1, total - sizes.get(victim.path, 0)
    return removed

"""Publishing outputs: the one module that stages, commits, aborts and recovers them.

Every output ckptkit writes (a conversion's DST, a save's step directory) takes four steps:

1. :func:`stage` recovers what dead runs left in DST's directory (:func:`recover`), then makes an empty
   staging directory ``.NAME.ckptkit-partial-HOST-PID`` beside DST: on the same filesystem, so that the
   commit is a rename. HOST and PID say whose it is, so a later run can tell a leftover from a run in flight.
2. The writers fill ``staging.path``.
3. :meth:`Staging.commit` writes the completion marker (saves), then moves the result into place in one step:
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

On an object store (a URL DST: no rename, no flock) the same four steps are :class:`ObjectStaging`'s. There is
no staging name to rename from, so the output is written in place and its *commit file* (DCP's ``.metadata``,
the HF index, ``flat_layout.json``, or the single file itself) is put last: until then every reader refuses
DST as incomplete. Each object appears whole or not at all (a multipart upload becomes visible when it
completes). :func:`stage_object` puts a marker ``.NAME.ckptkit-partial-HOST-PID`` beside DST, which names the
run and its commit file; :meth:`ObjectStaging.abort` deletes what the run put; :func:`recover_objects` cleans
up after runs of this host that are gone (marker, objects of an uncommitted DST, S3 multipart uploads).
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
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import cast

from ..errors import UsageError
from .remote import NoCredentialsError, RemotePath, abort_uploads, is_url, url_error

__all__ = ["COMPLETE", "ObjectStaging", "Staging", "check_destination", "recover", "recover_objects", "stage",
           "stage_object"]

COMPLETE = ".ckptkit-complete"
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.ckptkit-(?P<kind>partial|old)-(?P<host>.+)-(?P<pid>\d+)")
_SMALL_FILE = 4096  # a marker is a line; anything longer is not ours


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


def _write_file(path: Path, text: str, *, fsync: bool) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


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
            if fsync or marker is not None:
                # The rename made durable: asked for, or a save's step (its marker is). Without the files'
                # own fsync it would buy nothing, and on ext4 it waits for the journal to commit.
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
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _check_writable(dst)  # says why, in DST's words
        raise _cannot_stage(dst, e) from e
    recover(dst.parent)
    if not replace and _exists(dst):
        raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    path = dst.parent / _owned_name(dst.name, "partial")
    if _exists(path):  # a staging name of this very PID, from a process before us that had it
        _remove(path)
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


def check_destination(dst: Path | str, *, overwrite: bool, sources: tuple[Path | str, ...] = (),
                      dry_run: bool = False) -> Path:
    """Refuse a destination that exists (unless ``overwrite``), or that is, holds or lies inside any of
    ``sources``: the input the user named and every file read from it. Returns DST made absolute.
    ``dry_run`` changes nothing: what dead runs left on an object store is judged, not cleaned up."""
    if is_url(dst):
        try:
            return _check_object_destination(cast(RemotePath, dst), overwrite, sources, dry_run)
        except NoCredentialsError:
            raise NoCredentialsError.of(str(dst)) from None  # found on DST's directory; DST is what the user named
    dst = Path(dst).absolute()
    places = {dst.parent.resolve() / dst.name, dst.resolve()}  # where the rename lands; what a link names
    for src in sources:
        if is_url(src):
            continue  # a URL is never a local place
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


# --------------------------------------------------------------------------------------------------------
# Object stores


def _check_object_destination(dst: RemotePath, overwrite: bool, sources: tuple[Path | str, ...],
                              dry_run: bool) -> Path:
    if dst.fs.protocol in ("hf", ("hf",)):
        raise UsageError(f"{dst}: ckptkit reads hf:// but does not write there; write the output locally and "
                         "upload it (huggingface-cli upload)")
    if "/" not in dst.path.strip("/"):
        raise UsageError(f"{dst}: name a prefix inside the bucket (s3://bucket/name), not the bucket itself")
    url = str(dst)
    for src in sources:
        if is_url(src):
            there = str(src).rstrip("/")
            if url == there or there.startswith(url + "/") or url.startswith(there + "/"):
                raise UsageError(f"destination {url} overlaps the input {there}; ckptkit never writes into its "
                                 "input (nor next to what it reads, where the output would change what the input "
                                 "means)")
    # What a dead run of this host left at DST is not an output: remove it before asking whether DST exists
    # (a dry run only leaves it out of the question, as the real run will have removed it).
    if not dry_run:
        recover_objects(dst.parent)
    elif any(m["name"] == dst.name and not _is_committed(dst, m["commit"]) for _, m in _dead_markers(dst.parent)):
        return cast(Path, dst)
    if not overwrite and dst.exists():
        raise UsageError(f"{url} already exists; pass --overwrite (overwrite=True) to replace it")
    return cast(Path, dst)


class ObjectStaging:
    """An output on an object store, written in place at ``dst``; owned by this process until :meth:`commit` or
    :meth:`abort`.

    Call order: 1. :func:`stage_object` makes it; 2. the writer calls :meth:`started` for each file, then puts
    it whole, every file before the commit file, the commit file last; 3. :meth:`commit`; or, on any failure,
    4. :meth:`abort`.
    """

    def __init__(self, dst: RemotePath, marker: RemotePath, single_file: bool) -> None:
        self.dst, self.marker, self.single_file = dst, marker, single_file
        self._started: list[RemotePath] = []

    def target(self, relpath: str) -> RemotePath:
        """Where the plan's file ``relpath`` goes."""
        return self.dst if self.single_file else self.dst / relpath

    def started(self, relpath: str) -> RemotePath:
        """Record that the writer is putting ``relpath`` (removed again by :meth:`abort`); returns its place."""
        target = self.target(relpath)
        self._started.append(target)
        return target

    def commit(self) -> Path:
        """The commit file is in place: the output is complete. Removes the marker."""
        _remove_objects([self.marker])
        return cast(Path, self.dst)

    def abort(self) -> None:
        """Remove what this run put (a single file's upload never completed, so the old DST stays), then the
        marker. S3 multipart uploads in progress were aborted by their writers; a kill leaves them to
        :func:`recover_objects`."""
        try:
            _remove_objects([] if self.single_file else self._started)
        finally:
            _remove_objects([self.marker])

    def __enter__(self) -> ObjectStaging:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is not None:
            self.abort()


def _remove_objects(paths: list[RemotePath]) -> None:
    if not paths:
        return
    fs = paths[0].fs
    with contextlib.suppress(FileNotFoundError):
        try:
            fs.rm([p.path for p in paths])
        except Exception as e:
            raise url_error(str(paths[0]), e) from e


def _is_committed(dst: RemotePath, commit: str | None) -> bool:
    return dst.is_file() if commit is None else (dst / commit).exists()


def stage_object(dst: RemotePath, *, replace: bool, commit: str | None) -> ObjectStaging:
    """Clean up after dead runs beside ``dst``, check it, put this run's marker beside it and, with ``replace``,
    remove the old DST: its commit file first, so that no reader ever sees old files beside new ones.

    ``commit`` is the plan's commit file, None when DST is the single file itself (an upload replaces an old
    object atomically as it completes, so the old one stays until then).
    """
    recover_objects(dst.parent)
    writers = _markers(dst.parent, dst.name)
    if writers and not replace:
        m = writers[0][1]
        raise UsageError(f"{dst} is being written by {m['host']} process {m['pid']} (its marker "
                         f"{writers[0][0].name} is beside it); if that run is gone, pass --overwrite to replace it")
    if not replace and dst.exists():
        raise UsageError(f"{dst} already exists; pass --overwrite (overwrite=True) to replace it")
    marker = dst.parent / _owned_name(dst.name, "partial")
    note = {"host": _host(), "pid": os.getpid(), "dst": str(dst), "commit": commit}
    try:
        marker.fs.pipe_file(marker.path, (json.dumps(note) + "\n").encode())
    except Exception as e:
        raise url_error(str(marker), e) from e
    staging = ObjectStaging(dst, marker, single_file=commit is None)
    try:
        _remove_objects([path for path, _ in writers])  # replace=True takes over from them
        if commit is not None and replace and dst.exists():
            _remove_objects([dst / commit])
            _remove_tree(dst)
        abort_uploads(dst, under=commit is not None)
    except BaseException:
        staging.abort()
        raise
    return staging


def _remove_tree(dst: RemotePath) -> None:
    try:
        dst.fs.rm(dst.path, recursive=True)
    except FileNotFoundError:
        pass
    except Exception as e:
        raise url_error(str(dst), e) from e


def _markers(directory: RemotePath, name: str | None = None) -> list[tuple[RemotePath, dict]]:
    """The markers in ``directory`` (of DST ``name``, or of any), each with what it says."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        m = _LEFTOVER.fullmatch(entry.name)
        if not m or m["kind"] != "partial" or (name is not None and m["name"] != name):
            continue
        try:
            note = json.loads(entry.read_bytes()[:_SMALL_FILE])
        except (ValueError, OSError):
            note = {}
        found.append((entry, {"host": m["host"], "pid": int(m["pid"]), "name": m["name"],
                              "commit": note.get("commit") if isinstance(note, dict) else None}))
    return found


def _dead_markers(directory: RemotePath) -> list[tuple[RemotePath, dict]]:
    """The markers in ``directory`` of runs of this host that are gone."""
    return [(marker, m) for marker, m in _markers(directory) if m["host"] == _host() and _pid_gone(m["pid"])]


def recover_objects(directory: RemotePath) -> list[str]:
    """Clean up after runs of this host that are gone, whose markers are in ``directory``: an output they did not
    commit is removed with its multipart uploads, then the marker. Says so on stderr; returns what it did.

    Markers of other hosts are left alone (their PIDs mean nothing here): :func:`stage_object` names them, and
    ``--overwrite`` replaces what they left.
    """
    done = []
    for marker, m in _dead_markers(directory):
        dst = directory / m["name"]
        if _is_committed(dst, m["commit"]):
            # A single file DST that is there may be the old copy a killed overwrite left standing: its upload
            # of the new one is still open (a committed directory had every upload complete before its commit).
            uploads = abort_uploads(dst, under=False) if m["commit"] is None else 0
            done.append(f"removed {marker.name} ({dst.name} is complete"
                        + (f"; aborted {uploads} unfinished uploads" if uploads else "") + ")")
        else:
            if m["commit"] is not None:
                _remove_tree(dst)
            uploads = abort_uploads(dst, under=m["commit"] is not None)
            done.append(f"removed {dst.name}, which it had not completed"
                        + (f", and {uploads} unfinished uploads" if uploads else "") + f"; removed {marker.name}")
        _remove_objects([marker])
    if done:
        _note(f"{directory}: cleaned up after runs that are gone: {'; '.join(done)}")
    return done

"""Object stores' outputs: written in place, their commit file last; what dead runs of this host left.

On an object store there is no rename and no flock, so the four steps of a local output are
:class:`ObjectStaging`'s. There is no staging name to rename from, so the output is written in place and its
*commit file* (DCP's ``.metadata``, the HF index, ``flat_layout.json``, or the single file itself) is put last:
until then every reader refuses DST as incomplete. Each object appears whole or not at all (a multipart upload
becomes visible when it completes). :func:`stage_object` puts a marker ``.NAME.ckptkit-partial-HOST-PID``
beside DST, which names the run and its commit file; :meth:`ObjectStaging.abort` deletes what the run put;
:func:`recover_objects` cleans up after runs of this host that are gone (marker, objects of an uncommitted DST,
S3 multipart uploads).
"""

from __future__ import annotations

import contextlib
import json
import os

from ....errors import UsageError
from ..local.staging import LEFTOVER, announce, host_name, owned_name, pid_gone
from .paths import NoCredentialsError, RemotePath, calling, url_error

__all__ = ["ObjectStaging", "abort_uploads", "check_object_destination", "recover_objects", "stage_object"]

_SMALL_FILE = 4096  # a marker is a line; anything longer is not ours


def check_object_destination(dst: RemotePath, *, overwrite: bool, sources: tuple[object, ...] = (),
                             dry_run: bool = False) -> RemotePath:
    """Refuse a destination that exists (unless ``overwrite``), that overlaps any of ``sources``, or where
    ckptkit does not write; returns DST. ``dry_run`` changes nothing: what dead runs left is judged, not cleaned
    up."""
    try:
        return _check(dst, overwrite, sources, dry_run)
    except NoCredentialsError:
        raise NoCredentialsError.of(str(dst)) from None  # found on DST's directory; DST is what the user named


def _check(dst: RemotePath, overwrite: bool, sources: tuple[object, ...],
           dry_run: bool) -> RemotePath:
    if dst.fs.protocol in ("hf", ("hf",)):
        raise UsageError(f"{dst}: ckptkit reads hf:// but does not write there; write the output locally and "
                         "upload it (huggingface-cli upload)")
    if "/" not in dst.path.strip("/"):
        raise UsageError(f"{dst}: name a prefix inside the bucket (s3://bucket/name), not the bucket itself")
    url = str(dst)
    for src in sources:
        if not isinstance(src, os.PathLike):  # a local path is never an object's place
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
        return dst
    if not overwrite and dst.exists():
        raise UsageError(f"{url} already exists; pass --overwrite (overwrite=True) to replace it")
    return dst


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

    def commit(self) -> RemotePath:
        """The commit file is in place: the output is complete. Removes the marker."""
        _remove_objects([self.marker])
        return self.dst

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


def stage_object(dst: RemotePath, *, replace: bool, commit: str | None, keep: tuple[str, ...] = ()) -> ObjectStaging:
    """Clean up after dead runs beside ``dst``, check it, put this run's marker beside it and, with ``replace``,
    remove the old DST: its commit file first, so that no reader ever sees old files beside new ones; but the
    files and folders ``keep`` names (paths relative to DST, a folder's ending in ``/``) stay, as they do when
    the run dies before its commit.

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
    marker = dst.parent / owned_name(dst.name, "partial")
    note = {"host": host_name(), "pid": os.getpid(), "dst": str(dst), "commit": commit, "kept": list(keep)}
    try:
        marker.fs.pipe_file(marker.path, (json.dumps(note) + "\n").encode())
    except Exception as e:
        raise url_error(str(marker), e) from e
    staging = ObjectStaging(dst, marker, single_file=commit is None)
    try:
        _remove_objects([path for path, _ in writers])  # replace=True takes over from them
        if commit is not None and replace and dst.exists():
            _remove_objects([dst / commit])
            _remove_tree(dst, keep)
        abort_uploads(dst, under=commit is not None)
    except BaseException:
        staging.abort()
        raise
    return staging


def _remove_tree(dst: RemotePath, keep: tuple[str, ...] | list[str] = ()) -> None:
    """Remove every object under ``dst`` but those ``keep`` names (relative paths; a folder's ends in ``/``)."""
    try:
        if not keep:
            dst.fs.rm(dst.path, recursive=True)
            return
        files, folders = {k for k in keep if not k.endswith("/")}, tuple(k for k in keep if k.endswith("/"))
        root = dst.path.rstrip("/") + "/"
        gone = [p for p in dst.fs.find(dst.path) if p.startswith(root)
                and p[len(root):] not in files and not p[len(root):].startswith(folders)]
        if gone:
            dst.fs.rm(gone)
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
        m = LEFTOVER.fullmatch(entry.name)
        if not m or m["kind"] != "partial" or (name is not None and m["name"] != name):
            continue
        try:
            note = json.loads(entry.read_bytes()[:_SMALL_FILE])
        except (ValueError, OSError):
            note = {}
        kept = note.get("kept") if isinstance(note, dict) else None
        found.append((entry, {"host": m["host"], "pid": int(m["pid"]), "name": m["name"],
                              "commit": note.get("commit") if isinstance(note, dict) else None,
                              "kept": [k for k in kept if isinstance(k, str)] if isinstance(kept, list) else []}))
    return found


def _dead_markers(directory: RemotePath) -> list[tuple[RemotePath, dict]]:
    """The markers in ``directory`` of runs of this host that are gone."""
    return [(marker, m) for marker, m in _markers(directory) if m["host"] == host_name() and pid_gone(m["pid"])]


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
                _remove_tree(dst, m["kept"])
            uploads = abort_uploads(dst, under=m["commit"] is not None)
            done.append(f"removed {dst.name}, which it had not completed"
                        + (f", and {uploads} unfinished uploads" if uploads else "") + f"; removed {marker.name}")
        _remove_objects([marker])
    if done:
        announce(f"{directory}: cleaned up after runs that are gone: {'; '.join(done)}")
    return done



def abort_uploads(path: RemotePath, *, under: bool) -> int:
    """Abort the incomplete multipart uploads to ``path`` (``under``: to any key below it) and return how many.

    Only S3 keeps them (invisible, but stored and billed) until someone aborts them; a killed run leaves its own.
    GCS resumable uploads and Azure uncommitted blocks expire by themselves (a week), so there is nothing to do.
    """
    fs = path.fs
    if "s3" not in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
        return 0
    bucket, _, key = path.path.partition("/")
    prefix = key + "/" if under else key
    with calling(str(path)):
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
        mine = [u for u in uploads if under or u["Key"] == key]
        for u in mine:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    return len(mine)

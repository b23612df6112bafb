"""The publisher on its own: staging, the atomic commit (renameat2, and the fallback where a filesystem refuses
it), recovery after runs that died; and the run directories saves publish into, ``latest`` and rotation. Files
are small and made here; no torch."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckptkit.errors import FormatError, IncompleteCheckpointError, UsageError
from ckptkit.formats import run_directory
from ckptkit.io.storage.local import staging as local
from ckptkit.training import rotation


@pytest.fixture(params=["renameat2", "fallback"])
def rename_mode(request, monkeypatch) -> str:
    """Every commit test runs with renameat2 and with the fallback a filesystem that refuses it gets."""
    if request.param == "fallback":
        monkeypatch.setattr(local, "_renameat2", None)
    elif local._renameat2 is None:
        pytest.skip("this system has no renameat2")
    return request.param


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def host() -> str:
    return local.host_name()


def leftover(directory: Path, name: str, kind: str = "partial", pid: int | None = None, on: str | None = None,
             content: str | None = "x") -> Path:
    """A leftover as a run of ``pid`` on host ``on`` would leave it: a directory holding one file, or a file."""
    path = directory / f".{name}.ckptkit-{kind}-{on or host()}-{pid if pid is not None else dead_pid()}"
    if content is None:
        path.write_text("old file")
    else:
        path.mkdir()
        (path / "f").write_text(content)
    return path


def tree(path: Path) -> dict[str, str]:
    if path.is_file():
        return {"": path.read_text()}
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".ckptkit-" in p.name)


def make_output(staging: local.Staging, content: str) -> None:
    (staging.path / "a.bin").write_text(content)
    (staging.path / "sub").mkdir()
    (staging.path / "sub" / "b.bin").write_text(content * 2)


# ------------------------------------------------------------------------------------ stage and commit


def test_stage_names_the_staging_directory_by_host_and_pid(tmp_path):
    staging = local.stage(tmp_path / "out", replace=False)
    assert staging.path.parent == tmp_path and staging.path.is_dir()
    assert staging.path.name == f".out.ckptkit-partial-{host()}-{os.getpid()}"
    staging.abort()
    assert not staging.path.exists() and not (tmp_path / "out").exists()


def test_commit_moves_a_new_output_into_place(tmp_path, rename_mode):
    dst = tmp_path / "out"
    staging = local.stage(dst, replace=False)
    make_output(staging, "new")
    assert staging.commit(replace=False) == dst
    assert tree(dst) == {"a.bin": "new", "sub/b.bin": "newnew"}
    assert leftovers(tmp_path) == []


def test_commit_replace_swaps_in_the_new_output_and_removes_the_old(tmp_path, rename_mode):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.bin").write_text("old")
    staging = local.stage(dst, replace=True)
    make_output(staging, "new")
    staging.commit(replace=True)
    assert tree(dst) == {"a.bin": "new", "sub/b.bin": "newnew"}
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("replace", [False, True])
def test_commit_single_file(tmp_path, rename_mode, replace):
    dst = tmp_path / "model.pt"
    if replace:
        dst.write_text("old")
    staging = local.stage(dst, replace=replace)
    (staging.path / "model.pt").write_text("new")
    staging.commit(replace=replace, file="model.pt")
    assert dst.read_text() == "new" and leftovers(tmp_path) == []


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_commit_without_replace_refuses_a_destination_that_appeared_meanwhile(tmp_path, rename_mode, kind):
    # Of two runs to one DST without --overwrite, the later is refused rather than replacing the earlier.
    dst = tmp_path / "out"
    staging = local.stage(dst, replace=False)
    make_output(staging, "second")
    dst.mkdir() if kind == "dir" else dst.write_text("first")  # the other run publishes first (an empty dir too)
    before = tree(dst)
    with pytest.raises(UsageError, match=rf"{dst} already exists \(another run wrote it meanwhile\?\)"):
        staging.commit(replace=False, file=None)
    assert tree(dst) == before and leftovers(tmp_path) == []


def test_stage_refuses_an_existing_destination_before_anything_is_written(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UsageError, match=r"out already exists; pass --overwrite"):
        local.stage(tmp_path / "out", replace=False)
    assert leftovers(tmp_path) == []


def test_commit_marker_is_written_inside_before_the_rename(tmp_path, rename_mode):
    staging = local.stage(tmp_path / "step-00000001", replace=True)
    staging.commit(replace=True, marker=rotation.marker_text(save=4, step=1))
    assert json.loads((tmp_path / "step-00000001" / local.COMPLETE).read_text()) == {"save": 4, "step": 1}


def test_staging_context_aborts_on_error(tmp_path):
    with pytest.raises(RuntimeError), local.stage(tmp_path / "out", replace=False) as staging:
        make_output(staging, "x")
        raise RuntimeError("writer failed")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------ recovery


def test_recover_removes_leftovers_of_dead_runs_on_this_host_and_says_so(tmp_path, capsys):
    dead = [leftover(tmp_path, "out"), leftover(tmp_path, "step-00000002"), leftover(tmp_path, "x.pt", content=None)]
    mine = leftover(tmp_path, "busy", pid=os.getpid())           # this very process: in flight
    other = leftover(tmp_path, "out2", on="some-other-host")     # another host's PIDs mean nothing here
    done = local.recover(tmp_path)
    assert sorted(done) == sorted(f"removed {p.name}" for p in dead)
    assert all(not p.exists() for p in dead) and mine.exists() and other.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ckptkit: {tmp_path}: cleaned up after runs that are gone: ")


def test_recover_leaves_a_staging_directory_a_live_process_holds(tmp_path):
    # A process of another PID namespace on this host may look dead by PID: its flock says otherwise.
    path = leftover(tmp_path, "out")
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys, time
fd = os.open({str(path)!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print("locked", flush=True); time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert local.recover(tmp_path) == [] and path.exists()
    finally:
        holder.kill()
        holder.wait()
    assert local.recover(tmp_path) == [f"removed {path.name}"]


def test_recover_restores_a_destination_whose_swap_was_cut_short(tmp_path):
    # A fallback swap killed between its two renames leaves DST missing and the old copy hidden, until recovery.
    old = leftover(tmp_path, "out", kind="old", content="previous output")
    staged = leftover(tmp_path, "out", content="unfinished")
    local.recover(tmp_path)
    assert tree(tmp_path / "out") == {"f": "previous output"} and leftovers(tmp_path) == []
    assert not old.exists() and not staged.exists()


def test_recover_removes_the_old_copy_when_the_swap_finished(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("new output")
    leftover(tmp_path, "out", kind="old", content="previous output")
    local.recover(tmp_path)
    assert tree(tmp_path / "out") == {"f": "new output"} and leftovers(tmp_path) == []


def test_stage_recovers_the_destination_directory_first(tmp_path, capsys):
    left = leftover(tmp_path, "out")
    local.stage(tmp_path / "out", replace=False).abort()
    assert not left.exists() and f"removed {left.name}" in capsys.readouterr().err


def test_fcntl_lock_of_staging_is_held_until_commit(tmp_path):
    staging = local.stage(tmp_path / "out", replace=False)
    fd = os.open(staging.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    staging.abort()


# ------------------------------------------------------------------------------------ destinations


@pytest.mark.parametrize("where", [
    "same",       # DST is SRC
    "inside",     # DST inside the SRC directory
    "parent",     # DST holds SRC
    "via-link",   # DST is a link that names SRC
])
def test_check_destination_refuses_overlap_with_any_source(tmp_path, where):
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "link").symlink_to(src)
    dst = {"same": src, "inside": src / "out", "parent": tmp_path, "via-link": tmp_path / "link"}[where]
    with pytest.raises(UsageError, match=r"overlaps the input .*src; ckptkit never writes into its input"):
        local.check_destination(dst, overwrite=True, sources=(src,))


def test_check_destination_allows_a_sibling(tmp_path):
    (tmp_path / "src").mkdir()
    assert local.check_destination(tmp_path / "out", overwrite=False, sources=(tmp_path / "src",)) == \
        tmp_path / "out"


# ------------------------------------------------------------------------------------ run directories


def make_step(root: Path, step: int, save: int | None, content: str = "w") -> Path:
    path = rotation.step_dir(root, step)
    path.mkdir(parents=True)
    (path / "weights").write_text(content)
    (path / local.COMPLETE).write_text(rotation.marker_text(save=save, step=step) if save else "complete\n")
    return path


def test_complete_steps_order_saves_not_step_numbers(tmp_path):
    make_step(tmp_path, 300, save=1)
    make_step(tmp_path, 100, save=2)
    make_step(tmp_path, 50, save=None)    # saved before save numbers: oldest
    (tmp_path / "step-00000007").mkdir()  # no marker: partial, ignored
    assert [(s.step, s.save) for s in run_directory.complete_steps(tmp_path)] == [(50, None), (300, 1), (100, 2)]
    assert rotation.next_save(tmp_path) == 3


def test_rotate_keeps_the_most_recent_saves_and_never_the_one_just_published(tmp_path):
    # Rotation keeps the most recent saves, not the highest steps, so a save resumed from an earlier step stays.
    make_step(tmp_path, 300, save=1)
    newest = make_step(tmp_path, 100, save=2)
    assert rotation.rotate(tmp_path, keep=newest, keep_last=1) == [tmp_path / "step-00000300"]
    assert [s.step for s in run_directory.complete_steps(tmp_path)] == [100]
    assert rotation.rotate(tmp_path, keep=newest, max_total_bytes=0) == []  # never the one just published
    assert leftovers(tmp_path) == []


def test_rotate_never_follows_a_symbolic_link(tmp_path):
    # Rotation never follows a symlinked step directory out of the run directory to delete in it.
    outside = tmp_path / "elsewhere"
    make_step(outside, 1, save=1, content="keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-00000001").symlink_to(outside / "step-00000001", target_is_directory=True)
    make_step(run, 2, save=2)
    newest = make_step(run, 3, save=3)
    assert [s.step for s in run_directory.complete_steps(run)] == [2, 3]
    rotation.rotate(run, keep=newest, keep_last=1)
    assert tree(outside) == {"step-00000001/weights": "keep me", f"step-00000001/{local.COMPLETE}":
                             rotation.marker_text(save=1, step=1)}
    assert (run / "step-00000001").is_symlink()


def test_point_latest_and_resolve(tmp_path):
    make_step(tmp_path, 1, save=1)
    step2 = make_step(tmp_path, 2, save=2)
    assert run_directory.resolve(tmp_path) == step2  # no latest: the most recent save
    rotation.point_latest(tmp_path, tmp_path / "step-00000001")
    assert run_directory.resolve(tmp_path) == tmp_path / "step-00000001"
    assert (tmp_path / "latest").read_text() == "step-00000001\n" and leftovers(tmp_path) == []
    assert run_directory.resolve(step2) == step2  # a checkpoint directory itself


@pytest.mark.parametrize("make, error, message", [
    # latest names a directory of another run
    (lambda r: (r / "latest").write_text("../other-run/step-00000005\n"), FormatError,
     r"names '\.\./other-run/step-00000005'; expected a step directory of"),
    # an absolute path
    (lambda r: (r / "latest").write_text("/etc\n"), FormatError, r"names '/etc'; expected a step directory"),
    # a step directory that is a link out of the run directory
    (lambda r: [(r / "latest").write_text("step-00000009\n"),
                (r / "step-00000009").symlink_to(r.parent / "other-run" / "step-00000005")], FormatError,
     r"names step-00000009, which is not a directory of .*\(a symbolic link\?\)"),
    # latest itself a link
    (lambda r: (r / "latest").symlink_to(r.parent / "other-run" / "latest"), FormatError,
     r"expected a small file naming a step directory"),
    # a step that is gone
    (lambda r: (r / "latest").write_text("step-00000004\n"), IncompleteCheckpointError,
     r"names step-00000004, which does not exist"),
    # a step without its completion marker
    (lambda r: [(r / "latest").write_text("step-00000003\n"), (r / "step-00000003").mkdir()],
     IncompleteCheckpointError, r"names step-00000003, which is not a complete checkpoint"),
])
def test_resolve_checks_latest_as_untrusted(tmp_path, make, error, message):
    # latest naming ../other-run/step-5 or an absolute path is refused, never followed.
    make_step(tmp_path / "other-run", 5, save=1)
    (tmp_path / "other-run" / "latest").write_text("step-00000005\n")
    run = tmp_path / "run"
    run.mkdir()
    make(run)
    with pytest.raises(error, match=message):
        run_directory.resolve(run)


def test_host_name_is_made_safe_for_a_file_name(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node 7/a:b")
    assert local.host_name() == "node_7_a_b"

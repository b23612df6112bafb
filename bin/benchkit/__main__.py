"""``python -m benchkit`` with ``bin/`` on the path, or ``python bin/benchkit`` (what ``bin/bench`` runs)."""

if __package__:
    from .cli import main
else:  # run as a path: the package's own directory is on sys.path in place of bin/, whose package this is
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    from benchkit.cli import main

main(prog_name="bin/bench")

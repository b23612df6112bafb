"""The console script's first moments: imported first by the package, before anything slow.

``ckptkit``'s console script, and ``python -m ckptkit`` or ``python -m ckptkit.cli`` (what ``torchrun ... -m
ckptkit`` runs on each rank), import this package before ``cli.main`` can catch anything, so a Ctrl-C (or a
SIGTERM) while it imports would print a traceback. Here, for those commands only (a program that imports
ckptkit keeps its own handlers), such a signal ends the run with one line and the exit code ``cli.main`` would
give (130, 143); ``cli.main`` then installs its own handlers.

The interpreter's own start-up, before this module runs, is not covered: there Python's default handler
raises KeyboardInterrupt. Inside ``import torch`` (imported later, by the formats that need it) torch's
native libraries may swallow a SIGINT or abort the process with its own message, whatever handler is set.
"""

from __future__ import annotations

import os
import signal
import sys


def _leave(message: bytes, code: int):
    def handler(signum: int, frame: object) -> None:
        os.write(2, message)
        os._exit(code)  # nothing is written yet, so there is nothing to clean up
    return handler


def handle(signum: int, handler) -> None:
    """Install ``handler`` for ``signum`` unless the signal is ignored (``nohup``, a shell's background job)."""
    if signal.getsignal(signum) is not signal.SIG_IGN:
        signal.signal(signum, handler)


_COMMAND_MODULES = ("ckptkit", "ckptkit.__main__", "ckptkit.cli")


def _run_module() -> str | None:
    """The module of ``python [options] -m MODULE``, from the interpreter's own arguments; None for a script,
    ``-c`` or an interactive interpreter. (While ``-m`` imports the package, ``sys.argv[0]`` is only "-m".)"""
    args = iter(getattr(sys, "orig_argv", ())[1:])
    for arg in args:
        if arg == "--" or arg == "-" or not arg.startswith("-"):
            return None
        if arg.startswith("--"):
            continue  # (--check-hash-based-pycs MODE: its MODE ends the scan, a -m after it is missed)
        for i, flag in enumerate(arg[1:], start=2):
            if flag == "m":
                return arg[i:] or next(args, None)
            if flag == "c":
                return None
            if flag in "WX":  # -W ARG, -X OPT: the rest of this word or the next one is its value
                if i == len(arg):
                    next(args, None)
                break
    return None


def _is_command() -> bool:
    """Whether this process is the ``ckptkit`` command: its console script, or ``python -m`` of it."""
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "ckptkit" or _run_module() in _COMMAND_MODULES


if _is_command():
    try:
        handle(signal.SIGINT, _leave(b"ckptkit: interrupted\n", 130))
        handle(signal.SIGTERM, _leave(b"ckptkit: terminated\n", 143))
    except ValueError:
        pass  # not the main thread: not the console script starting

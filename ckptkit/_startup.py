"""The console script's first moments: imported first by the package, before anything slow.

``ckptkit``'s console script imports this package before ``cli.main`` can catch anything, so a Ctrl-C (or a
SIGTERM) while it imports would print a traceback. Here, in that script only, such a signal ends the run with
one line and the exit code ``cli.main`` would give (130, 143); ``cli.main`` then installs its own handlers.
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


if sys.argv and os.path.basename(sys.argv[0]) == "ckptkit":
    try:
        handle(signal.SIGINT, _leave(b"ckptkit: interrupted\n", 130))
        handle(signal.SIGTERM, _leave(b"ckptkit: terminated\n", 143))
    except ValueError:
        pass  # not the main thread: not the console script starting

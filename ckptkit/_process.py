"""This process as a command line run measures it: wall time since the process started (interpreter start-up
and imports included, as a user waits for them) and peak resident memory."""

from __future__ import annotations

import os
import resource
import time

__all__ = ["peak_memory", "seconds_since_start"]

_IMPORTED = time.monotonic()  # the fallback where /proc does not say when the process started


def seconds_since_start() -> float:
    """Wall seconds since this process started, from the kernel's record of it (Linux ``/proc``); elsewhere
    since ckptkit was imported."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def peak_memory() -> tuple[int, int]:
    """Peak resident bytes of this process, and of its largest child that has ended (a writer process)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return own, children

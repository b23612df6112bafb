"""Cyclic garbage collection held off while a checkpoint's description is built.

Reading a ``.metadata`` of a million chunks, or planning its conversion, makes millions of small objects that
never form cycles; the collector would walk the ever larger heap again and again (it took three quarters of
the time of unpickling a large ``.metadata``). Reference counting still frees everything as usual.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block (nested blocks fine); the collector's state is restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


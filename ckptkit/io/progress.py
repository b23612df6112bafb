"""What a person sees: sizes in decimal units (``1.2 GB``, as disks and the Hub count them), and a byte progress bar
on a terminal or in a notebook (``tqdm.auto``), silence in pipes and under ``--quiet``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["count", "human_size", "progress_bar"]

_UNITS = ("kB", "MB", "GB", "TB", "PB")


def human_size(n: int) -> str:
    """``n`` bytes in decimal units: ``512 B``, ``5.0 kB``, ``1.2 GB``, ``123 GB``."""
    if n < 1000:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in _UNITS:
        value /= 1000
        if value < 999.5 or unit == _UNITS[-1]:
            break
    return f"{value:.1f} {unit}" if value < 99.95 else f"{value:.0f} {unit}"


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and its noun, singular for one: ``1 file``, ``2 files``; ``nouns`` where adding an s is wrong."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    return shell is not None and getattr(shell, "get_ipython", lambda: None)() is not None


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled or not (sys.stderr.isatty() or _in_notebook()):
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:
        yield bar.update

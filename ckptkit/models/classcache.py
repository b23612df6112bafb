"""What transformers' model class of a config says, remembered on disk between runs.

Asking transformers costs its import (seconds and some 300 MB with torch) and, for the key check, building
the class on the meta device; the answer depends only on the question (the config, the keys) and on the
transformers release installed. So each answer is kept as a small JSON file named by the hash of the
question, ckptkit's version and transformers' version, under ``$CKPTKIT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/ckptkit``, else ``~/.cache/ckptkit``); a new release of either asks again. A cache that
cannot be read or written is passed by: the question is asked as if nothing were kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from .._version import __version__

__all__ = ["CACHE_ENV", "cache_dir", "remembered"]

CACHE_ENV = "CKPTKIT_CACHE_DIR"

T = TypeVar("T")


def cache_dir() -> Path:
    """Where answers are kept: ``$CKPTKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckptkit``, else ``~/.cache/ckptkit``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptkit"


def _transformers_version() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def remembered(question: str, payload: Any, ask: Callable[[], T], encode: Callable[[T], Any],
               decode: Callable[[Any], T]) -> T:
    """The answer to ``question`` about ``payload``, from the cache, or from ``ask()`` and then kept.

    Args:
        question: what is asked (a name, part of the key).
        payload: JSON-serialisable input the answer depends on (with the two versions, the whole key).
        ask: computes the answer.
        encode: the answer as JSON-serialisable data.
        decode: an answer from that data.

    Returns:
        The answer.
    """
    version = _transformers_version()
    if version is None:  # nothing to ask: transformers is not installed
        return ask()
    text = json.dumps([question, payload, version, __version__], sort_keys=True, default=str)
    path = cache_dir() / "transformers" / f"{question}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"
    try:
        return decode(json.loads(path.read_text())["answer"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    answer = ask()
    _keep(path, encode(answer))
    return answer


def _keep(path: Path, data: Any) -> None:
    """``data`` written to ``path`` whole or not at all: a reader never sees half an answer."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp = f.name
            json.dump({"answer": data}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

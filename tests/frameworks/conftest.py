"""Checkpoints written by training frameworks' own save code (2 gloo ranks on CPU, a tiny Llama), and what
ckptkit makes of them, checked with torch, safetensors, transformers and the frameworks' own loaders.

Each module saves once (module-scoped fixtures) and runs several assertions on the result; the resume matrix's
sources are saved once per session (:func:`matrix_sources`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def llama_assets(tmp_path_factory) -> Path:
    """config.json of the tiny Llama the workers train (untied lm_head, as LlamaConfig defaults)."""
    from _workers import tiny_llama_config

    path = tmp_path_factory.mktemp("llama-assets")
    tiny_llama_config().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def matrix_sources(tmp_path_factory, worker_id) -> Path:
    """The resume matrix's eight sources (:mod:`_matrix`), each saved once by its framework's own code on 2 ranks
    after step 3 of 6, and ``expected.pt``: each uninterrupted run's losses and final weights. Run once per test
    session: the pytest-xdist workers share it through a file lock (the first to ask runs it, the others wait)."""
    from filelock import FileLock

    from _matrix import sources
    from _spawn import spawn

    base = tmp_path_factory.getbasetemp()
    out = (base.parent if worker_id != "master" else base) / "matrix-sources"
    with FileLock(f"{out}.lock"):
        if not (out / "expected.pt").is_file():
            shutil.rmtree(out, ignore_errors=True)  # what a failed run left
            out.mkdir()
            spawn(sources, 2, str(out))
    return out

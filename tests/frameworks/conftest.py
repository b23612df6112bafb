"""Checkpoints written by training frameworks' own save code (2 gloo ranks on CPU, a tiny Llama), and what
ckptkit makes of them, checked with torch, safetensors, transformers and the frameworks' own loaders.

Each module saves once (module-scoped fixtures) and runs several assertions on the result.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def llama_assets(tmp_path_factory) -> Path:
    """config.json of the tiny Llama the workers train (untied lm_head, as LlamaConfig defaults)."""
    from _workers import tiny_llama_config

    path = tmp_path_factory.mktemp("llama-assets")
    tiny_llama_config().save_pretrained(path)
    return path

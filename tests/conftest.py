"""Tiny fixtures shared by the ckptkit tests: a training checkpoint in each form ckptkit reads.

Everything lives under ``tmp_path``; the checkers that read results back with torch's own loaders are in
``_checks.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _checks import make_training_state, make_zoo


def pytest_collection_modifyitems(config, items) -> None:
    """``cuda``-marked tests skip, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def zoo() -> dict[str, torch.Tensor]:
    return make_zoo()


@pytest.fixture
def training_state() -> dict:
    return make_training_state()


@pytest.fixture
def full_ckpt(tmp_path, training_state) -> Path:
    """``training_state`` written by ``torch.save`` to ``src.pt``."""
    path = tmp_path / "src.pt"
    torch.save(training_state, path)
    return path


@pytest.fixture
def flat_full_ckpt(tmp_path, zoo) -> Path:
    """A flat model state dict written by ``torch.save``."""
    path = tmp_path / "flat.pt"
    torch.save(zoo, path)
    return path


@pytest.fixture
def dcp_ckpt(tmp_path, full_ckpt) -> Path:
    """``training_state`` as a 2-rank DCP directory written by ckptkit."""
    from ckptkit.ops.convert import convert

    path = tmp_path / "dcp2"
    convert(full_ckpt, path, to="sharded", world_size=2)
    return path


@pytest.fixture
def hf_ckpt(tmp_path, zoo) -> Path:
    """The zoo written by ``safetensors.torch.save_file`` into ``hf/model.safetensors``."""
    from safetensors.torch import save_file

    path = tmp_path / "hf"
    path.mkdir()
    save_file(zoo, path / "model.safetensors")
    return path

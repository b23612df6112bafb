"""ckptkit.io.execute: streaming a write plan into files, kernel-side where it can, in row blocks where it casts."""

from __future__ import annotations

import errno
import os

import pytest

from _checks import assert_same_tree, load_dcp, load_full
from ckptkit.ops.convert import convert


def _no_kernel_copy(*args):
    raise OSError(errno.EXDEV, "Invalid cross-device link")


def _seven_bytes_at_a_time(fd_in, fd_out, count, offset_src=None, offset_dst=None):
    return _real_copy_file_range(fd_in, fd_out, min(count, 7), offset_src, offset_dst)


_real_copy_file_range = getattr(os, "copy_file_range", None)


@pytest.mark.skipif(_real_copy_file_range is None, reason="os.copy_file_range is Linux-only")
@pytest.mark.parametrize("kernel_copy", [
    _no_kernel_copy,         # a filesystem pair that cannot: the buffered fallback moves the bytes
    _seven_bytes_at_a_time,  # short kernel copies: the loop resumes where each stopped
])
def test_convert_bit_exact_whatever_copy_file_range_does(tmp_path, monkeypatch, full_ckpt, training_state,
                                                         kernel_copy):
    monkeypatch.setattr(os, "copy_file_range", kernel_copy)
    convert(full_ckpt, tmp_path / "dcp", to="sharded", world_size=3)
    convert(tmp_path / "dcp", tmp_path / "back.pt", to="full")
    monkeypatch.undo()
    assert_same_tree(load_dcp(tmp_path / "dcp", tmp_path / "c.pt"), training_state)
    assert_same_tree(load_full(tmp_path / "back.pt"), training_state)

"""The package's public surface: ``import ckptkit`` and call what ``__all__`` lists, as the README does."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import ckptkit


def test_ckptkit_all_names_resolve():
    for name in ckptkit.__all__:
        assert getattr(ckptkit, name) is not None, name
    assert issubclass(ckptkit.UsageError, ckptkit.CheckpointError)
    assert issubclass(ckptkit.CheckpointError, ValueError)


def test_ckptkit_readme_calls_in_a_fresh_interpreter(tmp_path):
    torch.save({"model": {"w": torch.arange(6.0).reshape(3, 2)}, "step": 1}, tmp_path / "src.pt")
    program = textwrap.dedent(f"""
        import ckptkit
        ckptkit.convert({str(tmp_path / 'src.pt')!r}, {str(tmp_path / 'dcp')!r}, to="sharded", world_size=2)
        m = ckptkit.inspect({str(tmp_path / 'dcp')!r})
        ckptkit.reshard({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'dcp3')!r}, world_size=3)
        ckptkit.convert({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'model.pt')!r}, to="full")
        ckptkit.export_hf({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'hf')!r})
        assert ckptkit.verify({str(tmp_path / 'dcp')!r}, {str(tmp_path / 'dcp3')!r}).ok
        assert ckptkit.verify({str(tmp_path / 'src.pt')!r}, {str(tmp_path / 'model.pt')!r}).ok
        print(m.world_size)
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2"

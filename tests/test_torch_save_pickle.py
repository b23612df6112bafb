"""ckptkit's ``torch.save`` archives pickle tensors exactly as ``torch.save`` does, dtype by dtype.

Loaders that re-implement torch's unpickler (Lightning's ``_lazy_load``) depend on the rebuild function and
storage class torch picks per dtype, not only on ``torch.load`` accepting the file.
"""

from __future__ import annotations

import io
import pickletools
import zipfile
from pathlib import Path

import pytest
import torch

from _checks import load_dcp, random_bits
from ckptkit.core.dtypes import DTYPES
from ckptkit.ops.convert import convert


def _pickle_listing(path: Path) -> str:
    """``pickletools.dis`` of the archive's ``data.pkl``."""
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        out = io.StringIO()
        pickletools.dis(z.read(name), out=out)
    return out.getvalue()


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return random_bits(shape, dtype, g)


@pytest.mark.parametrize("dtype", [d.name for d in DTYPES])
def test_convert_full_pickles_tensors_as_torch_save(tmp_path, dtype):
    t = getattr(torch, dtype)
    state = {"w": _tensor(t, (2, 3), 0), "nested": {"b": _tensor(t, (4,), 1), "step": 3}}
    torch.save(state, tmp_path / "torch.pt")
    convert(tmp_path / "torch.pt", tmp_path / "ckptkit.pt", to="full")
    assert _pickle_listing(tmp_path / "ckptkit.pt") == _pickle_listing(tmp_path / "torch.pt")
    loaded = torch.load(tmp_path / "ckptkit.pt", weights_only=True)
    assert torch.equal(loaded["w"].view(torch.uint8), state["w"].view(torch.uint8))


def test_convert_sharded_chunks_pickle_as_torch_dcp(tmp_path):
    """Each DCP chunk is a ``torch.save`` archive: ckptkit's match those torch's DCP writer makes."""
    import torch.distributed.checkpoint as dcp

    state = {d.name: _tensor(getattr(torch, d.name), (3,), i) for i, d in enumerate(DTYPES)}
    dcp.save(state, checkpoint_id=str(tmp_path / "torch"))
    torch.save(state, tmp_path / "full.pt")
    convert(tmp_path / "full.pt", tmp_path / "ckptkit", to="sharded", world_size=1)

    def listings(root: Path) -> list[str]:
        raw = (root / "__0_0.distcp").read_bytes()
        out, at = [], raw.find(b"PK\x03\x04")
        while at >= 0:
            end = raw.find(b"PK\x05\x06", at) + 22  # end of central directory record: one archive per chunk
            (path := root / "chunk.pt").write_bytes(raw[at:end])
            out.append(_pickle_listing(path))
            at = raw.find(b"PK\x03\x04", end)
        return out

    assert listings(tmp_path / "ckptkit") == listings(tmp_path / "torch")
    loaded = load_dcp(tmp_path / "ckptkit", tmp_path / "c.pt")
    assert all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())

"""The package as users install it: ``python -m build`` makes an sdist and a wheel with complete metadata,
and the wheel, installed into a fresh environment beside the machine's torch (no download, no CUDA pull),
runs from the installed package, not from the checkout: ``--version``, ``inspect`` and a conversion whose
output safetensors reads back bit for bit."""

from __future__ import annotations

import email
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "ckptkit" / "_version.py").read_text()).group(1)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(args: list, cwd: Path) -> str:
    run = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{args}: {run.stdout[-2000:]}{run.stderr[-4000:]}"
    return run.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # Without isolation: the build uses this environment's setuptools, so it needs no network.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], cwd=out)
    return out


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Path:
    """A fresh venv that sees the machine's torch (and ckptkit's other dependencies) through a .pth file, with
    the wheel installed into it without dependencies: nothing is downloaded."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv)
    purelib = _run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=venv).strip()
    import click
    import fsspec
    import huggingface_hub
    import safetensors
    import tqdm

    deps = {str(Path(m.__file__).parents[1]) for m in (torch, safetensors, huggingface_hub, click, tqdm, fsspec)}
    Path(purelib, "_machine_torch.pth").write_text("\n".join(sorted(deps)) + "\n")
    wheel = next(dist.glob("ckptkit-*.whl"))
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "-q", wheel], cwd=venv)
    return venv


def test_build_makes_an_sdist_and_a_wheel_with_complete_metadata(dist):
    wheel = next(dist.glob(f"ckptkit-{VERSION}-py3-none-any.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(f"ckptkit-{VERSION}.dist-info/METADATA"))
        names = z.namelist()
    assert meta["Name"] == "ckptkit" and meta["Version"] == VERSION
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in meta.get_all("Classifier"))
    assert {u.split(",")[0] for u in meta.get_all("Project-URL")} >= {"Homepage", "Documentation", "Repository",
                                                                      "Changelog", "Issues"}
    assert set(meta.get_all("Provides-Extra")) >= {"s3", "gcs", "azure", "docs", "test"}
    assert any(r.startswith("torch>=") for r in meta.get_all("Requires-Dist"))
    assert meta.get_payload().startswith("# ckptkit")  # README.md is the long description
    assert "ckptkit/py.typed" in names
    assert f"ckptkit-{VERSION}.dist-info/licenses/LICENSE" in names  # the Apache-2.0 text the metadata names
    assert "ckptkit/cli.py" in names and not any(n.startswith("tests/") for n in names)
    with tarfile.open(next(dist.glob(f"ckptkit-{VERSION}.tar.gz"))) as t:
        sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE", "mkdocs.yml", "docs/index.md"} <= sdist


def test_installed_wheel_runs_version_inspect_and_a_conversion(installed, tmp_path):
    bin_ = installed / "bin"
    where = _run([bin_ / "python", "-c", "import ckptkit; print(ckptkit.__file__, ckptkit.__version__)"], tmp_path)
    path, version = where.split()
    assert Path(path).is_relative_to(installed), f"ckptkit imported from {path}, not from the installed wheel"
    assert version == VERSION
    assert _run([bin_ / "ckptkit", "--version"], tmp_path).strip() == f"ckptkit, version {VERSION}"

    state = {"embed.weight": torch.randn(16, 8), "proj.weight": torch.randn(8, 8).bfloat16(),
             "steps": torch.arange(5)}
    torch.save(state, tmp_path / "model.pt")
    shown = _run([bin_ / "ckptkit", "inspect", "model.pt"], tmp_path)
    assert "full" in shown.splitlines()[0] and "3 tensors" in shown
    _run([bin_ / "ckptkit", "convert", "model.pt", "hf", "--to", "hf", "-q"], tmp_path)
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == state.keys()
    for key, tensor in state.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key

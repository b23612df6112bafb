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


def _run(args: list, cwd: Path, path: Path | None = None, code: int = 0, **env: str) -> subprocess.CompletedProcess:
    """Run ``args`` (with ``path`` on the module path, ``env`` set); assert it exits with ``code``."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}, **env}
    run = subprocess.run([str(a) for a in args], cwd=cwd, env={**env, "PYTHONPATH": str(path)} if path else env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == code, f"{args}: {run.stdout[-2000:]}{run.stderr[-4000:]}"
    return run


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # Without isolation: the build uses this environment's setuptools, so it needs no network.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], cwd=out)
    return out


def _declared_closure() -> set[str]:
    """The distributions ckptkit's declared dependencies (no extras) bring, as pip would install them: each
    requirement's own requirements, markers evaluated for this interpreter without extras."""
    from importlib import metadata

    from packaging.requirements import Requirement

    pyproject = (ROOT / "pyproject.toml").read_text()
    todo = re.findall(r'^    "([^"]+)",$', pyproject.split("dependencies = [", 1)[1].split("]", 1)[0], re.M)
    seen: set[str] = set()
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = metadata.distribution(req.name).metadata["Name"]
        if name.lower() not in seen:
            seen.add(name.lower())
            todo += metadata.requires(name) or []
    return seen


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Path:
    """A fresh venv in which the wheel, installed without dependencies, sees only what its declared
    dependencies bring (torch and the rest, linked from this machine's environment through a .pth file, so
    nothing is downloaded and no CUDA build is pulled): the test extras' packages (numpy, transformers ...) are
    not there, as they are not in a user's torch-only environment."""
    from importlib import metadata

    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=venv)
    purelib = _run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=venv).stdout.strip()
    for name in _declared_closure():
        d = metadata.distribution(name)
        base, into = Path(str(d.locate_file(""))), venv / ("numpy" if name == "numpy" else "declared")
        into.mkdir(exist_ok=True)
        for top in {f.parts[0] for f in d.files or () if f.parts[0] != ".." and not f.parts[0].startswith("__")}:
            if (base / top).exists() and not (into / top).exists():
                (into / top).symlink_to(base / top)
    Path(purelib, "_machine_deps.pth").write_text(f"{venv / 'declared'}\n")
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
    assert meta.get_all("Project-URL") is None  # no address until there is a public one
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
    where = _run([bin_ / "python", "-c", "import ckptkit; print(ckptkit.__file__, ckptkit.__version__)"],
                 tmp_path).stdout
    path, version = where.split()
    assert Path(path).is_relative_to(installed), f"ckptkit imported from {path}, not from the installed wheel"
    assert version == VERSION
    assert _run([bin_ / "ckptkit", "--version"], tmp_path).stdout.strip() == f"ckptkit, version {VERSION}"

    state = {"embed.weight": torch.randn(16, 8), "proj.weight": torch.randn(8, 8).bfloat16(),
             "steps": torch.arange(5)}
    torch.save(state, tmp_path / "model.pt")
    shown = _run([bin_ / "ckptkit", "inspect", "model.pt"], tmp_path).stdout
    assert "full" in shown.splitlines()[0] and "3 tensors" in shown
    _run([bin_ / "ckptkit", "convert", "model.pt", "hf", "--to", "hf", "-q"], tmp_path)
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == state.keys()
    for key, tensor in state.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key


_SAVE_AND_LOAD = """
import sys, torch, ckptkit
def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = build()
model(torch.randn(3, 8)).sum().backward()
opt.step()
ckptkit.save(sys.argv[1], model, optimizer=opt, step=1, form=sys.argv[2])
again, opt2 = build()
result = ckptkit.load(sys.argv[1], again, optimizer=opt2)
assert result.step == 1 and result.optimizer_loaded, result
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
for p, q in zip(model.parameters(), again.parameters()):
    assert all(torch.equal(opt.state[p][k], opt2.state[q][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
print("loaded")
"""


def test_installed_wheel_casts_saves_and_loads_in_a_torch_only_environment(installed, tmp_path):
    """ckptkit.save / ckptkit.load of a model with its optimizer need nothing beyond torch, sharded and full; a
    cast export computes in numpy (a declared dependency): with it, the bits torch's own cast gives; without
    it, one line naming numpy and how to get it, and exit 2."""
    bin_ = installed / "bin"
    assert "No module named 'numpy'" in _run([bin_ / "python", "-c", "import numpy"], tmp_path, code=1).stderr
    state = {"model.embed.weight": torch.randn(16, 8), "model.norm.weight": torch.rand(8), "steps": torch.arange(5)}
    torch.save(state, tmp_path / "model.pt")
    refused = _run([bin_ / "ckptkit", "export-hf", "model.pt", "refused", "--dtype", "bf16", "-q"], tmp_path, code=2)
    assert refused.stderr.count("\n") == 1 and "pip install numpy" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused").exists()
    _run([bin_ / "ckptkit", "export-hf", "model.pt", "hf", "--dtype", "bf16", "-q"], tmp_path, path=installed / "numpy")
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == {"model.embed.weight", "model.norm.weight", "steps"}
    for key, tensor in state.items():
        want = tensor.bfloat16() if tensor.is_floating_point() else tensor
        assert written[key].dtype == want.dtype and torch.equal(written[key], want), key
    for form in ("sharded", "full"):
        assert _run([bin_ / "python", "-c", _SAVE_AND_LOAD, tmp_path / form, form], tmp_path).stdout == "loaded\n"


def test_installed_wheel_runs_the_demo_with_its_declared_dependencies(installed, tmp_path):
    """The demo trains on 4 ranks, whose collectives (torch's dcp.save) need numpy: with the declared
    dependencies it runs through; without numpy it stops with one line and exit 2, never verify's 1."""
    bin_ = installed / "bin"
    ran = _run([bin_ / "ckptkit", "demo", "--workdir", "demo"], tmp_path, path=installed / "numpy")
    assert ran.stdout.splitlines()[-1].startswith("demo OK"), ran.stdout
    # The Quick start on its output: a cast export, checked against its source by value.
    _run([bin_ / "ckptkit", "export-hf", "demo/fsdp2-4ranks", "hf-out", "--hf-assets", "demo/assets", "--dtype",
          "bf16", "-q"], tmp_path, path=installed / "numpy")
    checked = _run([bin_ / "ckptkit", "verify", "demo/fsdp2-4ranks", "hf-out", "--model-only", "--atol", "1e-2",
                    "--rtol", "1e-2"], tmp_path, path=installed / "numpy")
    assert checked.stdout.splitlines()[-1] == "equal" and "lm_head.weight of demo/fsdp2-4ranks is not compared" \
        in checked.stdout, checked.stdout
    # The oracle: transformers loads the export in the class its config names, nothing missing or unexpected.
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-out", output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(info.values()), info
    # (torch warns at import that it found no numpy, on every rank: that is torch's own line, not ckptkit's)
    failed = _run([bin_ / "ckptkit", "demo"], tmp_path, code=2, PYTHONWARNINGS="ignore::UserWarning")
    assert failed.stdout.startswith("[1/4]") and "Traceback" not in failed.stderr, failed.stderr
    assert failed.stderr.count("\n") == 1 and "Numpy is not available" in failed.stderr, failed.stderr

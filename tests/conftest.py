"""Tiny fixtures shared by the ckptkit tests: a training checkpoint in each form ckptkit reads.

Everything lives under ``tmp_path``; the checkers that read results back with torch's own loaders are in
``_checks.py``.
"""

from __future__ import annotations

import os
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


@pytest.fixture(scope="session", autouse=True)
def _own_class_cache(tmp_path_factory) -> None:
    """What transformers said is cached per test session (and for the subprocesses tests start), not in the
    user's cache directory."""
    from ckptkit.models.classcache import CACHE_ENV

    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("ckptkit-cache"))


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


# --------------------------------------------------------------------------------------------------------
# An S3 server on loopback: moto's, as s3fs's own tests run it


@pytest.fixture(scope="session")
def moto_server():
    """One moto S3 server for the session, on 127.0.0.1 and a free port; its address."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto_server, monkeypatch, request):
    """A fresh bucket of its own on the moto server, with credentials and endpoint in the environment for this
    test only (the way users point s3fs at an S3-compatible store: AWS_ENDPOINT_URL)."""
    import re

    import s3fs

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    bucket = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:50] + "-b"
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(bucket)
    yield _Bucket(fs, bucket)
    fs.rm(bucket, recursive=True)


class _Bucket:
    def __init__(self, fs, name: str) -> None:
        self.fs, self.name = fs, name

    def url(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}".rstrip("/")

    def put(self, local: Path, key: str) -> str:
        """Upload a local file or directory tree to ``key``; its URL."""
        self.fs.put(str(local), f"{self.name}/{key}", recursive=local.is_dir())
        self.fs.invalidate_cache()
        return self.url(key)

    def get(self, key: str, local: Path) -> Path:
        self.fs.invalidate_cache()
        self.fs.get(f"{self.name}/{key}", str(local), recursive=True)
        return local

    def objects(self, prefix: str = "") -> list[str]:
        """Every object under ``prefix`` (relative to the bucket), sorted."""
        self.fs.invalidate_cache()
        root = f"{self.name}/{prefix}".rstrip("/")
        return sorted(p[len(self.name) + 1:] for p in self.fs.find(root, withdirs=False))

    def leftovers(self) -> list[str]:
        """Markers of runs in flight (or killed) that ckptkit puts beside a destination."""
        return [k for k in self.objects() if ".ckptkit-" in k]

    def uploads(self) -> list[str]:
        """Keys of the multipart uploads begun and neither completed nor aborted."""
        out = self.fs.call_s3("list_multipart_uploads", Bucket=self.name)
        return sorted(u["Key"] for u in out.get("Uploads", []))

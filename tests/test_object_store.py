"""Checkpoints on object storage: every command from S3 and to S3, against a real S3 protocol server on loopback
(moto's, started once per session by ``conftest.moto_server``) through s3fs, as users run it.

The oracle for the bytes is the same command run locally: the outputs must be equal byte for byte (the local
outputs are held to torch, safetensors and transformers by the other test files); torch reads an S3 output
directly here too. Failures are real server answers (a missing object, AccessDenied from moto's IAM), real
signals to a real ``ckptkit`` process, and an exception mid-upload.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from _checks import assert_same_tree, make_training_state
from _fsdp1 import MODEL
from ckptkit.errors import FormatError, UsageError
from ckptkit.formats import LocalOptions
from ckptkit.io.sources import Files
from ckptkit.io.storage import storage_at, storage_for
from ckptkit.io.storage.fsspec import upload as transfer
from ckptkit.io.storage.fsspec.paths import RemotePath
from ckptkit.io.storage.fsspec.reads import Job, RemoteFiles, coalesce
from ckptkit.io.storage.local import staging
from ckptkit.ops.convert import convert, reshard
from ckptkit.ops.export import export_hf
from ckptkit.ops.inspect import inspect, summary
from ckptkit.ops.verify import verify
from fixtures_models import tiny

CLI = [sys.executable, "-m", "ckptkit.cli"]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (or of ``root`` itself), by path relative to it."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)) if p != root else ".": hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Local checkpoints: a training state as FULL and as 2-rank DCP; the tiny FSDP model (whose layout LOCAL
    output is derived from) as 2-rank DCP; and a DCP with a 12 MiB tensor, large enough for multipart uploads."""
    root = tmp_path_factory.mktemp("object-store-sources")
    torch.save(make_training_state(), root / "state.pt")
    convert(root / "state.pt", root / "dcp", to="sharded", world_size=2)
    torch.save({k: v.clone() for k, v in tiny().state_dict().items()}, root / "tiny.pt")
    convert(root / "tiny.pt", root / "tiny-dcp", to="sharded", world_size=2)
    g = torch.Generator().manual_seed(5)
    torch.save({"big": torch.randn(3 << 20, generator=g), "small": torch.arange(5)}, root / "big.pt")
    convert(root / "big.pt", root / "big-dcp", to="sharded", world_size=1)
    # The other forms a source comes in, made of those: read from S3 by test_each_source_form_reads_from_s3.
    export_hf(root / "dcp", root / "hf", max_shard_size=200)
    export_hf(root / "dcp", root / "hf-file")
    convert(root / "tiny-dcp", root / "local", to="local", world_size=2, local=LocalOptions(model=MODEL))
    convert(root / "tiny-dcp", root / "full-shards", to="full", max_shard_size=400)
    return {"state": root / "state.pt", "dcp": root / "dcp", "tiny": root / "tiny-dcp", "big": root / "big-dcp",
            "hf": root / "hf", "hf-file": root / "hf-file" / "model.safetensors", "local": root / "local",
            "full-shards": root / "full-shards"}


# --------------------------------------------------------------------------------------------------------
# Paths and URLs


def test_storage_at_keeps_local_paths_and_maps_urls(tmp_path):
    assert storage_at(tmp_path)[1] == tmp_path and type(storage_at(str(tmp_path))[1]) is type(tmp_path)
    assert storage_at(f"file://{tmp_path}")[1] == tmp_path
    hub = storage_at("hf://org/model")[1]  # HfFileSystem: nothing is asked of the Hub until something is read
    assert isinstance(hub, RemotePath) and str(hub) == "hf://org/model" and type(hub.fs).__name__ == "HfFileSystem"
    assert hub.name == "model" and str(hub / "config.json") == "hf://org/model/config.json"


@pytest.mark.parametrize("url, message", [
    ("foo://bucket/out", r"foo://bucket/out: unknown protocol foo://"),   # no fsspec filesystem has it
    ("gs://bucket/out", r"gs://bucket/out: gs:// needs gcsfs; install it: pip install gcsfs \(or 'ckptkit\[gcs\]'\)"),
    ("az://container/out", r"az:// needs adlfs; install it: pip install adlfs"),
])
def test_convert_refuses_a_url_it_cannot_reach_in_one_line(sources, tmp_path, url, message):
    done = run_cli("convert", str(sources["state"]), url, "--to", "full")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("ckptkit: error: ")
    assert re.search(message, done.stderr), done.stderr


def test_convert_never_makes_a_local_directory_of_a_mangled_url(sources, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"s3:/bucket/out: looks like a s3:// URL that lost a slash"):
        convert(sources["state"], Path("s3://bucket/out"), to="full")
    assert not (tmp_path / "s3:").exists()


def test_save_and_load_refuse_urls(tmp_path, monkeypatch):
    import ckptkit

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match=r"s3://bucket/run: ckptkit.save works on a local or shared filesystem"):
        ckptkit.save("s3://bucket/run", model)
    with pytest.raises(UsageError, match=r"s3://bucket/run: ckptkit.load works on a local or shared filesystem"):
        ckptkit.load("s3://bucket/run", model)
    with pytest.raises(UsageError, match=r"s3:/bucket/run: looks like a s3:// URL that lost a slash"):
        ckptkit.load(Path("s3://bucket/run"), model)
    assert list(tmp_path.iterdir()) == []


def test_export_hf_refuses_to_write_to_the_hub(sources):
    with pytest.raises(UsageError, match=r"hf://org/model: ckptkit reads hf:// but does not write there"):
        export_hf(sources["dcp"], "hf://org/model")


# --------------------------------------------------------------------------------------------------------
# Reading ahead: pure, no server


@pytest.mark.parametrize("ranges, limit, joined", [
    ([("a", 0, 4), ("a", 4, 8), ("a", 9, 10)], 100, [("a", 0, 8), ("a", 9, 10)]),   # back to back, then a gap
    ([("a", 0, 4), ("b", 4, 8)], 100, [("a", 0, 4), ("b", 4, 8)]),                  # another object
    ([("a", 0, 6), ("a", 6, 12)], 8, [("a", 0, 6), ("a", 6, 12)]),                  # joined would pass the limit
    ([("a", 0, 20)], 8, [("a", 0, 8), ("a", 8, 16), ("a", 16, 20)]),               # split into pieces
])
def test_coalesce_joins_back_to_back_ranges_within_the_limit(ranges, limit, joined):
    assert list(coalesce(ranges, limit)) == joined


def test_remote_files_ahead_keeps_order_and_bounds_what_is_in_flight():
    remote = RemoteFiles(requests=3)
    lock, running, peak = threading.Lock(), [0], [0]

    def job(i: int) -> bytes:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return bytes([i]) * 10

    jobs = [Job(10, lambda i=i: job(i)) if i % 4 else Job(10, lambda i=i: bytes([i]) * 10, inline=True)
            for i in range(20)]
    try:
        got = list(remote.ahead(jobs, budget=25))  # 25 bytes: two pool jobs of 10 at a time, not three
    finally:
        remote.close()
    assert got == [bytes([i]) * 10 for i in range(20)]
    assert peak[0] == 2


def test_gathered_reads_fetch_each_source_in_few_requests_and_serve_every_read(tmp_path):
    """Two sources read alternately, with small gaps (a DCP's archive headers) and one far jump: each window's
    reads of a source become one request, and every read gets its own bytes."""
    data = {name: os.urandom(1 << 18) for name in "ab"}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    spans = [(s, s + 1000) for s in range(0, 20_000, 1100)] + [(150_000, 151_000)]  # 100-byte gaps, then a jump
    reads = [transfer._Read(str(tmp_path / name), s, e, "t") for s, e in spans for name in "ab"]
    with Files() as files:
        jobs = list(transfer._gathered(iter(reads), files, window=12_000))
        got = [bytes(job.run()) for job in jobs]  # in order, as RemoteFiles.ahead runs them
    assert got == [data[Path(r.path).name][r.start:r.end] for r in reads]
    requests = [job.nbytes for job in jobs if not job.inline]
    # 19 spans: three windows of 12 reads (6 spans of each source: 6,500 bytes with the gaps), then the last
    # span and the jump, too far (over transfer._GAP) to join
    assert requests == [6500] * 6 + [1000] * 4, requests


# --------------------------------------------------------------------------------------------------------
# Every command, from S3 and to S3, byte for byte as locally


def _convert(fmt: str, **kw):
    return lambda src, dst, **more: convert(src, dst, to=fmt, **kw, **more)


COMMANDS = {
    # name: (source, output name, the call)
    "convert-full-file": ("dcp", "out.pt", _convert("full")),
    "convert-full-shards": ("tiny", "out", _convert("full", max_shard_size=400)),
    "convert-sharded": ("state", "out", _convert("sharded", world_size=3)),
    "convert-hf": ("dcp", "out", _convert("hf")),
    "convert-local": ("tiny", "out", _convert("local", world_size=2, local=LocalOptions(model=MODEL))),
    "reshard": ("dcp", "out", lambda s, d, **kw: reshard(s, d, world_size=3, **kw)),
    "export-hf-cast-shards": ("dcp", "out", lambda s, d, **kw: export_hf(s, d, dtype="fp16", max_shard_size=200, **kw)),
}


@pytest.mark.parametrize("direction", ["from-s3", "to-s3", "s3-to-s3"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_on_s3_writes_what_it_writes_locally(s3, sources, tmp_path, command, direction):
    source, name, run = COMMANDS[command]
    local_src = sources[source]
    run(local_src, tmp_path / "local" / name)
    remote_src = s3.put(local_src, f"src/{local_src.name}")
    src = remote_src if direction != "to-s3" else local_src
    dst = s3.url(f"out/{name}") if direction != "from-s3" else tmp_path / "got" / name
    report = run(src, dst, max_memory=1 << 20)  # pieces and casts in many blocks, not one
    assert report.destination == str(dst)
    got = dst if isinstance(dst, Path) else s3.get(f"out/{name}", tmp_path / "got" / name)
    assert digest(got) == digest(tmp_path / "local" / name)
    if direction != "from-s3":  # the output and nothing else: no marker, no upload left open
        written = [k for k in s3.objects() if not k.startswith("src/")]
        assert written == sorted(f"out/{name}" + (f"/{p}" if p != "." else "") for p in digest(got))
        assert s3.uploads() == []


@pytest.mark.parametrize("source", ["hf", "hf-file", "local", "full-shards"])
def test_each_source_form_reads_from_s3_as_it_reads_locally(s3, sources, tmp_path, source):
    """The forms COMMANDS does not read (it reads DCP and a torch.save file): inspected and converted from S3."""
    local_src = sources[source]
    url = s3.put(local_src, f"src/{local_src.name}")
    local, remote_summary = summary(inspect(local_src)), summary(inspect(url))
    assert remote_summary.pop("path") == url and local.pop("path") == str(local_src)
    assert remote_summary == local
    convert(local_src, tmp_path / "want", to="sharded", world_size=2)
    convert(url, tmp_path / "got", to="sharded", world_size=2, max_memory=1 << 20)
    assert digest(tmp_path / "got") == digest(tmp_path / "want")


def test_cli_convert_to_s3_writes_the_bucket_and_nothing_in_the_working_directory(s3, sources, tmp_path):
    done = subprocess.run([*CLI, "convert", str(sources["state"]), s3.url("out"), "--to", "hf", "-q"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []  # no "s3:" directory, nor anything else
    assert s3.objects() == ["out/model.safetensors"]
    convert(sources["state"], tmp_path / "want", to="hf")
    assert digest(s3.get("out", tmp_path / "got")) == digest(tmp_path / "want")


def test_export_hf_copies_assets_from_s3_to_s3_as_locally(s3, sources, tmp_path):
    assets = tmp_path / "assets"
    assets.mkdir()
    # A model type transformers has no class of: the toy tensors are no model it would check them against.
    (assets / "config.json").write_text(json.dumps({"model_type": "my-own-lm", "tie_word_embeddings": False}))
    (assets / "tokenizer.json").write_text("{}")
    export_hf(sources["dcp"], tmp_path / "want", dtype="bf16", hf_assets=assets)
    export_hf(s3.put(sources["dcp"], "ckpt"), s3.url("out"), dtype="bf16", hf_assets=s3.put(assets, "assets"))
    assert digest(s3.get("out", tmp_path / "got")) == digest(tmp_path / "want")


def test_full_output_on_s3_loads_in_torch_straight_from_the_bucket(s3, sources):
    convert(s3.put(sources["dcp"], "dcp"), s3.url("model.pt"), to="full")
    loaded = torch.load(io.BytesIO(s3.fs.cat(f"{s3.name}/model.pt")), weights_only=True)
    assert_same_tree(loaded, make_training_state())


def test_large_files_go_up_in_multipart_uploads(s3, sources, tmp_path):
    convert(sources["big"], s3.url("out"), to="sharded", max_memory=8 << 20)  # parts of 8 MiB
    etag = s3.fs.info(f"{s3.name}/out/__0_0.distcp")["ETag"]
    assert etag.strip('"').endswith("-2"), etag  # S3's ETag of a 2-part upload
    assert digest(s3.get("out", tmp_path / "got")) == digest(sources["big"])


def test_inspect_of_s3_reads_headers_only_with_range_requests(s3, sources, monkeypatch):
    url = s3.put(sources["big"], "big")
    got: list[int] = []
    real_get = RemoteFiles.get
    monkeypatch.setattr(RemoteFiles, "get", staticmethod(lambda u, s, e: got.append(e - s) or real_get(u, s, e)))
    m = inspect(url)
    assert [t.key for t in m.tensors] == ["big", "small"]
    assert 0 < sum(got) < 64 << 10, got  # of a 12 MiB checkpoint
    local = summary(inspect(sources["big"]))
    remote_summary = summary(m)
    assert remote_summary.pop("path") == url and local.pop("path") == str(sources["big"])
    assert remote_summary == local


def test_inspect_cli_reads_an_s3_checkpoint_with_storage_options(s3, sources, moto_server, monkeypatch):
    url = s3.put(sources["dcp"], "ckpt")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    once = {"config_kwargs": {"retries": {"max_attempts": 1}}}  # botocore's options reach it: no retries
    done = run_cli("inspect", url, "--storage-options", json.dumps(once))
    assert done.returncode == 2 and done.stderr.startswith(f"ckptkit: error: {url}: ")  # AWS's bucket, not moto's
    done = run_cli("inspect", url, "--json", "--storage-options", json.dumps({"endpoint_url": moto_server}))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tensors"] == len(inspect(sources["dcp"]).tensors)


def test_verify_compares_s3_and_local_checkpoints(s3, sources, tmp_path):
    url = s3.put(sources["dcp"], "ckpt")
    assert verify(url, sources["dcp"]).ok and verify(url).ok
    reshard(sources["dcp"], tmp_path / "r3", world_size=3)
    assert verify(url, tmp_path / "r3").ok
    done = run_cli("verify", url, str(sources["state"]), "-q")
    assert done.returncode == 0, done.stderr
    other = tmp_path / "other.pt"
    state = make_training_state()
    state["model"]["f32"] = state["model"]["f32"] + 1
    torch.save(state, other)
    report = verify(url, other)
    assert not report.ok and [d.key for d in report.differences] == ["model.f32"]


# --------------------------------------------------------------------------------------------------------
# Failures: one line, exit 2, and no output


def test_a_missing_object_fails_the_run_and_leaves_no_output(s3, sources):
    url = s3.put(sources["dcp"], "ckpt")
    s3.fs.rm(f"{s3.name}/ckpt/__1_0.distcp")
    done = run_cli("convert", url, s3.url("out"), "--to", "hf")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert f"{url}: __1_0.distcp (holding" in done.stderr and "is missing" in done.stderr, done.stderr
    assert s3.objects("out") == [] and not s3.leftovers()


def test_an_existing_destination_needs_overwrite_and_is_replaced_whole(s3, sources, tmp_path):
    url = s3.put(sources["dcp"], "ckpt")
    reshard(url, s3.url("out"), world_size=3)
    done = run_cli("reshard", url, s3.url("out"), "--world-size", "2")
    assert done.returncode == 2 and f"{s3.url('out')} already exists; pass --overwrite" in done.stderr
    # A machine's CKPTKIT_WORKERS does not apply to an object store, which one process writes.
    done = run_cli("reshard", url, s3.url("out"), "--world-size", "2", "--overwrite", "-q",
                   env={"CKPTKIT_WORKERS": "2"})
    assert done.returncode == 0, done.stderr
    reshard(sources["dcp"], tmp_path / "want", world_size=2)
    assert digest(s3.get("out", tmp_path / "got")) == digest(tmp_path / "want")  # __2_0.distcp is gone too


def test_an_overwrite_of_a_model_folder_keeps_its_other_files_even_when_the_run_dies(s3, sources, tmp_path):
    """The old shards and index go, the tokenizer and model card stay; a run that dies before its commit leaves
    them too, and the next run's clean-up of its output spares them."""
    import shutil

    from ckptkit.io.storage import storage_at
    from ckptkit.io.storage.fsspec.staging import recover_objects

    folder = Path(shutil.copytree(sources["hf"], tmp_path / "base"))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "README.md").write_text("# base\n")
    url = s3.put(folder, "base")
    shards = [k for k in s3.objects("base") if k.endswith(".safetensors")]
    assert len(shards) > 1
    export_hf(sources["dcp"], url, overwrite=True)
    assert s3.objects("base") == ["base/README.md", "base/model.safetensors", "base/tokenizer.json"]
    export_hf(sources["dcp"], tmp_path / "want")
    assert s3.fs.cat(f"{s3.name}/base/model.safetensors") == (tmp_path / "want" / "model.safetensors").read_bytes()
    # A dead run of this host that had put a shard and not its index: its clean-up spares what it kept.
    marker = f"{s3.name}/.base.ckptkit-partial-{staging.host_name()}-{_dead_pid()}"
    s3.fs.pipe(marker, json.dumps({"commit": "model.safetensors.index.json",
                                   "kept": ["README.md", "tokenizer.json"]}).encode())
    s3.fs.rm(f"{s3.name}/base/model.safetensors")
    s3.fs.pipe(f"{s3.name}/base/model-00001-of-00002.safetensors", b"half")
    s3.fs.invalidate_cache()
    recover_objects(storage_at(s3.url())[1])
    assert s3.objects("base") == ["base/README.md", "base/tokenizer.json"] and not s3.leftovers()


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_a_destination_inside_the_source_is_refused(s3, sources):
    url = s3.put(sources["dcp"], "ckpt")
    with pytest.raises(UsageError, match=rf"destination {url}/out overlaps the input {url}"):
        reshard(url, f"{url}/out", world_size=2)


def test_permission_denied_by_the_server_is_one_line_and_writes_nothing(s3, sources, moto_server):
    """moto enforces IAM when asked to: a user allowed to read the bucket, not to write it. The policy is
    AmazonS3ReadOnlyAccess's (``s3:Get*``, ``s3:List*``), plus ``s3:Head*``: moto 5.2 checks a HEAD request
    against its operation's name (``s3:HeadObject``) where AWS checks ``s3:GetObject``, and no AWS action
    matches ``s3:Head*``, so the user may read and nothing more, with any moto."""
    import boto3
    from moto import settings

    url = s3.put(sources["dcp"], "ckpt")
    iam = boto3.client("iam", endpoint_url=moto_server, region_name="us-east-1")
    iam.create_user(UserName="reader")
    resources = [f"arn:aws:s3:::{s3.name}", f"arn:aws:s3:::{s3.name}/*"]
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*", "s3:Head*"], "Resource": resources}]}
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    before = settings.INITIAL_NO_AUTH_ACTION_COUNT
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    try:
        read = subprocess.run([*CLI, "inspect", url], capture_output=True, text=True, env=env, timeout=120)
        write = subprocess.run([*CLI, "reshard", url, s3.url("out"), "--world-size", "2"], capture_output=True,
                               text=True, env=env, timeout=120)
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT = before
        iam.delete_user_policy(UserName="reader", PolicyName="read")
        iam.delete_access_key(UserName="reader", AccessKeyId=key["AccessKeyId"])
        iam.delete_user(UserName="reader")
    assert read.returncode == 0, read.stderr
    assert write.returncode == 2 and write.stderr.count("\n") == 1, write.stderr
    assert "permission denied by the server" in write.stderr and s3.url() in write.stderr
    assert s3.objects("out") == [] and not s3.leftovers()


def test_a_failure_mid_upload_removes_everything_the_run_put(s3, sources, monkeypatch):
    real = transfer.file_pieces
    calls = []

    def failing(parts, files, budget, cast_bytes):
        calls.append(1)
        second = len(calls) == 2  # files go up at once: count at the call, not when the first piece is taken
        pieces = real(parts, files, budget, cast_bytes)
        yield next(pieces)
        if second:
            raise FormatError("a source went bad mid-upload")
        yield from pieces

    monkeypatch.setattr(transfer, "file_pieces", failing)
    with pytest.raises(FormatError, match="a source went bad mid-upload"):
        convert(sources["big"], s3.url("out"), to="sharded", world_size=2, max_memory=8 << 20)
    assert s3.objects() == [] and s3.uploads() == []


# A ckptkit run whose upload stops after its first 16 MiB (two 8 MiB pieces: one multipart part sent) until the
# file named by argv[1] appears; argv[2:] is the command line.
_PAUSED = """
import pathlib, sys, time
from ckptkit import cli
from ckptkit.io.storage.fsspec import upload as transfer
real, go = transfer.file_pieces, pathlib.Path(sys.argv[1])

def paused(*args):
    for i, piece in enumerate(real(*args)):
        if i == 2:
            (go.parent / "paused").touch()
            while not go.exists():
                time.sleep(0.02)
        yield piece

transfer.file_pieces = paused
cli.main(sys.argv[2:])
"""


def _paused_run(tmp_path: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED, str(tmp_path / "go"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "paused").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def _big_multipart_source(tmp_path: Path) -> Path:
    torch.save({"big": torch.randn(6 << 20, generator=torch.Generator().manual_seed(1))}, tmp_path / "big.pt")
    return tmp_path / "big.pt"


def test_a_killed_upload_leaves_no_committed_output_and_the_next_run_cleans_up(s3, tmp_path):
    src = _big_multipart_source(tmp_path)
    args = ["convert", str(src), s3.url("out"), "--to", "sharded", "--max-memory", "8MiB", "-q"]
    proc = _paused_run(tmp_path, *args)
    assert s3.uploads() == ["out/__0_0.distcp"]  # a part is up, the object is not
    proc.kill()
    proc.communicate()
    assert "out/.metadata" not in s3.objects() and s3.leftovers()
    done = run_cli("inspect", s3.url("out"))  # nothing committed: no checkpoint there, whatever the store lists
    assert done.returncode == 2 and ("not a checkpoint ckptkit knows" in done.stderr
                                     or "no such file or directory" in done.stderr), done.stderr
    dry = run_cli(*args, "--dry-run")  # plans as if the leftovers were gone, and leaves them be
    assert dry.returncode == 0 and "cleaned up" not in dry.stderr, dry.stderr
    assert s3.uploads() == ["out/__0_0.distcp"] and s3.leftovers()
    done = run_cli(*args)  # the same host, and the killed process is gone: its leftovers are removed
    assert done.returncode == 0, done.stderr
    assert "cleaned up after runs that are gone: removed out, which it had not completed, and 1 unfinished " \
           "uploads" in done.stderr, done.stderr
    assert s3.uploads() == [] and not s3.leftovers()
    convert(src, tmp_path / "want", to="sharded")
    assert digest(s3.get("out", tmp_path / "got")) == digest(tmp_path / "want")


def test_a_killed_overwrite_of_a_single_file_keeps_the_old_one_and_the_next_run_aborts_its_upload(s3, tmp_path):
    src = _big_multipart_source(tmp_path)
    convert(src, s3.url("model.pt"), to="full")
    old = s3.fs.cat(f"{s3.name}/model.pt")
    torch.save({"big": torch.zeros(6 << 20)}, tmp_path / "other.pt")
    proc = _paused_run(tmp_path, "convert", str(tmp_path / "other.pt"), s3.url("model.pt"), "--to", "full",
                       "--overwrite", "--max-memory", "8MiB", "-q")
    proc.kill()
    proc.communicate()
    assert s3.uploads() == ["model.pt"] and s3.fs.cat(f"{s3.name}/model.pt") == old  # the old object stands
    done = run_cli("convert", str(src), s3.url("model.pt"), "--to", "full", "--overwrite", "-q")
    assert done.returncode == 0, done.stderr
    assert "(model.pt is complete; aborted 1 unfinished uploads)" in done.stderr, done.stderr
    assert s3.uploads() == [] and not s3.leftovers() and s3.fs.cat(f"{s3.name}/model.pt") == old


def test_sigterm_mid_upload_aborts_it_and_removes_what_was_put(s3, tmp_path):
    src = _big_multipart_source(tmp_path)
    proc = _paused_run(tmp_path, "export-hf", str(src), s3.url("out"), "--max-memory", "8MiB", "--max-shard-size",
                       "20MB")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    (tmp_path / "go").touch()  # the paused upload takes its next piece, sees the stop, and aborts
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "ckptkit: terminated" in err, err
    assert s3.objects() == [] and s3.uploads() == []


def test_a_live_writer_of_another_host_is_named_not_removed(s3, sources):
    url = s3.put(sources["dcp"], "ckpt")
    marker = f"{s3.name}/.out.ckptkit-partial-otherhost-12345"
    s3.fs.pipe(marker, json.dumps({"host": "otherhost", "pid": 12345, "commit": ".metadata"}).encode())
    with pytest.raises(UsageError, match=r"s3://.*/out is being written by otherhost process 12345 .*pass "
                                         r"--overwrite"):
        reshard(url, s3.url("out"), world_size=2)
    reshard(url, s3.url("out"), world_size=2, overwrite=True)
    assert not s3.leftovers()


def test_remote_paths_name_the_bucket_object_in_errors(s3):
    with pytest.raises(FormatError, match=rf"{s3.url('nothing')}: no such file or directory"):
        inspect(s3.url("nothing"))
    assert storage_for(s3.url("x")).scheme == "fsspec" and storage_for("/tmp/x").scheme == "file"
    assert storage_for("file:///tmp/x").scheme == "file"


def test_s3_without_credentials_is_one_line_saying_where_to_put_them(s3, tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "state.pt")
    url = s3.put(tmp_path / "state.pt", "state.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    # nowhere else to find any: no config or credentials file, no instance metadata service
    env.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    hint = ("no credentials for s3:// found; set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "pass --storage-options '{\"profile\": \"NAME\"}' or '{\"key\": \"...\", \"secret\": \"...\"}'")
    dst = s3.url("out")
    write = ["convert", str(tmp_path / "state.pt"), dst, "--to", "sharded"]
    for args, named in ((["inspect", url], url), (write, dst)):
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr == f"ckptkit: error: {named}: {hint}\n"
    assert s3.objects("out") == []

"""Mutation test: a few hundred damaged checkpoints of every form, from a fixed seed, through the command line.

Each case copies a pristine checkpoint, damages one of its files in one way (byte flips, truncation,
extension, safetensors header and index JSON edits, pickle opcode and argument edits in ``.metadata`` and
``data.pkl``, zip structure, missing rank files, ``flat_layout.json`` and ``ckptkit.json`` edits), and runs
``ckptkit convert`` (or ``ckptkit verify`` for ``ckptkit.json``) in a worker that forks a child per case under
an address-space limit and an alarm. For every case:

- no traceback: exit 0, or 1/2 with one ``ckptkit: error:`` line; no hang; peak RSS under 400 MB;
- no partial destination and no staging directory left; the input unchanged;
- where the exit is 0, the output equals what torch or safetensors read from the same damaged input.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickletools
import random
import shutil
import struct
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from _checks import (
    hash_tree,
    load_dcp,
    load_full,
    load_hf,
    make_training_state,
    make_zoo,
    record_start,
    tensor_bits,
)

SEED = int(os.environ.get("CKPTKIT_MUTATION_SEED", "20261122"))  # fixed in CI; vary it to explore
CASES_PER_SOURCE = 40

# ------------------------------------------------------------------------------------ the worker

# Imports the command line once, then forks a child per case: the child limits its address space, arms an
# alarm against hangs and runs ckptkit.cli.main; the worker reports exit code, peak RSS (KiB) and output.
WORKER = r"""
import json, os, resource, signal, sys, tempfile
import ckptkit.cli
for line in sys.stdin:
    case = json.loads(line)
    out, err = tempfile.mkstemp(), tempfile.mkstemp()
    pid = os.fork()
    if pid == 0:
        resource.setrlimit(resource.RLIMIT_AS, (case["limit"], case["limit"]))
        signal.alarm(case["timeout"])
        os.dup2(out[0], 1)
        os.dup2(err[0], 2)
        try:
            ckptkit.cli.main(case["args"])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 99
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    texts = []
    for fd, path in (out, err):
        os.close(fd)
        with open(path, errors="replace") as f:
            texts.append(f.read())
        os.unlink(path)
    code = os.waitstatus_to_exitcode(status)
    print(json.dumps({"code": code, "rss": usage.ru_maxrss, "stdout": texts[0], "stderr": texts[1]}), flush=True)
"""


class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})

    def run(self, *args, timeout: int = 60, limit: int = 2 << 30) -> dict:
        self.proc.stdin.write(json.dumps({"args": [str(a) for a in args], "timeout": timeout, "limit": limit}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


# ------------------------------------------------------------------------------------ pristine sources


def _local_source(root: Path) -> Path:
    from ckptkit.formats import LocalOptions
    from ckptkit.ops.convert import convert
    from fixtures_models import tiny

    torch.manual_seed(0)
    torch.save({"model": tiny().state_dict(), "step": 3}, root / "tiny.pt")
    options = LocalOptions(model="fixtures_models:tiny", auto_wrap="block:fixtures_models:Block",
                           use_orig_params=False)
    convert(root / "tiny.pt", root / "local", to="local", world_size=2, local=options)
    return root / "local"


def _sources(root: Path) -> dict[str, Path]:
    """One checkpoint of each form, written by the framework's own writer where there is one."""
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    import ckptkit
    from ckptkit.harness.model import TinyConfig, TinyTransformer
    from ckptkit.ops.convert import convert

    state, zoo = make_training_state(), make_zoo()
    torch.save(state, root / "full.pt")
    (root / "bin").mkdir()
    save_torch_state_dict(zoo, root / "bin", safe_serialization=False, max_shard_size=200)
    dcp.save(state, checkpoint_id=str(root / "dcp-torch"), no_dist=True)
    convert(root / "full.pt", root / "dcp-ckptkit", to="sharded", world_size=2)
    (root / "hf").mkdir()
    save_file(zoo, root / "hf" / "model.safetensors")
    (root / "hf-sharded").mkdir()
    save_torch_state_dict(zoo, root / "hf-sharded", max_shard_size=200)
    torch.manual_seed(0)
    ckptkit.save(root / "saved", TinyTransformer(TinyConfig(layers=1)), form="full", step=1)
    return {"full": root / "full.pt", "bin": root / "bin", "dcp-torch": root / "dcp-torch",
            "dcp-ckptkit": root / "dcp-ckptkit", "hf": root / "hf", "hf-sharded": root / "hf-sharded",
            "local": _local_source(root), "saved": root / "saved" / "step-00000001"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return _sources(tmp_path_factory.mktemp("pristine"))


# ------------------------------------------------------------------------------------ mutations


def _zip_regions(data: bytes) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """Byte ranges of a torch.save archive's zip structure (headers, directory), and its data.pkl record."""
    import io

    z = zipfile.ZipFile(io.BytesIO(data))
    structure, pkl = [], None
    for info in z.infolist():
        start = record_start(data, info)
        structure.append((info.header_offset, start))
        if info.filename.endswith("data.pkl"):
            pkl = (start, start + info.file_size)
    cd = data.rfind(b"PK\x01\x02", 0, len(data))
    first_cd = data.find(b"PK\x01\x02")
    structure.append((first_cd if first_cd >= 0 else cd, len(data)))
    return structure, pkl


def _opcode_edit(pkl: bytes, rng: random.Random, in_place: bool) -> bytes:
    ops = list(pickletools.genops(pkl))
    i = rng.randrange(len(ops))
    op, arg, pos = ops[i]
    end = ops[i + 1][2] if i + 1 < len(ops) else len(pkl)
    data = bytearray(pkl)
    kind = rng.choice(["opcode", "argument", "argument"] + ([] if in_place else ["delete", "duplicate"]))
    if kind == "opcode":
        data[pos] = ord(rng.choice(pickletools.opcodes).code)
    elif kind == "argument" and end - pos > 1:
        width = end - pos - 1
        if isinstance(arg, int) and width in (1, 2, 4):  # an index, a count or an int: big, small or edgy
            value = rng.choice([0, 1, 255, 2**16 - 1, 2**31 - 1, 2**32 - 1, rng.randrange(2**(8 * width))])
            data[pos + 1:end] = (value % 2**(8 * width)).to_bytes(width, "little")
        else:
            at = rng.randrange(pos + 1, end)
            data[at] ^= 1 << rng.randrange(8)
    elif kind == "delete":
        del data[pos:end]
    elif kind == "duplicate":
        data[pos:pos] = data[pos:end]
    else:
        data[pos] ^= 1 << rng.randrange(8)
    return bytes(data)


def _json_edit(doc, rng: random.Random):
    """``doc`` with one node replaced, removed or added somewhere inside."""
    doc = copy.deepcopy(doc)
    nodes = [(None, None, doc)]
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            nodes.append((node, k, v))
            stack.append(v)
    parent, key, _ = rng.choice(nodes[1:] or nodes)
    junk = rng.choice([-1, 0, 2**40, -(2**70), 1.5, "x", "../../etc/passwd", None, True, [], {}, [[[[]]]],
                       "step-00000001", {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}])
    if parent is None:
        return junk
    action = rng.choice(["replace", "replace", "delete", "add"])
    if action == "replace":
        parent[key] = junk
    elif action == "delete":
        del parent[key]
    elif isinstance(parent, dict):
        parent[rng.choice(["extra", "model.ghost", "__metadata__", str(key) + "x"])] = junk
    else:
        parent.insert(rng.randrange(len(parent) + 1), junk)
    return doc


def _mutate_file(path: Path, kind: str, rng: random.Random) -> str:
    """Damage ``path`` in one way suited to what it is; return a description."""
    data = path.read_bytes()
    choices = ["flip", "truncate", "extend"]
    if kind == "zip":
        choices += ["zip", "zip", "pickle", "pickle", "pickle"]
    elif kind == "pickle":
        choices += ["pickle"] * 5
    elif kind in ("json", "safetensors"):
        choices += [kind] * 5
    how = rng.choice(choices)
    if how == "flip":
        for _ in range(rng.choice([1, 1, 3])):
            at = rng.randrange(len(data))
            data = data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1:]
    elif how == "truncate":
        data = data[:rng.randrange(len(data))]
    elif how == "extend":
        data += rng.choice([b"\x00" * rng.randrange(1, 64), os.urandom(rng.randrange(1, 64)), data[:100]])
    elif how == "zip":
        structure, _ = _zip_regions(data)
        lo, hi = rng.choice(structure)
        at = rng.randrange(lo, hi)
        data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
    elif how == "pickle" and kind == "zip":
        _, (lo, hi) = _zip_regions(data)
        data = data[:lo] + _opcode_edit(data[lo:hi], rng, in_place=True) + data[hi:]
    elif how == "pickle":
        data = _opcode_edit(data, rng, in_place=False)
    elif how == "json":
        data = json.dumps(_json_edit(json.loads(data), rng)).encode()
    elif how == "safetensors":
        (n,) = struct.unpack_from("<Q", data)
        header = json.dumps(_json_edit(json.loads(data[8:8 + n]), rng)).encode()
        length = len(header) if rng.random() < 0.8 else n
        data = struct.pack("<Q", length) + header + data[8 + n:]
    path.write_bytes(data)
    return f"{how} {path.name}"


def _kind(path: Path) -> str:
    if path.name == ".metadata":
        return "pickle"
    if path.suffix == ".json":
        return "json"
    if path.suffix == ".safetensors":
        return "safetensors"
    if path.suffix in (".pt", ".bin", ".distcp") and path.read_bytes()[:4] == b"PK\x03\x04":
        return "zip"
    return "raw"


def mutate(src: Path, rng: random.Random) -> str:
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    if len(files) > 1 and rng.random() < 0.08:
        victim = rng.choice(files)
        victim.unlink()
        return f"removed {victim.name}"
    # .distcp files are mostly tensor bytes, whose damage is only read back: favour the metadata and pickles.
    weights = [4 if _kind(f) in ("pickle", "json", "safetensors") else 2 if _kind(f) == "zip" else 1 for f in files]
    target = rng.choices(files, weights)[0]
    return _mutate_file(target, _kind(target), rng)


# ------------------------------------------------------------------------------------ oracles


def _local_oracle(root: Path) -> dict:
    """A LOCAL checkpoint read by torch itself: each rank file by ``torch.load`` (ShardedTensor's process-group
    checks set aside), each flat parameter cut into its parameters by the layout file, as plain JSON."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    original = ShardedTensor.__setstate__

    def keep(self, state):
        self._ckptkit_local = state[0]
    ShardedTensor.__setstate__ = keep
    try:
        ranks = [torch.load(root / f"rank{r}.pt", weights_only=False, map_location="cpu") for r in range(2)]
    finally:
        ShardedTensor.__setstate__ = original
    layout = json.loads((root / "flat_layout.json").read_text())
    out: dict = {}
    for path, leaf in _flat(ranks[0]).items():
        if path.endswith("_flat_param"):
            unit = max((u for u in layout["units"] if path == u["key"] or path.endswith("." + u["key"])),
                       key=lambda u: len(u["key"]))
            parent = path[: -len(unit["key"])]
            flat = torch.cat([s.tensor for r in ranks for s in _flat(r)[path]._ckptkit_local])
            named = {}
            for p in unit["params"]:
                n = math.prod(p["shape"])
                named[p["fqn"]] = flat[p["offset"]:p["offset"] + n].view(p["shape"])
                assert named[p["fqn"]].numel() == n
            for alias, fqn in unit.get("shared", ()):
                named[alias] = named[fqn]
            out.update({parent + k: v for k, v in named.items()})
        else:
            out[path] = leaf
    return out


def _flat(tree, prefix: str = "") -> dict:
    """Leaves by dotted key, as ckptkit (and DCP) name them."""
    out = {}
    if isinstance(tree, Mapping) and tree:
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(tree, list) and tree and any(isinstance(v, (Mapping, list, torch.Tensor)) for v in tree):
        for i, v in enumerate(tree):
            out.update(_flat(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = tree
    return out


def _hf_oracle(root: Path) -> dict:
    index = root / "model.safetensors.index.json"
    if not index.exists():
        return dict(load_hf(root))
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for name in sorted(set(weight_map.values())):
        shard = load_hf(root / name)
        assert all(weight_map.get(k) == name for k in shard), "a shard holds keys the index places elsewhere"
        out.update(shard)
    assert set(out) == set(weight_map), "the index names keys no shard holds"
    return out


def _bin_oracle(root: Path) -> dict:
    weight_map = json.loads((root / "pytorch_model.bin.index.json").read_text())["weight_map"]
    out = {}
    for name in sorted(set(weight_map.values())):
        assert "/" not in name
        shard = load_full(root / name)
        assert all(weight_map.get(k) == name for k in shard), "a shard holds keys the index places elsewhere"
        out.update(shard)
    assert set(out) == set(weight_map), "the index names keys no shard holds"
    return out


def oracle(form: str, src: Path, scratch: Path) -> dict:
    """What torch or safetensors read from ``src``, by dotted key. Raises if they cannot read it."""
    if form == "full":
        return _flat(load_full(src))
    if form == "bin":
        return _bin_oracle(src)
    if form.startswith("dcp"):
        return _flat(load_dcp(src, scratch / "oracle.pt"))
    if form.startswith("hf"):
        return _hf_oracle(src)
    if form == "local":
        return _local_oracle(src)
    raise AssertionError(form)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(tensor_bits(a), tensor_bits(b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    return type(a) is type(b) and a == b


def read_output(to: str, out: Path, scratch: Path) -> dict:
    if to == "full":
        return _flat(load_full(out))
    if to == "sharded":
        return _flat(load_dcp(out, scratch / "output.pt"))
    return dict(load_hf(out))


def expected_in(to: str, want: dict) -> dict:
    """The part of the input an output of form ``to`` holds: HF keeps the model part only, under its own names
    (these inputs keep it in a ``model`` section, or are a model state dict); torch's DCP loader returns no
    empty dict (ckptkit records them where torch does not look, as the conversion report says)."""
    if to == "hf":
        tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
        model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        return model or tensors
    if to == "sharded":
        return {k: v for k, v in want.items() if not (isinstance(v, dict) and not v)}
    return want


# ------------------------------------------------------------------------------------ the test


def _cases() -> list[tuple[str, int]]:
    forms = ["full", "bin", "dcp-torch", "dcp-ckptkit", "hf", "hf-sharded", "local", "saved"]
    return [(form, i) for form in forms for i in range(CASES_PER_SOURCE)]


def test_mutated_checkpoints_fail_cleanly_or_convert_exactly(sources, worker, tmp_path):
    failures = []
    outcomes = {"exit 0": 0, "exit 1": 0, "exit 2": 0}
    for form, i in _cases():
        rng = random.Random(f"{SEED}-{form}-{i}")
        case = tmp_path / f"{form}-{i}"
        case.mkdir()
        pristine = sources[form]
        src = case / pristine.name
        shutil.copytree(pristine, src) if pristine.is_dir() else shutil.copy2(pristine, src)
        if form == "saved":
            what = _mutate_file(src / "ckptkit.json", "json" if rng.random() < 0.7 else "raw", rng)
            args, to, out = ["verify", src, "-q"], None, None
        else:
            what = mutate(src, rng)
            to = rng.choice(["full", "full", "sharded", "hf"])
            out = case / ("out.pt" if to == "full" else "out")
            args = ["convert", src, out, "--to", to, "-q"]
        before = hash_tree(src)
        r = worker.run(*args)
        outcomes[f"exit {r['code']}"] = outcomes.get(f"exit {r['code']}", 0) + 1
        problem = _check(form, src, to, out, r, before, case, pristine)
        if problem:
            failures.append(f"{form} #{i} ({what}, to {to}): {problem}")
        shutil.rmtree(case)
    print(f"{len(_cases())} cases: {outcomes}")
    assert not failures, "\n".join(failures[:40]) + f"\n({len(failures)} failures)"
    assert outcomes["exit 0"] > 20 and outcomes["exit 2"] > 50  # the mutations both pass and break


def _check(form: str, src: Path, to: str | None, out: Path | None, r: dict, before: dict, case: Path,
           pristine: Path) -> str | None:
    code, err = r["code"], r["stderr"]
    if code not in (0, 1, 2):
        return f"exit {code}: {err[-1500:]}"
    if "Traceback" in err or (code == 2 and not (err.startswith("ckptkit: error: ") and err.count("\n") == 1)):
        return f"not a one-line error: {err[-1500:]}"
    if r["rss"] > 400_000:
        return f"peak RSS {r['rss'] // 1024} MB"
    if hash_tree(src) != before:
        return "the input changed"
    staged = [p.name for p in case.rglob("*") if ".ckptkit-partial-" in p.name or ".ckptkit-old-" in p.name]
    if staged:
        return f"staging left behind: {staged}"
    if form == "saved":
        return _check_verify(src, code, r, json.loads((pristine / "ckptkit.json").read_text()))
    if code != 0:
        return f"a partial output at exit {code}" if out.exists() else None
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        want = expected_in(to, oracle(form, src, case))
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (any failure to read is the finding)
        return f"exit 0, but torch/safetensors cannot read the input ({_last_line(e)})"
    try:
        got = read_output(to, out, case)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        return f"exit 0, but torch/safetensors cannot read the output ({_last_line(e)})"
    if set(got) != set(want):
        return f"exit 0 with keys {sorted(set(got) ^ set(want))[:6]} differing from the oracle's"
    bad = [k for k in want if not _same(got[k], want[k])]
    return f"exit 0, but {bad[:6]} differ from what the oracle reads" if bad else None


def _last_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def _check_verify(src: Path, code: int, r: dict, pristine: dict) -> str | None:
    """``ckptkit verify`` of a checkpoint whose ckptkit.json was damaged: 0 only if nothing that matters changed
    (the save number only orders saves for rotation; a field left out that defaults to its value is no change)."""
    if code == 1:
        return None if r["stdout"].strip() else "exit 1 without saying what differs"
    if code == 2:
        return None
    try:
        doc = json.loads((src / "ckptkit.json").read_text())
    except ValueError:
        return "exit 0 with a ckptkit.json that is not JSON"
    if _meaning(doc) == _meaning(pristine):
        return None
    return f"exit 0 though ckptkit.json was changed: {json.dumps(doc)[:600]}"


def _meaning(doc) -> object:
    if not isinstance(doc, dict):
        return doc
    doc = {k: v for k, v in doc.items() if k != "save"}
    for k, default in (("objects", {}), ("files", {}), ("tensors", {}), ("step", None), ("version", 1)):
        doc.setdefault(k, default)
    return doc

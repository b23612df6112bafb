"""Torch-side checkers and tensor makers shared by the ckptkit tests.

Everything a test writes lives under ``tmp_path``. Expected values are always read back with torch's own
loaders (``torch.load(weights_only=True)``, ``dcp_to_torch_save``, ``safetensors.torch.load_file``), never
with ckptkit, so a test cannot pass because ckptkit agrees with itself.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

# --------------------------------------------------------------------------------------------------------
# Comparisons


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor: a NaN-safe, -0.0-aware bitwise view of any dtype."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_tensor_identical(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{what}: {type(a)} vs {type(b)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(tensor_bits(a), tensor_bits(b)), f"{what}: bytes differ"


def assert_same_tree(a, b, where: str = "") -> None:
    """Nested dicts/lists/tuples equal in structure and container types; tensors bit-identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert_tensor_identical(a, b, where)
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{where}: dict vs {type(b).__name__}"
        assert set(a) == set(b), f"{where}: keys {sorted(map(repr, a))} vs {sorted(map(repr, b))}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def tree_difference(a, b, where: str = "") -> str | None:
    """What :func:`assert_same_tree` would report, or None: for rank processes, which return their findings
    for the test process to assert on."""
    try:
        assert_same_tree(a, b, where)
    except AssertionError as e:
        return str(e)
    return None


def flat_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensor leaves of a nested state dict under DCP's dotted keys (``optim.state.0.exp_avg``)."""
    out: dict[str, torch.Tensor] = {}
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, (Mapping, list)):
            out.update(flat_tensors(v, key + "."))
    return out


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (or of ``root`` itself), with sizes and modes folded in."""
    root = Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root.parent)): hashlib.sha256(p.read_bytes()).hexdigest() + f":{p.stat().st_mode:o}"
            for p in files}


def leftovers(directory: Path) -> list[str]:
    """Staging or backup entries ckptkit may leave beside a destination."""
    return sorted(p.name for p in Path(directory).iterdir() if ".ckptkit-" in p.name)


# --------------------------------------------------------------------------------------------------------
# Readers that are torch's own


def load_full(path: Path):
    return torch.load(path, weights_only=True, map_location="cpu")


def load_dcp(path: Path, scratch: Path):
    """A DCP directory as one state dict, by torch's ``dcp_to_torch_save`` (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    scratch.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(str(path), str(scratch))
    return torch.load(scratch, weights_only=True)


def load_hf(path: Path) -> dict[str, torch.Tensor]:
    """An HF safetensors file or directory (single file or index + shards) by ``safetensors`` itself."""
    import json

    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file():
        return load_file(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, torch.Tensor] = {}
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(path / name))
        return out
    return load_file(path / "model.safetensors")


# --------------------------------------------------------------------------------------------------------
# Tensors


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random: NaN payloads, infinities, -0.0 and denormals included."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def make_zoo(seed: int = 0) -> dict[str, torch.Tensor]:
    """One small tensor of each case the byte planner must get right."""
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": random_bits((5, 3), torch.float32, g),            # 5 rows: uneven at 2 and 3 ranks
        "bf16": random_bits((7, 2), torch.bfloat16, g),          # 7 rows: 4+3 / 3+3+1
        "f16": random_bits((4,), torch.float16, g),              # 1-D
        "i64": torch.arange(-6, 6, dtype=torch.int64).reshape(4, 3),
        "flags": torch.rand(5, generator=g) > 0.5,              # bool
        "f8": random_bits((3, 4), torch.float8_e4m3fn, g),       # 1-byte float with NaN patterns
        "scalar": torch.tensor(2.5),                             # 0-d
        "empty": torch.zeros(0, 3),                              # numel 0
        "short": random_bits((2, 5), torch.float32, g),          # dim 0 smaller than 3 ranks
        "single": random_bits((1,), torch.float32, g),           # one element
        "tall": random_bits((11, 4), torch.float32, g),          # 11 rows: 6+5 / 4+4+3
    }


def make_training_state(seed: int = 0) -> dict:
    """A nested FULL checkpoint as a training loop saves it (string-keyed optimizer state, as
    ``get_state_dict`` produces), with every kind of non-tensor entry a round trip must keep."""
    zoo = make_zoo(seed)
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "model": zoo,
        "optimizer": {
            "state": {"f32": {"exp_avg": random_bits((5, 3), torch.float32, g), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "foreach": None, "params": ["f32"]}],
        },
        "step": 7,
        "name": "run-1",
    }


# --------------------------------------------------------------------------------------------------------
# Hostile input


class Evil:
    """Unpickling this runs a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo hacked > {self.marker}",))


def record_start(data: bytes, info: zipfile.ZipInfo) -> int:
    """Where a stored zip record's bytes start in ``data``: after its local header, whose name and extra
    field lengths may differ from the central directory's."""
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def data_pkl_flips(target: Path, step: int) -> Iterator[int]:
    """Rewrite the ``torch.save`` archive ``target`` with one byte of its ``data.pkl`` flipped, every ``step``
    bytes, yielding each flipped byte's offset within ``data.pkl``; ``target`` is restored afterwards."""
    clean = target.read_bytes()
    with zipfile.ZipFile(target) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    start = record_start(clean, info)
    try:
        for pos in range(start, start + info.file_size, step):
            data = bytearray(clean)
            data[pos] ^= 0x5A
            target.write_bytes(bytes(data))
            yield pos - start
    finally:
        target.write_bytes(clean)


_CLI_WATCHING_IMPORTS = """
import runpy, sys
sys.argv = ["ckptkit", *sys.argv[1:]]
try:
    runpy.run_module("ckptkit", run_name="__main__")
finally:
    print("imported:", *sorted(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr)
"""


def run_cli_watching_imports(*args: str) -> tuple[int, str, set[str]]:
    """``ckptkit ARGS`` in a fresh interpreter: its exit status, its output (stdout and stderr, the import line
    left out), and which of torch and transformers it imported."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CLI_WATCHING_IMPORTS, *args], capture_output=True, text=True,
                          timeout=300)
    lines = (done.stdout + done.stderr).splitlines()
    imported = next((set(line.split()[1:]) for line in lines if line.startswith("imported:")), set())
    return done.returncode, "\n".join(line for line in lines if not line.startswith("imported:")), imported

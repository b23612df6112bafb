"""``bin/bench convert``: ckptkit's conversions of a synthetic checkpoint against ``cp -r`` of the same bytes, and
against the path users take without ckptkit (torch's ``dcp_to_torch_save`` and safetensors' ``save_file``).

Shapes (``--shape``; :mod:`.shapes` holds them), each a bf16 checkpoint saved as a 4-rank DCP:

- ``dense``: LLaMA-shaped, as many layers as fit in ``--size``: ``export-hf`` and ``reshard``, with each
  ``--workers`` value asked for; with ``--checksums``, its ``ckptkit.json`` checked and not (the cost of the checks).
- ``moe``: ``--layers`` layers of 64 experts with AdamW state: tens of thousands of chunks.
- ``tp``: the dense shapes on a 2 x 2 (dp x tp) mesh saved by torch's own ``dcp.save``; the export is checked
  against torch's ``dcp_to_torch_save``.
- ``megatron``: megatron-core's layer-stacked GPT names for a Llama, ``export-hf --preset megatron-llama``.
- ``moe-titan``, ``megatron-moe``, ``fp8``: a conversion and its way back, each against the ``cp -r`` of its own
  input (torchtitan's stacked experts split and joined; megatron-core's per-layer experts; FP8 export with block
  scales and the import that dequantizes it into bf16, ``convert --dtype bf16``).

``--world-size N`` is the reshard target; at N >= 8 the export from the N-rank output is timed too and checked
to equal the one from 4 ranks byte for byte.
"""

from __future__ import annotations

import filecmp
import json
import sys
from pathlib import Path

import click

from . import shapes as S
from .runner import Row, ckptkit_command, compiled, cp, time_rows, warm
from .table import table

__all__ = ["convert", "there_and_back"]

_TORCH_PATH = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
src, tmp, out = sys.argv[1:]
dcp_to_torch_save(src, tmp)
save_file(torch.load(tmp, weights_only=True), out)
"""


def _checkpoint(shape: str, size: int, layers: int, root: Path) -> tuple[int, str, list[str]]:
    """Write ``shape``'s DCP under ``root / 'dcp'``: its bytes, its description, and the mapping options it needs."""
    if shape == "tp":
        total = S.write_tp(root, size)
        return total, f"{total / 1e9:.2f} GB bf16, LLaMA-shaped, 2 x 2 (dp x tp) DCP saved by torch", []
    if shape == "moe":
        tensors = S.with_adamw(S.moe_shapes(layers))
        total = S.write_dcp(root, tensors)
        return total, (f"{total / 1e9:.2f} GB, {layers}-layer 64-expert MoE with AdamW state, {len(tensors)} "
                       "tensors, 4-rank DCP"), []
    if shape == "megatron":
        total = S.write_megatron(root, size)
        return (total, f"{total / 1e9:.2f} GB bf16, megatron-core GPT (Llama), 4-rank torch_dist",
                ["--preset", "megatron-llama"])
    total = S.write_dcp(root, [(k, s, "bfloat16") for k, s in S.llama_shapes(size)])
    return total, f"{total / 1e9:.2f} GB bf16, LLaMA-shaped, 4-rank DCP", []


def convert(shape: str, size: int, layers: int, world_size: int, workers: str | None, repeat: int,
            skip_torch: bool, with_fsync: bool, checksums: bool, page_cache: str, root: Path) -> None:
    """Time ``export-hf`` and ``reshard`` of ``shape``'s checkpoint (and what the options add) against ``cp``."""
    if shape in ("moe-titan", "megatron-moe", "fp8"):
        return _both_ways(shape, size, layers, repeat, page_cache, root)
    total, what, mapping = _checkpoint(shape, size, layers, root)
    src = root / "dcp"
    if checksums:
        S.with_checksums(src)
        what += ", with ckptkit.json"
    what += f", {_chunks(src)} chunks"
    compiled()
    extra = [["--workers", w] for w in workers.split(",")] if workers else [[]]
    hf4 = root / "hf-from-4"
    rows = [cp(src)]
    for args in extra:
        rows.append(Row(_label("ckptkit export-hf", args), lambda out, a=args: ckptkit_command(
            "export-hf", str(src), str(out), "-q", *mapping, *a), src, keep=hf4 if args == extra[0] else None))
        rows.append(Row(_label(f"ckptkit reshard -> {world_size}", args), lambda out, a=args: ckptkit_command(
            "reshard", str(src), str(out), "--world-size", str(world_size), "-q", *a), src,
            keep=root / "resharded" if args == extra[0] else None))
    if checksums:
        rows.append(Row("ckptkit export-hf --no-verify-checksums", lambda out: ckptkit_command(
            "export-hf", str(src), str(out), "-q", *mapping, "--no-verify-checksums"), src))
    if with_fsync:
        rows.append(Row("ckptkit export-hf --fsync", lambda out: ckptkit_command(
            "export-hf", str(src), str(out), "-q", *mapping, "--fsync"), src))
    if not skip_torch:
        rows.append(Row("torch dcp_to_torch_save + save_file", lambda out: [
            sys.executable, "-c", _TORCH_PATH, str(src), str(root / "tmp.pt"), str(out)], src))
    warm(src)
    time_rows(rows, repeat, root, page_cache)
    checks = []
    if world_size >= 8:
        many, hf_many = root / "resharded", root / "hf-from-many"
        more = [cp(many)] + [Row(_label(f"ckptkit export-hf from {world_size} ranks", args),
                                 lambda out, a=args: ckptkit_command("export-hf", str(many), str(out), "-q",
                                                                     *mapping, *a),
                                 many, keep=hf_many if args == extra[0] else None) for args in extra]
        warm(many)
        time_rows(more, repeat, root, page_cache)
        rows += more
        checks.append(f"export from {world_size} ranks equals the export from 4 ranks byte for byte: "
                      f"{same_tree(hf4, hf_many)}")
    if shape == "tp":
        checks.append(f"export-hf equals torch's dcp_to_torch_save, tensor by tensor: {_same_as_torch(src, hf4, root)}")
    table(rows, total, repeat, what, page_cache)
    for line in checks:
        click.echo(line)


def _label(name: str, args: list[str]) -> str:
    return f"{name} {' '.join(args)}".rstrip()


def there_and_back(shapes: S.Shapes, config: dict, there: tuple[str, list[str]], back: tuple[str, list[str]],
                   repeat: int, root: Path, page_cache: str = "warm") -> tuple[list[Row], int]:
    """``shapes`` in bf16 as a 4-rank DCP with ``config`` as its config.json; ``there`` (a row's name and its
    ckptkit arguments after SRC OUT) converts it, and ``back`` converts that output again; each timed against
    the ``cp -r`` of its own input. The rows and the DCP's size."""
    total = S.write_dcp(root, [(k, s, "bfloat16") for k, s in shapes])
    assets = root / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(config))
    src, mid = root / "dcp", root / "mid"
    compiled()
    first = Row(there[0], lambda out: ckptkit_command(there[1][0], str(src), str(out), "-q", *there[1][1:],
                                                      "--hf-assets", str(assets)), src, keep=mid)
    warm(src)
    time_rows([first], 1, root)  # makes the output the way back reads
    first.runs.clear()
    second = Row(back[0], lambda out: ckptkit_command(back[1][0], str(mid), str(out), "-q", *back[1][1:],
                                                      "--hf-assets", str(assets)), mid)
    rows = [cp(src), first, cp(mid), second]
    warm(mid)
    time_rows(rows, repeat, root, page_cache)
    return rows, total


def _both_ways(shape: str, size: int, layers: int, repeat: int, page_cache: str, root: Path) -> None:
    if shape == "moe-titan":
        shapes, config = S.titan_moe_shapes(layers)
        rows, total = there_and_back(shapes, config, ("ckptkit export-hf (experts split)", ["export-hf"]), (
            "ckptkit convert --to sharded (joined)",
            ["convert", "--to", "sharded", "--world-size", "4", "--preset", "torchtitan-qwen3-moe"]), repeat, root,
            page_cache)
        what = f"torchtitan Qwen3-MoE, {layers} layers x 64 stacked experts"
    elif shape == "megatron-moe":
        return _megatron_moe(layers, repeat, page_cache, root)
    else:
        shapes, config = S.deepseek_shapes(size)
        rows, total = there_and_back(shapes, config, ("ckptkit export-hf --dtype fp8", ["export-hf", "--dtype", "fp8"]),
                                     ("ckptkit convert --to sharded --dtype bf16 (dequantized)",
                                      ["convert", "--to", "sharded", "--world-size", "4", "--preset",
                                       "torchtitan-deepseek-v3", "--dtype", "bf16"]), repeat, root, page_cache)
        what = f"DeepSeek-V3-shaped (MLA, dense MLPs), {config['num_hidden_layers']} layers, DCP -> FP8 HF -> DCP"
    table(rows, total, repeat, f"{total / 1e9:.2f} GB bf16, {what}, 4-rank DCP, {_chunks(root / 'dcp')} chunks",
          page_cache)


def _megatron_moe(layers: int, repeat: int, page_cache: str, root: Path) -> None:
    """export-hf and reshard of megatron-core's per-layer MoE names, against cp."""
    import torch

    from ckptkit.formats.megatron import CONFIG, CONFIG_BYTES

    shapes, config = S.megatron_moe_shapes(layers)
    total = S.write_dcp(root, [(k, s, "bfloat16") for k, s in shapes])
    src = root / "dcp"
    torch.save({"checkpoint_version": 3.0, "iteration": 0}, src / "common.pt")
    (src / CONFIG).write_bytes(CONFIG_BYTES)
    assets = root / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps(config))
    compiled()
    rows = [cp(src), Row("ckptkit export-hf --preset megatron-mixtral", lambda out: ckptkit_command(
        "export-hf", str(src), str(out), "-q", "--preset", "megatron-mixtral", "--hf-assets", str(assets)), src),
        Row("ckptkit reshard -> 3", lambda out: ckptkit_command("reshard", str(src), str(out), "--world-size", "3",
                                                               "-q"), src)]
    warm(src)
    time_rows(rows, repeat, root, page_cache)
    table(rows, total, repeat, f"{total / 1e9:.2f} GB bf16, megatron-core Mixtral-shaped MoE, {layers} layers x 64 "
                               f"experts, per-layer keys, 4-rank torch_dist, {_chunks(src)} chunks", page_cache)


def same_tree(a: Path, b: Path) -> bool:
    """Whether directories ``a`` and ``b`` hold the same files, byte for byte."""
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def _same_as_torch(src: Path, hf: Path, root: Path) -> bool:
    """Whether the safetensors export holds, bit for bit, what torch's ``dcp_to_torch_save`` gathers."""
    import torch
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = root / "torch.pt"
    dcp_to_torch_save(src, ref)
    want = torch.load(ref, mmap=True, weights_only=True)
    got: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            got.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118 (safe_open is no dict)
    same = set(want) == set(got) and all(
        want[k].dtype == got[k].dtype and want[k].shape == got[k].shape
        and torch.equal(want[k].view(torch.int16), got[k].view(torch.int16)) for k in want)
    ref.unlink()
    return same


def _chunks(path: Path) -> int:
    from ckptkit.formats.dcp import DcpIO

    return sum(len(t.chunks) for t in DcpIO().read(path).tensors)

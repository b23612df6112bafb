"""DEEPSPEED: DeepSpeed ZeRO stage 1, 2 and 3 checkpoints, read (not written) without torch.

What DeepSpeed 0.19's engine saves (``runtime/engine.py`` ``save_checkpoint``, ``_save_zero_checkpoint``)::

    SAVE_DIR/latest                      the tag, e.g. "global_step3"
    SAVE_DIR/<tag>/mp_rank_00_model_states.pt                       stage 1, 2 (dp rank 0 writes it)
    SAVE_DIR/<tag>/zero_pp_rank_{r}_mp_rank_00_model_states.pt      stage 3, one per dp rank
    SAVE_DIR/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   one per dp rank

The fp32 master weights live in the optimizer files, as each rank's partition of flat groups. Stage 1 and 2
concatenate a group's parameters (with alignment padding after each), pad to a multiple of ``2 * ws`` and
give each rank an equal part, saved without the tail padding, so the ranks' partitions in rank order are the
group's parameters back to back. Stage 3 partitions each parameter on its own (``ceil(n / ws)`` per rank,
padding on the last) and concatenates a rank's partitions per sub-group. Either way a parameter is a few
byte ranges of the optimizer files, and this module lists them as chunks, the same way for the Adam moments.

The manifest holds what DeepSpeed's ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` returns, in its
order, under ``model.``: buffers (model file 0), frozen parameters (in their module dtype), the fp32 trainable
parameters, then tied aliases; and, laid out as torch's ``get_state_dict`` names it, ``optim.state.<name>.*``
and ``optim.param_groups``. Two deliberate differences: floating buffers keep their saved dtype (zero_to_fp32
casts them to fp32), and stage 1's frozen parameters, which zero_to_fp32 leaves out, come from ``module``.

Refused, naming what was found: tensor or pipeline parallelism (``mp_rank_01``, ``layer_*``), MoE and AutoEP,
stage 0 (no ZeRO optimizer files, or bf16's ``BF16_Optimizer``), NVMe offload, universal checkpoints, partition
counts that disagree with the files, quantized frozen fragments, and ZeRO-3 model files without their optimizer
files (their parameters are 0-element placeholders).

This module finds the tag directory and its files and loads them as data; :mod:`.zero_partitions` locates
each parameter in them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...codecs.pickle_read import EnumStandIn, allow_records, safe_getattr
from ...codecs.torchzip_read import read_archive
from ...core.manifest import Format, Manifest
from ...errors import CheckpointError, FormatError, IncompleteCheckpointError, UsageError
from ..base import ReadOnlyIO
from .zero_partitions import ZeroFiles, zero_manifest

__all__ = ["DeepSpeedIO", "read_tag", "tag_directory"]

_LATEST = "latest"
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ANY_STATES = re.compile(r".*_(model|optim)_states\.pt")
_PIPELINE = re.compile(r"layer_\d+-model_\d+-model_states\.pt")
_MOE = re.compile(r"(expp_rank_.*|.*expert_.*)\.pt")
_MAX_TAG = 4096

_ZERO_STAGES = {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3}
_GLOBALS: dict[tuple[str, str], Any] = {
    # class ZeroStageEnum(int, Enum) (runtime/zero/config.py): pickled as ZeroStageEnum(2), or by name.
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): EnumStandIn(_ZERO_STAGES),
    ("builtins", "getattr"): safe_getattr(),
    **allow_records("deepspeed.runtime.fp16.loss_scaler", "LossScaler", "DynamicLossScaler"),
    **allow_records("deepspeed.utils.tensor_fragment", "fragment_address"),
}
"""Globals DeepSpeed's engine pickles beyond torch's tensors, as inert data (see ``OBJECT_GLOBALS``)."""


def _is_tag_dir(path: Path) -> bool:
    return path.is_dir() and any(_ANY_STATES.fullmatch(f.name) for f in path.iterdir())


class DeepSpeedIO(ReadOnlyIO):
    format = Format.DEEPSPEED

    @classmethod
    def detect(cls, path: Path) -> bool:
        if path.is_file():
            # A stage-0 mp_rank_00_model_states.pt is a whole model, read as FULL; with ZeRO files beside it,
            # or ZeRO-3's own name, it is one part of a checkpoint, and read() says which directory to pass.
            m = _MODEL.fullmatch(path.name)
            zero = m is not None and (m.group(1) is not None or any(_OPTIM.fullmatch(f.name)
                                                                    for f in path.parent.iterdir()))
            return zero or _OPTIM.fullmatch(path.name) is not None
        # A save directory: its `latest` names the tag; without one, read() lists the tags to choose from.
        return path.is_dir() and (_is_tag_dir(path) or any(_is_tag_dir(p) for p in path.iterdir()))

    def read(self, path: Path) -> Manifest:
        if path.is_file():
            root = path.parent.parent if (path.parent.parent / _LATEST).is_file() else path.parent
            raise UsageError(f"{path} is one file of a DeepSpeed ZeRO checkpoint, whose weights are spread over the "
                             f"optimizer files of every rank; pass the directory {root}")
        return _read_zero(_tag_dir(path.absolute()))


def read_tag(latest: Path) -> str:
    """The tag directory name a DeepSpeed pointer file (``latest``, ``latest_universal``) holds.

    Args:
        latest: The pointer file.

    Returns:
        The name, stripped.

    Raises:
        FormatError: the file holds something other than one plain directory name.
    """
    tag = latest.read_bytes()[:_MAX_TAG].decode("utf-8", "replace").strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\n" in tag:
        raise FormatError(f"{latest}: expected a tag directory name, found {tag[:80]!r}")
    return tag


def tag_directory(path: Path) -> Path:
    """The tag directory of the DeepSpeed checkpoint at ``path``: itself, or the one its ``latest`` names.

    Raises:
        UsageError: a save directory without ``latest``.
        FormatError: ``latest`` names no directory of ``path``.
        IncompleteCheckpointError: the tag it names holds no DeepSpeed files.
    """
    return _tag_dir(path)


def _tag_dir(path: Path) -> Path:
    """The tag directory: ``path`` itself, or the one its ``latest`` file names."""
    if _is_tag_dir(path):
        return path
    latest = path / _LATEST
    if not latest.is_file():
        tags = sorted(p.name for p in path.iterdir() if _is_tag_dir(p))
        raise UsageError(f"{path}: no '{_LATEST}' file names the tag to read; pass one of its tag directories "
                         f"({', '.join(tags)})")
    tag = read_tag(latest)
    if not _is_tag_dir(path / tag):
        raise IncompleteCheckpointError(f"{latest}: names tag {tag!r}, but {path / tag} holds no DeepSpeed "
                                        "*_model_states.pt or *_optim_states.pt files")
    return path / tag


# --------------------------------------------------------------------------------------------------------
# Files


def _files(tag: Path) -> ZeroFiles:
    """The tag directory's model and optimizer files in rank order; refuses layouts zero_to_fp32 cannot merge."""
    names = sorted(f.name for f in tag.iterdir())
    for sub, what in (("offloaded_tensors", "parameters offloaded to NVMe (ZeRO-Infinity)"),
                      ("zero", "a universal checkpoint (ds_to_universal output)")):
        if (tag / sub).is_dir():
            raise FormatError(f"{tag}: holds {sub}/, {what}; ckptkit reads ZeRO checkpoints whose partitions are "
                              "in the *_optim_states.pt files")
    refusals = [(_PIPELINE, "pipeline-parallel layer files"), (_MOE, "mixture-of-experts files")]
    for rx, what in refusals:
        found = [n for n in names if rx.fullmatch(n)]
        if found:
            raise FormatError(f"{tag}: holds {what} ({', '.join(found[:3])}); ckptkit reads data-parallel ZeRO "
                              "checkpoints only, as zero_to_fp32 does")
    models = {n: m for n in names if (m := _MODEL.fullmatch(n))}
    optims = {n: m for n in names if (m := _OPTIM.fullmatch(n))}
    tp = sorted(n for n, m in {**models, **optims}.items() if int(m.groups()[-1]) != 0)
    if tp:
        raise FormatError(f"{tag}: holds files of model-parallel ranks other than 00 ({', '.join(tp[:3])}): a "
                          "tensor-parallel checkpoint, which ckptkit does not merge")
    zero3 = {int(m.group(1)): tag / n for n, m in models.items() if m.group(1) is not None}
    plain = [tag / n for n, m in models.items() if m.group(1) is None]
    if zero3 and plain:
        raise FormatError(f"{tag}: holds both mp_rank_00_model_states.pt and ZeRO-3 zero_pp_rank_*_model_states.pt "
                          "files; one tag holds one checkpoint")
    if not zero3 and not plain:
        raise IncompleteCheckpointError(f"{tag}: no *_model_states.pt file (found {', '.join(names[:8])})")
    by_rank = {int(m.group(1)): tag / n for n, m in optims.items()}
    if len(by_rank) != len(optims):
        raise FormatError(f"{tag}: two optimizer files per rank ({', '.join(sorted(optims))}); are bf16_ and plain "
                          "files of two runs mixed?")
    if not by_rank:
        if zero3:
            raise IncompleteCheckpointError(
                f"{tag}: ZeRO-3 model files without their *_optim_states.pt files; the model files hold 0-element "
                "placeholders for the partitioned parameters, whose values are in the missing optimizer files")
        raise IncompleteCheckpointError(
            f"{tag}: no *_optim_states.pt files; the fp32 weights of a ZeRO checkpoint are in them (a stage-0 "
            f"checkpoint keeps the whole model in {plain[0].name}: pass that file)")
    optim_files = _in_rank_order(by_rank, tag, "*_optim_states.pt")
    model_files = _in_rank_order(zero3, tag, "zero_pp_rank_*_model_states.pt") if zero3 else plain
    if zero3 and len(model_files) != len(optim_files):
        raise IncompleteCheckpointError(f"{tag}: {len(model_files)} ZeRO-3 model files but {len(optim_files)} "
                                        "optimizer files; every data-parallel rank saves one of each")
    return ZeroFiles(model_files, optim_files, bool(zero3))


def _in_rank_order(by_rank: dict[int, Path], tag: Path, pattern: str) -> list[Path]:
    missing = sorted(set(range(max(by_rank) + 1)) - set(by_rank))
    if missing:
        raise IncompleteCheckpointError(f"{tag}: {pattern} of ranks {missing} are missing (found {len(by_rank)} files "
                                        f"up to rank {max(by_rank)})")
    return [by_rank[r] for r in range(len(by_rank))]


def _load(file: Path) -> dict:
    tree = read_archive(str(file), extra_globals=_GLOBALS)
    if not isinstance(tree, dict):
        raise FormatError(f"{file}: expected a dict, found {type(tree).__name__}")
    return tree


# --------------------------------------------------------------------------------------------------------
# Reading


def _read_zero(tag: Path) -> Manifest:
    """The manifest of the ZeRO checkpoint in tag directory ``tag`` (see the module docstring)."""
    try:
        files = _files(tag)
        return zero_manifest(tag, files, [_load(f) for f in files.models], [_load(f) for f in files.optims])
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        # Every structure read is checked on its way in; this catches the combination no check foresaw.
        raise FormatError(f"{tag}: malformed DeepSpeed checkpoint ({type(e).__name__}: {e})") from e


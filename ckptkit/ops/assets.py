"""The files an HF export carries from ``--hf-assets``: everything of the model directory but its weights.

A Hugging Face model directory holds more than ``config.json`` and the tokenizer: sentence-transformers'
``modules.json``, ``sentence_bert_config.json``, ``config_sentence_transformers.json`` and ``1_Pooling/``,
generation configs, chat templates, custom modeling code, the model card. Which of them a consumer needs is
the consumer's business, so every file and folder is carried, except what would misdescribe the export or
does not belong in a model: weight files (the export writes its own), the training state beside them,
caches, version-control and other hidden files. What is left out is listed, with why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

__all__ = ["Assets", "MAX_ASSET", "find_assets"]

MAX_ASSET = 256 << 20
"""The largest file carried: configs, tokenizers and model cards are far smaller; a larger one is left out."""
_MAX_FILES = 2000
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".onnx", ".onnx_data", ".gguf", ".h5",
            ".msgpack", ".tflite", ".ot", ".npz")
"""Suffixes of weight files: torch, safetensors and DCP's, and the ONNX, GGUF, TensorFlow, Flax, TFLite and
rust-bert exports a Hub repository may carry beside them."""
_TRAINING_STATE = re.compile(r"trainer_state\.json|latest|latest_checkpointed_iteration\.txt|zero_to_fp32\.py|"
                             r"ckptkit\.json")
"""Files of a training run: HF Trainer's and DeepSpeed's progress, Megatron's pointer, ckptkit's checksums of
the weights (which the export does not hold)."""
_TRAINING_DIRS = re.compile(r"global_step\d+|checkpoint-\d+|step-\d+|__pycache__")


@dataclass(frozen=True, slots=True)
class Assets:
    """The files of an assets directory to carry, and those left out."""

    files: tuple[tuple[str, Path], ...]
    """(path relative to the directory, with ``/``; the file) of each file carried, in name order."""
    left_out: tuple[tuple[str, str], ...]
    """(relative path, why) of each file or folder left out; a folder ends in ``/``."""

    def note(self) -> str | None:
        """The report's line on what was left out, or None."""
        if not self.left_out:
            return None
        return "left out of --hf-assets: " + ", ".join(f"{name} ({why})" for name, why in self.left_out)


def _why_not(name: str, is_dir: bool) -> str | None:
    """Why the entry ``name`` is not carried, or None when it is."""
    if name.startswith("."):
        return "hidden: version control, caches, ckptkit's markers"
    if is_dir:
        return "training state or a cache" if _TRAINING_DIRS.fullmatch(name) else None
    stem = name.removesuffix(".index.json")
    if Path(stem).suffix.lower() in _WEIGHTS:
        return "weights" if stem == name else "index of weights"
    if _TRAINING_STATE.fullmatch(name) or name.endswith(".pyc"):
        return "training state or a cache"
    return None


def find_assets(directory: Path) -> Assets:
    """The files of the model directory ``directory`` (local, or a URL's :class:`RemotePath`) to carry into an
    HF export, and those left out. Links to files are read through (the Hugging Face cache's snapshots are
    links into its blobs); links to folders are not followed.

    Args:
        directory: the ``--hf-assets`` directory; it must hold ``config.json``.

    Returns:
        The files to carry and what is left out, each with its path relative to ``directory``.

    Raises:
        UsageError: no ``config.json`` there, or more files than a model directory has.
    """
    if not (directory / "config.json").is_file():
        raise UsageError(f"--hf-assets {directory}: no config.json there; expected a Hugging Face model directory")
    files: list[tuple[str, Path]] = []
    left_out: list[tuple[str, str]] = []
    pending = [(directory, "")]
    while pending:
        folder, prefix = pending.pop()
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            rel, is_dir = prefix + entry.name, entry.is_dir()
            why = _why_not(entry.name, is_dir)
            if why is None and is_dir and entry.is_symlink():
                why = "a link to a folder, not followed"
            if why is None and not is_dir and entry.is_file() and entry.stat().st_size > MAX_ASSET:
                why = f"{entry.stat().st_size} bytes, more than a config or tokenizer file holds"
            if why is not None:
                left_out.append((rel + "/" * is_dir, why))
            elif is_dir:
                pending.append((entry, rel + "/"))
            elif entry.is_file():
                files.append((rel, entry))
            if len(files) > _MAX_FILES:
                raise UsageError(f"--hf-assets {directory}: more than {_MAX_FILES} files; expected a Hugging Face "
                                 "model directory")
    return Assets(tuple(sorted(files)), tuple(sorted(left_out)))

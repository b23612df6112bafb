"""What a checkpoint says of its model, read once per command: its config and its Megatron run's arguments.

The config (:class:`ModelConfig`) is the first of: ``--hf-assets``'s ``config.json``; the source's own (an HF
directory's); the model's counts from a Megatron run's arguments (megatron-core's ``common.pt`` or 0.19's
``common_state``, a Megatron-LM legacy checkpoint's rank files) or from NeMo 2's ``context/model.yaml``, under HF's
field names; Meta's ``params.json`` beside a ``consolidated.00.pth`` or in its directory. The run's arguments
(:class:`ckptkit.models.megatron_args.RunArgs`) are the ``args`` the checkpoint's reader already holds (so
``common.pt`` is not read again), else NeMo 2's ``model.yaml`` (megatron-core's ``TransformerConfig`` fields under
Megatron-LM's names), with ``--megatron-args`` over them. Files are read for a local source only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.manifest import Manifest
from ..errors import FormatError
from ..formats.megatron import (
    COMMON,
    COMMON_STATE,
    COMMON_STATE_KEY,
    CONTEXT,
    MODEL_YAML,
    hf_fields,
    nemo2_root,
    read_model_yaml,
)
from .hfconfig import tie_word_embeddings
from .mapping import read_json
from .megatron_args import RunArgs
from .shape import ModelShape, model_shape

__all__ = ["Evidence", "ModelConfig", "read_evidence", "read_model_config"]


@dataclass(frozen=True)
class ModelConfig:
    """A model's config, parsed: an HF ``config.json``, Meta's ``params.json``, or one made of a run's counts."""

    path: Path
    data: dict

    @property
    def is_hf(self) -> bool:
        return self.path.name != "params.json"

    def shape(self) -> ModelShape:
        """Head counts, layers and weight tying for a key-mapping preset."""
        tied = tie_word_embeddings(self.data)[0] if self.is_hf else None
        return model_shape(self.data, str(self.path), tied)


@dataclass(frozen=True)
class Evidence:
    """What a checkpoint says of its model (see the module docstring)."""

    keys: tuple[str, ...]
    """The model part's tensor names."""
    config: ModelConfig | None = None
    args: RunArgs | None = None
    """The Megatron run's arguments (the checkpoint's, with ``--megatron-args`` over them), or None."""
    model_parallel: tuple[str, ...] = ()
    """Meta's ``consolidated.NN.pth`` files beside the one read: the model-parallel ranks of one checkpoint."""
    source: str = ""
    """The checkpoint read, for messages."""

    @property
    def model_type(self) -> str | None:
        """``config.json``'s ``model_type``, where there is one."""
        named = self.config.data.get("model_type") if self.config is not None and self.config.is_hf else None
        return named if isinstance(named, str) else None

    @property
    def where(self) -> str:
        """Where the config was read, for messages."""
        return str(self.config.path) if self.config is not None else "config.json"

    @property
    def hf_config(self) -> dict | None:
        """A ``config.json`` file's fields, where one was read (not a config made of a run's counts)."""
        return self.config.data if self.config is not None and self.config.path.name == "config.json" else None


def read_model_config(path: Path) -> dict:
    """An HF ``config.json`` or Meta ``params.json`` as a dict.

    Raises:
        UsageError, FormatError: the file cannot be read as JSON, or holds no JSON object.
    """
    data = read_json(path, "config")
    if not isinstance(data, dict):
        raise FormatError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


_CONSOLIDATED = re.compile(r"consolidated\.(\d+)\.pth")


def read_evidence(src: Path | Any, keys: Sequence[str], manifest: Manifest | None = None,
                  hf_assets: Path | str | None = None, given: Mapping[str, Any] | None = None,
                  config: bool = True) -> Evidence:
    """What the checkpoint at ``src`` (read as ``manifest``, its model part named ``keys``) says of its model.

    Args:
        src: the checkpoint read (a local path; any other location's files are not read).
        keys: its model part's tensor names.
        manifest: what its reader read, whose ``args`` are the run's.
        hf_assets: an HF model directory whose ``config.json`` comes first.
        given: ``--megatron-args``, over the checkpoint's own.
        config: whether to read the config (a mapping without a preset asks for none).

    Returns:
        The evidence.

    Raises:
        FormatError, UsageError: a config that cannot be read.
    """
    local = src if isinstance(src, Path) else None
    own = _run_args(local, manifest)
    found = _config(local, hf_assets, own) if local is not None and config else None
    args = own[0] if own is not None else None
    if given:
        values = {**(args.values if args else {}), **given}
        args = RunArgs(values, f"{args.source} and --megatron-args" if args else "--megatron-args")
    parallel: tuple[str, ...] = ()
    if local is not None and _CONSOLIDATED.fullmatch(local.name):
        parallel = tuple(sorted(f.name for f in local.parent.iterdir() if _CONSOLIDATED.fullmatch(f.name)))
    return Evidence(tuple(keys), found, args, parallel, str(src))


def _config(src: Path, hf_assets: Path | str | None, own: tuple[RunArgs, Path] | None) -> ModelConfig | None:
    home = src if src.is_dir() else src.parent
    candidates = [Path(hf_assets) / "config.json"] if hf_assets is not None else []
    candidates += [src / "config.json"] if src.is_dir() else []
    path = next((c for c in candidates if c.is_file()), None)
    if path is not None:
        return ModelConfig(path, read_model_config(path))
    if own is not None and (own[1].name == MODEL_YAML or "num_attention_heads" in own[0].values):
        return ModelConfig(own[1], hf_fields(own[0].values))  # the run's counts, under HF's names
    params = home / "params.json"
    return ModelConfig(params, read_model_config(params)) if params.is_file() else None


def _run_args(src: Path | None, manifest: Manifest | None) -> tuple[RunArgs, Path] | None:
    """Megatron-LM's ``args`` among the checkpoint's entries, else NeMo 2's ``model.yaml`` above its ``weights/``;
    and the file they were read from."""
    entry = next((o for o in (manifest.objects if manifest is not None else ()) if o.path == ("args",)), None)
    if entry is not None and hasattr(entry.value, "__dict__") and hasattr(entry.value, "num_layers"):
        root = src if src is not None else Path(manifest.root if manifest is not None else "")
        if entry.sidecar == COMMON:
            where, path = str(root / COMMON), root / COMMON
        elif entry.sidecar == COMMON_STATE:  # megatron-core 0.19: an object in the DCP files
            where, path = f"{root}'s {COMMON_STATE_KEY}", root / COMMON_STATE
        else:  # Megatron-LM's legacy rank files
            where, path = str(root), root
        return RunArgs(dict(vars(entry.value)), f"{where}'s args"), path
    if src is not None and src.is_dir() and (home := nemo2_root(src)) is not None:
        config, path = read_model_yaml(home), home / CONTEXT / MODEL_YAML
        if config is not None:
            return RunArgs(_from_transformer_config(config), str(path)), path
    return None


# megatron-core's TransformerConfig (NeMo 2's model.yaml) -> Megatron-LM's argument of the same meaning.
_CONFIG_NAMES = {
    "layernorm_epsilon": "norm_epsilon", "seq_length": "max_position_embeddings", "num_moe_experts": "num_experts",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p", "rope_scaling": "use_rope_scaling",
    "bias_activation_fusion": "bias_gelu_fusion",  # a GELU MLP's: the fused kernel is the tanh approximation
}


def _target(value: Any) -> str:
    """The name NeMo's YAML gives a class, function or dtype (``{_target_: torch.bfloat16}``), else the value's."""
    return str(value.get("_target_", "")) if isinstance(value, dict) else str(getattr(value, "name", value))


def _from_transformer_config(config: dict) -> dict[str, Any]:
    """NeMo 2's ``TransformerConfig`` fields as Megatron-LM's arguments."""
    out = {_CONFIG_NAMES.get(k, k): v for k, v in config.items() if not k.startswith("_")}
    activation = _target(config.get("activation_func")).rpartition(".")[2]
    if "gated_linear_unit" in config:
        out["swiglu"] = bool(config["gated_linear_unit"]) and activation == "silu"
        out["squared_relu"] = activation == "squared_relu"
        out["quick_geglu"] = bool(config["gated_linear_unit"]) and activation == "quick_gelu"
    if "share_embeddings_and_output_weights" in config:
        out["untie_embeddings_and_output_weights"] = not config["share_embeddings_and_output_weights"]
    groups = config.get("num_query_groups")
    out["group_query_attention"] = groups is not None and groups != config.get("num_attention_heads")
    if "params_dtype" in config:
        out["params_dtype"] = _target(config["params_dtype"]).rpartition(".")[2]
    return out

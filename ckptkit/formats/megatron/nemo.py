"""NeMo 2 checkpoint directories: megatron-core's ``torch_dist`` files under ``weights/``, the run's
configuration under ``context/``.

NeMo 2 saves a model as a directory holding ``weights/`` (written by megatron-core's ``dist_checkpointing``,
its keys prefixed ``module.``) and ``context/``: ``io.json`` (the serialized object graph NeMo rebuilds the
run from) and ``model.yaml``, a YAML dump of the model whose ``config`` holds megatron-core's
``TransformerConfig`` fields under their own names (``num_layers``, ``num_query_groups``,
``layernorm_epsilon``...; a class or a dtype as ``{_target_: torch.bfloat16, _call_: false}``). ckptkit reads
the top directory as its ``weights/`` checkpoint, and ``model.yaml``'s ``config`` for the model's sizes;
``io.json`` is not read.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import FormatError

__all__ = ["CONTEXT", "MODEL_YAML", "WEIGHTS", "nemo2_root", "nemo2_weights", "read_model_yaml"]

WEIGHTS, CONTEXT, MODEL_YAML = "weights", "context", "model.yaml"
_MAX_YAML = 16 << 20


def nemo2_weights(path: Path) -> Path | None:
    """``path/weights`` when ``path`` is a NeMo 2 checkpoint's top directory (``context/`` beside ``weights/``);
    else None."""
    try:
        if path.is_dir() and (path / CONTEXT).is_dir() and (path / WEIGHTS).is_dir():
            return path / WEIGHTS
    except OSError:
        return None
    return None


def nemo2_root(weights: Path) -> Path | None:
    """The top directory of the NeMo 2 checkpoint whose ``weights/`` is ``weights``; None when it is not one."""
    return weights.parent if weights.name == WEIGHTS and nemo2_weights(weights.parent) is not None else None


def read_model_yaml(root: Path) -> dict | None:
    """``root/context/model.yaml``'s ``config`` (megatron-core's ``TransformerConfig`` fields by name); None where
    there is no such file.

    Raises:
        FormatError: the file is not YAML, too large, or holds no ``config`` mapping.
    """
    path = root / CONTEXT / MODEL_YAML
    if not path.is_file():
        return None
    import yaml  # PyYAML: only NeMo 2's context needs it

    try:
        if path.stat().st_size > _MAX_YAML:
            raise ValueError(f"{path.stat().st_size} bytes")
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise FormatError(f"{path}: not NeMo 2's model YAML ({str(e).splitlines()[0] if str(e) else e!r})") from None
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: expected NeMo 2's model YAML with a 'config' mapping (the model's "
                          f"TransformerConfig), found {type(config if isinstance(data, dict) else data).__name__}")
    return config

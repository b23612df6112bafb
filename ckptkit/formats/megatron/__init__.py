"""Megatron: megatron-core's ``torch_dist`` checkpoints, Megatron-LM's legacy rank files and NeMo 2's directories.

One idea a module: :mod:`.torch_dist` (``metadata.json`` and ``common.pt`` beside a DCP directory, read and
written), :mod:`.legacy` (Megatron-LM's ``mp_rank_*`` files, read as one model), :mod:`.nemo` (NeMo 2's
``weights/`` and ``context/``), :mod:`.distopt` (the ``DistributedOptimizer``'s buckets as per-parameter
state), :mod:`.distopt_join` (per-parameter state joined into those buckets) and :mod:`.groups` (the param
groups megatron-core's rule makes of each parameter's hyperparameters). The names other packages use
are the ones exported here.
"""

from __future__ import annotations

from .distopt import SECTION, aligned, has_buckets, split_buckets
from .distopt_join import join_buckets
from .legacy import FILE, TRACKER, MegatronLegacyIO, legacy_args
from .nemo import CONTEXT, MODEL_YAML, WEIGHTS, nemo2_root, nemo2_weights, read_model_yaml
from .torch_dist import (
    COMMON,
    COMMON_STATE,
    COMMON_STATE_KEY,
    CONFIG,
    CONFIG_BYTES,
    PLAN_GLOBALS,
    common_parts,
    config_bytes,
    config_of_args,
    extra_states,
    hf_fields,
    in_dcp,
    is_megatron,
    read_common,
    read_config,
)

__all__ = ["COMMON", "COMMON_STATE", "COMMON_STATE_KEY", "CONFIG", "CONFIG_BYTES", "CONTEXT", "FILE", "MODEL_YAML",
           "PLAN_GLOBALS", "SECTION", "TRACKER", "WEIGHTS", "MegatronLegacyIO", "aligned", "common_parts",
           "config_bytes", "config_of_args", "extra_states", "has_buckets", "hf_fields", "in_dcp", "is_megatron",
           "join_buckets", "legacy_args", "nemo2_root", "nemo2_weights", "read_common", "read_config",
           "read_model_yaml", "split_buckets"]

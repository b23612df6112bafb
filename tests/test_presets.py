"""ckptkit.models.registry: the name tables, the rotary row gather against torch's own reshapes, and head counts read
from HF ``config.json`` and Meta ``params.json`` dicts. Pure: no files."""

from __future__ import annotations

import pytest
import torch

from ckptkit.errors import UsageError
from ckptkit.models.preset import rotary_rows
from ckptkit.models.registry import PRESETS, preset
from ckptkit.models.shape import ModelShape, model_shape


def interleaved_to_hf(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF's rotate_half layout from the interleaved one, by reshapes: per head, view the rows as (pairs, 2) and
    take first every pair's first element, then every pair's second (transformers' converter does this)."""
    n = w.shape[0] // head_dim
    return w.reshape(n, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads, head_dim, width", [
    (4, 16, 64),     # the tests' tiny Llama
    (32, 128, 7),    # Llama 3 8B's q rows, a few columns
    (8, 128, 3),     # its k rows
    (3, 6, 5),       # odd head count, head_dim not a power of two
    (1, 2, 1),       # the smallest head
])
def test_rotary_rows_equal_the_reshape_and_invert_each_other(n_heads, head_dim, width):
    w = torch.randn(n_heads * head_dim, width, generator=torch.Generator().manual_seed(0))
    to_hf = rotary_rows(len(w), head_dim, to_hf=True)
    back = rotary_rows(len(w), head_dim, to_hf=False)
    assert torch.equal(w[list(to_hf)], interleaved_to_hf(w, head_dim))
    assert torch.equal(w[list(to_hf)][list(back)], w)
    bias = w[:, 0]  # a 1-D q/k bias takes the same gather
    assert torch.equal(bias[list(to_hf)], interleaved_to_hf(bias[:, None], head_dim)[:, 0])


def test_rotary_rows_of_one_head_spelled_out():
    # Head of 8: HF's first half is the even dimensions, its second half the odd ones.
    assert rotary_rows(8, 8, to_hf=True) == (0, 2, 4, 6, 1, 3, 5, 7)
    assert rotary_rows(8, 8, to_hf=False) == (0, 4, 1, 5, 2, 6, 3, 7)


@pytest.mark.parametrize("config, expected", [
    # HF Llama: head_dim from hidden_size / num_attention_heads
    ({"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32},
     ModelShape(128, 32, 8, 32, None, "c")),
    # Mistral-Nemo states a head_dim other than hidden_size / heads
    ({"hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
     ModelShape(128, 32, 8, None, None, "c")),
    # no num_key_value_heads: as many as the query heads (MHA)
    ({"hidden_size": 64, "num_attention_heads": 4}, ModelShape(16, 4, 4, None, None, "c")),
    # a composite model's text_config
    ({"text_config": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}},
     ModelShape(16, 4, 2, None, None, "c")),
    # Meta params.json (Llama 3.1 8B)
    ({"dim": 4096, "n_heads": 32, "n_kv_heads": 8, "n_layers": 32, "norm_eps": 1e-05},
     ModelShape(128, 32, 8, 32, None, "c")),
    # params.json with its fields under "model", n_kv_heads absent
    ({"model": {"dim": 64, "n_heads": 4, "n_layers": 2}}, ModelShape(16, 4, 4, 2, None, "c")),
])
def test_model_shape_from_hf_and_meta_configs(config, expected):
    assert model_shape(config, "c") == expected


@pytest.mark.parametrize("config, message", [
    ({"hidden_size": 64}, r"c: states neither head_dim, or hidden_size and num_attention_heads"),
    ({"dim": 64}, r"c: states neither head_dim, or dim and n_heads"),
    ({"hidden_size": 60, "num_attention_heads": 4}, r"c: head_dim 15 is odd"),
])
def test_model_shape_refuses_what_gives_no_head_dim(config, message):
    with pytest.raises(UsageError, match=message):
        model_shape(config, "c")


@pytest.mark.parametrize("name, said", [
    ("torchtitan-lama", "did you mean torchtitan-llama? 'ckptkit presets' lists every preset"),
    ("megatron-qwen3moe", "did you mean megatron-qwen3-moe? 'ckptkit presets' lists every preset"),
    ("bert", "'ckptkit presets' lists every preset"),  # nothing near enough: no guess
])
def test_preset_misspelt_name_says_the_nearest_and_where_the_list_is(name, said):
    with pytest.raises(UsageError) as e:
        preset(name)
    assert str(e.value) == f"--preset {name!r}: unknown; {said}"


def test_cli_preset_misspelt_is_one_short_line_naming_the_nearest():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ckptkit", "export-hf", "src.pt", "out", "--preset",
                           "torchtitan-lama"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == (
        "ckptkit: error: Invalid value for '--preset': 'torchtitan-lama': unknown; did you mean torchtitan-llama? "
        "'ckptkit presets' lists every preset (see 'ckptkit export-hf --help')\n")


def test_registry_finds_every_family_module_and_derives_detection_from_the_tables():
    """A family is one module in ckptkit/models/families: its presets, and the model_type values that pick them."""
    import pkgutil

    from ckptkit.models import families
    from ckptkit.models.registry import DETECT, FAMILIES, MEGATRON

    modules = {m.name for m in pkgutil.iter_modules(families.__path__) if not m.name.startswith("_")}
    assert {"llama", "qwen3", "deepseek_v3", "gpt_oss"} <= modules and {f.name for f in FAMILIES} == modules
    assert DETECT["qwen3_moe"] == "torchtitan-qwen3-moe" and MEGATRON["llama"] == "megatron-llama"
    assert all(PRESETS[name].other_side == "torchtitan" for name in DETECT.values())


def test_presets_name_every_hf_llama_weight_once():
    hf = {r.hf for r in PRESETS["torchtitan-llama"].rows}
    assert hf == {r.hf for r in PRESETS["meta-llama"].rows} == {r.hf for r in PRESETS["mistral"].rows}
    assert len(hf) == len(PRESETS["torchtitan-llama"].rows) == 12
    qwen = {r.hf for r in PRESETS["qwen2"].rows}
    assert qwen - hf == {f"model.layers.{{n}}.self_attn.{p}_proj.bias" for p in "qkv"}
    assert PRESETS["qwen2"].identity and PRESETS["mistral"].identity
    assert not PRESETS["torchtitan-llama"].identity and PRESETS["meta-llama"].single_file

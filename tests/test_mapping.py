"""ckptkit.models.mapping: key maps, renames and presets applied to hand-built entries. Pure planning: no file is
opened (entries point at a file that does not exist); the transformers round trips are in test_titan.py."""

from __future__ import annotations

import json

import pytest

from ckptkit import Chunk, Span, TensorEntry
from ckptkit.core.dtypes import by_name
from ckptkit.errors import UsageError
from ckptkit.models.mapping import KeyMapping, key_mapping, map_keys, parse_rename
from ckptkit.models.preset import rotary_rows
from ckptkit.models.shape import ModelShape

F32 = by_name("float32")
SHAPE = ModelShape(head_dim=4, n_heads=2, n_kv_heads=1, layers=2, tied=False, source="config.json")


def entry(key: str, shape=(8, 3)) -> TensorEntry:
    n = 1
    for s in shape:
        n *= s
    return TensorEntry(key, (key,), F32, tuple(shape), (Chunk((0,) * len(shape), tuple(shape), Span("f", 0, 4 * n)),))


def titan(layers=2, spelling="0.3", head="lm_head.weight") -> list[TensorEntry]:
    """torchtitan's Llama names (0.3 or 0.2 spelling), dim 8, 2 heads and 1 kv head of head_dim 4."""
    attn = "attention.qkv_linear." if spelling == "0.3" else "attention."
    out = [entry("tok_embeddings.weight", (16, 8))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [entry(p + attn + "wq.weight", (8, 8)), entry(p + attn + "wk.weight", (4, 8)),
                entry(p + attn + "wv.weight", (4, 8)), entry(p + "attention.wo.weight", (8, 8)),
                entry(p + "feed_forward.w1.weight", (12, 8)), entry(p + "feed_forward.w2.weight", (8, 12)),
                entry(p + "feed_forward.w3.weight", (12, 8)), entry(p + "attention_norm.weight", (8,)),
                entry(p + "ffn_norm.weight", (8,))]
    return out + [entry("norm.weight", (8,)), entry(head, (16, 8))]


def names(mapped) -> dict[str, TensorEntry]:
    return {t.key: t for t in mapped.tensors}


# ------------------------------------------------------------------------------------------ renames, key maps


@pytest.mark.parametrize("text, expected", [
    ("^model\\.=", ("^model\\.", "")),                     # strip a prefix
    ("a=b=c", ("a", "b=c")),                               # the first = splits
    ("x\\=y=z", ("x\\=y", "z")),                           # an escaped = belongs to the expression
    ("w(?=\\.weight)=v", ("w(?=\\.weight)", "v")),         # so does a lookahead's
    ("(?<!a)b=c", ("(?<!a)b", "c")),                       # and a negative lookbehind's
])
def test_parse_rename(text, expected):
    assert parse_rename(text) == expected


def test_parse_rename_without_equals_says_what_is_expected():
    with pytest.raises(UsageError, match=r"--rename 'model': expected REGEX=REPLACEMENT"):
        parse_rename("model")


def test_map_keys_renames_apply_in_order_with_groups():
    mapping = key_mapping(renames=["^net\\.=model.", "\\.attn\\.(\\w)_proj=.self_attn.\\1_proj"])
    mapped = map_keys([entry("net.layer.attn.q_proj.weight"), entry("net.head")], mapping)
    assert [t.key for t in mapped.tensors] == ["model.layer.self_attn.q_proj.weight", "model.head"]
    assert [t.path for t in mapped.tensors] == [("model.layer.self_attn.q_proj.weight",), ("model.head",)]
    assert mapped.renamed == (("net.layer.attn.q_proj.weight", "model.layer.self_attn.q_proj.weight"),
                              ("net.head", "model.head"))
    assert mapped.notes == ("--rename '^net\\.=model.' matched 2 keys",
                            "--rename '\\.attn\\.(\\w)_proj=.self_attn.\\1_proj' matched 1 keys")


def test_map_keys_key_map_renames_and_drops_before_renames():
    mapping = key_mapping(key_map={"a": "b", "ema": None}, renames=["^b$=c"])
    mapped = map_keys([entry("a"), entry("ema"), entry("z")], mapping)
    assert [t.key for t in mapped.tensors] == ["c", "z"]
    assert mapped.dropped == (("ema", "--key-map"),)


def test_key_map_file_is_read_and_checked(tmp_path):
    (tmp_path / "map.json").write_text(json.dumps({"a": "b", "c": None}))
    assert key_mapping(key_map=tmp_path / "map.json").key_map == (("a", "b"), ("c", None))
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(UsageError, match=rf"--key-map {tmp_path / 'bad.json'}: expected a JSON object of old key"):
        key_mapping(key_map=tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(UsageError, match=rf"--key-map {tmp_path / 'junk.json'}: cannot read it as JSON"):
        key_mapping(key_map=tmp_path / "junk.json")


def test_map_keys_collision_names_both_keys():
    with pytest.raises(UsageError, match=r"keys 'a.w' and 'b.w' would both be named 'w'"):
        map_keys([entry("a.w"), entry("b.w")], key_mapping(renames=["^[ab]\\.="]))
    with pytest.raises(UsageError, match=r"keys 'w' and 'x' would both be named 'w'"):  # onto a key left as it was
        map_keys([entry("w"), entry("x")], key_mapping(key_map={"x": "w"}))


def test_map_keys_strict_lists_what_nothing_mapped():
    mapping = key_mapping(renames=["^model\\.="], strict=True)
    assert [t.key for t in map_keys([entry("model.a")], mapping).tensors] == ["a"]
    with pytest.raises(UsageError, match=r"--strict-map: 2 keys left unmapped: 'other', 'more'"):
        map_keys([entry("model.a"), entry("other"), entry("more")], mapping)
    with pytest.raises(UsageError, match=r"--key-map names keys the model does not have: 'gone'"):
        map_keys([entry("a")], key_mapping(key_map={"a": "b", "gone": "c"}, strict=True))


@pytest.mark.parametrize("renames, message", [
    (["(=x"], r"--rename '\(': not a regular expression"),
    (["a=\\2"], r"--rename 'a=\\2': bad replacement"),
])
def test_map_keys_bad_rename_is_a_usage_error(renames, message):
    with pytest.raises(UsageError, match=message):
        map_keys([entry("a")], key_mapping(renames=renames))


def test_map_keys_refuses_an_empty_name():
    with pytest.raises(UsageError, match=r"key 'model\.' would be renamed to an empty name"):
        map_keys([entry("model.")], key_mapping(renames=["^model\\.="]))


# ------------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("spelling, head", [("0.3", "lm_head.weight"), ("0.2", "output.weight")])
def test_torchtitan_llama_to_hf_reads_both_spellings(spelling, head):
    mapped = map_keys(titan(spelling=spelling, head=head), KeyMapping(preset="torchtitan-llama"), shape=SHAPE,
                      to_hf=True)
    got = names(mapped)
    assert set(got) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                        *(f"model.layers.{i}.{n}.weight" for i in range(2) for n in (
                            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                            "post_attention_layernorm"))}
    # w1 is the gate, w3 the up projection, w2 the down projection
    assert got["model.layers.1.mlp.up_proj.weight"].chunks == entry("x", (12, 8)).chunks
    assert ("layers.1.feed_forward.w3.weight", "model.layers.1.mlp.up_proj.weight") in mapped.renamed
    assert got["model.layers.0.self_attn.q_proj.weight"].rows == rotary_rows(8, 4, True)
    assert got["model.layers.0.self_attn.k_proj.weight"].rows == rotary_rows(4, 4, True)
    assert got["model.layers.0.self_attn.v_proj.weight"].rows is None
    assert set(mapped.permuted) == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qk"}
    assert mapped.notes == ("--preset torchtitan-llama: 21 keys mapped, torchtitan names -> HF names",
                            "q/k rows of 4 tensors reordered from torchtitan's rotary layout to HF's (head_dim 4, "
                            "from config.json)")


def test_torchtitan_llama_from_hf_writes_the_current_names_and_inverts_the_rows():
    hf = map_keys(titan(), KeyMapping(preset="torchtitan-llama"), shape=SHAPE, to_hf=True).tensors
    back = names(map_keys(hf, KeyMapping(preset="torchtitan-llama"), shape=SHAPE))
    assert set(back) == {t.key for t in titan()}
    q = back["layers.0.attention.qkv_linear.wq.weight"]
    assert q.rows == tuple(range(8))  # the two gathers compose to the identity


def test_meta_llama_names_and_dropped_buffers():
    meta = titan(spelling="0.2", head="output.weight") + [entry("rope.freqs", (4,))]
    mapped = map_keys(meta, KeyMapping(preset="meta-llama"), shape=SHAPE, to_hf=True)
    assert "lm_head.weight" in names(mapped) and mapped.dropped == (("rope.freqs", "not a weight (meta-llama)"),)
    with pytest.raises(UsageError, match=r"--preset meta-llama: 4 keys are not Meta names it knows: "
                                         r"'layers.0.attention.qkv_linear.wq.weight', "):
        map_keys(titan(layers=1), KeyMapping(preset="meta-llama"), shape=SHAPE, to_hf=True)


def test_preset_from_hf_writes_a_tied_head_from_the_embedding():
    hf = [t for t in map_keys(titan(), KeyMapping(preset="torchtitan-llama"), shape=SHAPE, to_hf=True).tensors
          if t.key != "lm_head.weight"]
    tied = ModelShape(4, 2, 1, 2, True, "config.json")
    back = map_keys(hf, KeyMapping(preset="torchtitan-llama"), shape=tied)
    got = names(back)
    assert got["lm_head.weight"].chunks == got["tok_embeddings.weight"].chunks
    assert "lm_head.weight written from model.embed_tokens.weight: config.json ties them, and torchtitan keeps both" \
        in back.notes
    with pytest.raises(UsageError, match=r"the checkpoint lacks 1 keys of the model \(2 layers, from config.json\): "
                                         r"'model.layers.1.mlp.down_proj.weight'"):
        map_keys([t for t in hf if t.key != "model.layers.1.mlp.down_proj.weight"],
                 KeyMapping(preset="torchtitan-llama"), shape=tied)
    with pytest.raises(UsageError, match=r"lacks 1 keys .*: 'lm_head.weight'"):  # untied: the head must be there
        map_keys(hf, KeyMapping(preset="torchtitan-llama"), shape=SHAPE)


@pytest.mark.parametrize("tensors, shape, message", [
    # HF names given to an export towards HF
    ([entry("model.embed_tokens.weight")], SHAPE, r"the keys are Hugging Face names already \(e.g. "
                                                  r"'model.embed_tokens.weight'\)"),
    # towards HF, an HF name is one the preset does not know
    ([entry("model.embed_tokens.weight"), entry("norm.weight")], SHAPE,
     r"1 keys are not torchtitan names it knows: 'model.embed_tokens.weight'"),
    # a fused wqkv of a 2026 development snapshot is not in the table
    (titan(layers=1) + [entry("layers.0.attention.qkv_linear.wqkv.weight", (16, 8))], SHAPE,
     r"1 keys are not torchtitan names it knows: 'layers.0.attention.qkv_linear.wqkv.weight'"),
    # a third layer where the config says two
    (titan(layers=3), SHAPE, r"config.json gives 2 layers, but the checkpoint has more: "
                             r"'layers.2.attention.attention_norm.weight'|config.json gives 2 layers"),
    # q rows that are not num_attention_heads x head_dim
    (titan(), ModelShape(4, 3, 1, 2, False, "cfg"),
     r"'layers.0.attention.qkv_linear.wq.weight' has 8 rows, but cfg gives num_attention_heads 3 x head_dim 4 = 12"),
    # no config: no head_dim
    (titan(), None, r"--preset torchtitan-llama needs the model's head_dim for the rotary q/k row order: pass "
                    r"--hf-assets DIR"),
])
def test_preset_refusals(tensors, shape, message):
    with pytest.raises(UsageError, match=message):
        map_keys(tensors, KeyMapping(preset="torchtitan-llama"), shape=shape, to_hf=True)


def test_preset_direction_from_mixed_names_is_refused():
    with pytest.raises(UsageError, match=r"the keys mix Hugging Face names \('model.embed_tokens.weight'\) and "
                                         r"torchtitan names \('norm.weight'\)"):
        map_keys([entry("model.embed_tokens.weight"), entry("norm.weight")], KeyMapping(preset="torchtitan-llama"),
                 shape=SHAPE)


def test_identity_preset_checks_names_and_biases():
    hf = list(map_keys(titan(), KeyMapping(preset="torchtitan-llama"), shape=SHAPE, to_hf=True).tensors)
    mapped = map_keys(hf, KeyMapping(preset="mistral"), shape=SHAPE, to_hf=True)
    assert mapped.renamed == () and mapped.permuted == ()
    assert mapped.notes == ("--preset mistral: 21 keys checked against its table",)
    with pytest.raises(UsageError, match=r"--preset qwen2: the checkpoint lacks 6 keys .*'model.layers.0.self_attn."
                                         r"q_proj.bias'"):
        map_keys(hf, KeyMapping(preset="qwen2"), shape=SHAPE)
    with pytest.raises(UsageError, match=r"--preset mistral: 1 keys are not Mistral names it knows: 'extra'"):
        map_keys([*hf, entry("extra")], KeyMapping(preset="mistral"))


def test_preset_after_renames_composes_an_existing_gather():
    # A rename brings foreign names to torchtitan's; a gather already on the entry composes with the preset's.
    tensors = [t if "wq" not in t.key else TensorEntry(t.key, t.path, t.dtype, t.shape, t.chunks,
                                                       rows=tuple(reversed(range(8)))) for t in titan()]
    tensors = [TensorEntry("net." + t.key, ("net." + t.key,), t.dtype, t.shape, t.chunks, rows=t.rows)
               for t in tensors]
    mapped = names(map_keys(tensors, key_mapping(renames=["^net\\.="], preset="torchtitan-llama"), shape=SHAPE,
                            to_hf=True))
    order = rotary_rows(8, 4, True)
    assert mapped["model.layers.0.self_attn.q_proj.weight"].rows == tuple(7 - r for r in order)


def test_convert_under_a_rename_carries_named_optimizer_state_and_refuses_state_kept_by_index(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckptkit

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    net(torch.ones(2, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "named"))
    ckptkit.convert(tmp_path / "named", tmp_path / "out", to="sharded", renames=[r"^0\.=first.", r"^1\.=second."])
    target = {f"optim.state.{n}.{slot}": torch.zeros_like(v) for k, state in osd["state"].items()
              for n in [k.replace("0.", "first.", 1).replace("1.", "second.", 1)] for slot, v in state.items()}
    target["optim.param_groups.0.params"] = []
    dcp.load(target, checkpoint_id=str(tmp_path / "out"))
    assert torch.equal(target["optim.state.first.weight.exp_avg"], osd["state"]["0.weight"]["exp_avg"])
    assert target["optim.param_groups.0.params"] == ["first.weight", "first.bias", "second.weight", "second.bias"]

    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "by_index.pt")
    with pytest.raises(UsageError, match=r"by_index\.pt: optimizer state 'optimizer\.state\.0', .* names no "
                                         r"parameter the model's weights are saved as \(e\.g\. '0\.weight'\)"):
        ckptkit.convert(tmp_path / "by_index.pt", tmp_path / "out2", to="sharded", renames=[r"^0\.=first."])

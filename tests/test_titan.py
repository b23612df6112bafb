"""The ``torchtitan-llama`` preset proven both ways through transformers, with identical logits.

The oracles:
- ``LlamaForCausalLM`` itself: a random tiny Llama's logits and state dict.
- A re-implementation of torchtitan's Llama 3 forward (interleaved complex rotary embeddings, RMSNorm, SwiGLU,
  causal GQA attention), written here from the model's math. It proves that the torchtitan checkpoint the test
  builds (names and q/k rows laid out by torch reshapes, independently of ckptkit) is the same model: its logits
  match transformers' to float32 rounding, and without the row reorder they do not.
- torch's DCP: the torchtitan checkpoint is written by ``dcp.save`` from 2 gloo ranks holding ``Shard(0)``
  DTensors, beside optimizer, scheduler, dataloader and train state as torchtitan's CheckpointManager keeps them;
  what ckptkit writes for torchtitan is read back by ``dcp.load`` into torchtitan-shaped tensors.

Then ckptkit's export of the torchtitan checkpoint loads in transformers with the original model's weights bit
for bit, hence logits ``torch.equal`` to the original's; and ckptkit's conversion of the HF model to a
torchtitan-named DCP at 2 ranks holds the torchtitan checkpoint bit for bit, and round-trips to HF bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from _checks import assert_same_tree, assert_tensor_identical, load_hf
from ckptkit.cli import cli
from ckptkit.harness.launch import run_ranks

DIM, HEADS, KV_HEADS, LAYERS, VOCAB, FFN, EPS, THETA = 64, 4, 2, 2, 128, 192, 1e-5, 500000.0
HEAD_DIM = DIM // HEADS

# HF name -> torchtitan 0.3 name, written out: the test's own table, not ckptkit's.
TITAN_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    **{f"model.layers.{i}.{hf}.weight": f"layers.{i}.{tt}.weight" for i in range(LAYERS) for hf, tt in (
        ("self_attn.q_proj", "attention.qkv_linear.wq"), ("self_attn.k_proj", "attention.qkv_linear.wk"),
        ("self_attn.v_proj", "attention.qkv_linear.wv"), ("self_attn.o_proj", "attention.wo"),
        ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
        ("mlp.down_proj", "feed_forward.w2"), ("input_layernorm", "attention_norm"),
        ("post_attention_layernorm", "ffn_norm"))},
}


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def hf_model(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=EPS,
                         rope_parameters={"rope_type": "default", "rope_theta": THETA},
                         max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough for attention to depend on them, norms away from 1
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def interleaved(w: torch.Tensor) -> torch.Tensor:
    """q/k rows from HF's rotate_half layout to torchtitan's interleaved pairs: per head, rows (even dims, odd
    dims) -> (pair 0, pair 1, ...)."""
    n = w.shape[0] // HEAD_DIM
    return w.reshape(n, 2, HEAD_DIM // 2, -1).transpose(1, 2).reshape(w.shape)


def to_titan(hf_state: dict[str, torch.Tensor], *, reorder: bool = True) -> dict[str, torch.Tensor]:
    """The torchtitan 0.3 state dict of an HF Llama state dict, by torch reshapes (tied: lm_head from the
    embedding, as torchtitan's own adapter fills it)."""
    out = {}
    for hf, tt in TITAN_NAMES.items():
        w = hf_state.get(hf, hf_state["model.embed_tokens.weight"] if hf == "lm_head.weight" else None)
        out[tt] = (interleaved(w) if reorder and ("q_proj" in hf or "k_proj" in hf) else w).clone()
    return out


def titan_logits(sd: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's Llama 3 forward: rotary embeddings rotate adjacent pairs (2i, 2i+1) as complex numbers."""
    batch, length = tokens.shape
    freqs = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    rotation = torch.polar(torch.ones(length, HEAD_DIM // 2), torch.outer(torch.arange(length).float(), freqs))

    def rotary(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotation[None, :, None, :]).flatten(3).type_as(x)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (DIM,), weight, EPS)

    h = F.embedding(tokens, sd["tok_embeddings.weight"])
    for i in range(LAYERS):
        p = f"layers.{i}."
        x = norm(h, sd[p + "attention_norm.weight"])
        q = (x @ sd[p + "attention.qkv_linear.wq.weight"].T).view(batch, length, HEADS, HEAD_DIM)
        k = (x @ sd[p + "attention.qkv_linear.wk.weight"].T).view(batch, length, KV_HEADS, HEAD_DIM)
        v = (x @ sd[p + "attention.qkv_linear.wv.weight"].T).view(batch, length, KV_HEADS, HEAD_DIM)
        q, k = rotary(q), rotary(k)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True).transpose(1, 2)
        h = h + o.flatten(2) @ sd[p + "attention.wo.weight"].T
        x = norm(h, sd[p + "ffn_norm.weight"])
        gate, up = x @ sd[p + "feed_forward.w1.weight"].T, x @ sd[p + "feed_forward.w3.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "feed_forward.w2.weight"].T
    return norm(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _titan_save(rank: int, world: int, state_file: str, out: str) -> None:
    """What torchtitan's CheckpointManager saves under FSDP: model keys flat at the top level as Shard(0)
    DTensors, beside the optimizer (flattened, per parameter name), scheduler, dataloader and train state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = torch.load(state_file, weights_only=True)
    state: dict = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model.items()}
    state["optimizer"] = {**{f"state.{k}.exp_avg": distribute_tensor(torch.ones_like(v), mesh, [Shard(0)])
                             for k, v in model.items()},
                          **{f"param_groups.{k}.lr": 3e-4 for k in model}}
    state["lr_scheduler"] = {"last_epoch": 3}
    state["dataloader"] = {"world_size": world}
    state["train_state"] = {"step": 3, "ntokens_seen": 12345}
    dcp.save(state, checkpoint_id=out)


def _titan_load(rank: int, world: int, ckpt: str, shapes: dict, out: str) -> None:
    """torchtitan's initial load of a model-only DCP: ``dcp.load`` into the model's Shard(0) state dict; rank 0
    saves the full tensors to ``out`` (tensors do not travel back through run_ranks' queue)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)]) for k, s in shapes.items()}
    dcp.load(state, checkpoint_id=ckpt)
    full = {k: v.full_tensor() for k, v in state.items()}
    if rank == 0:
        torch.save(full, out)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def titan_run(request, tmp_path_factory):
    """An HF Llama (its save_pretrained directory) and the same model as a torchtitan FSDP checkpoint."""
    tie = request.param
    root = tmp_path_factory.mktemp("tied" if tie else "untied")
    model = hf_model(tie)
    model.save_pretrained(root / "hf")
    titan = to_titan(model.state_dict())
    torch.save(titan, root / "titan.pt")
    run_ranks(_titan_save, 2, str(root / "titan.pt"), str(root / "step-3"))
    return model, titan, root


def test_titan_reference_forward_is_the_hf_model(titan_run):
    # The test's torchtitan checkpoint is the model: logits agree to float32 rounding; unreordered, they do not.
    model, titan, _ = titan_run
    with torch.no_grad():
        want = model(TOKENS).logits
        assert (titan_logits(titan, TOKENS) - want).abs().max() < 1e-4
        assert (titan_logits(to_titan(model.state_dict(), reorder=False), TOKENS) - want).abs().max() > 1e-2


def test_export_hf_torchtitan_to_transformers_identical_logits(titan_run):
    from transformers import LlamaForCausalLM

    model, _, root = titan_run
    result = run("export-hf", root / "step-3", root / "export", "--preset", "torchtitan-llama",
                 "--hf-assets", root / "hf")
    assert "note: --preset torchtitan-llama: 21 keys mapped, torchtitan names -> HF names" in result.stdout
    loaded = LlamaForCausalLM.from_pretrained(root / "export").eval()
    assert_same_tree(load_hf(root / "export"), dict(model.state_dict()) if not model.config.tie_word_embeddings
                     else {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    with torch.no_grad():
        assert_tensor_identical(loaded(TOKENS).logits, model(TOKENS).logits, "logits")


def test_export_hf_torchtitan_resharded_at_3_ranks_gathers_rows_across_chunks(titan_run):
    # 3 ranks split q's 64 rows 22/21/21: heads straddle chunks, so a head's rows come from two files.
    model, _, root = titan_run
    run("reshard", root / "step-3", root / "step-3-at-3", "--world-size", "3")
    run("export-hf", root / "step-3-at-3", root / "export3", "--preset", "torchtitan-llama", "--hf-assets", root / "hf",
        "--dtype", "bf16")
    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert_same_tree(load_hf(root / "export3"), want)


def test_convert_hf_to_torchtitan_dcp_loads_in_torchtitan_and_round_trips(titan_run):
    model, titan, root = titan_run
    result = run("convert", root / "hf", root / "titan-init", "--to", "sharded", "--world-size", "2",
                 "--preset", "torchtitan-llama")
    assert "note: --preset torchtitan-llama: 21 keys mapped, HF names -> torchtitan names" in result.stdout
    if model.config.tie_word_embeddings:
        assert ("note: lm_head.weight written from model.embed_tokens.weight: "
                f"{root / 'hf' / 'config.json'} ties them, and torchtitan keeps both") in result.stdout
    shapes = {k: tuple(v.shape) for k, v in titan.items()}
    run_ranks(_titan_load, 2, str(root / "titan-init"), shapes, str(root / "loaded.pt"))
    loaded = torch.load(root / "loaded.pt", weights_only=True)
    assert_same_tree(loaded, titan)
    with torch.no_grad():
        assert (titan_logits(loaded, TOKENS) - model(TOKENS).logits).abs().max() < 1e-4
    run("export-hf", root / "titan-init", root / "back", "--preset", "torchtitan-llama", "--hf-assets", root / "hf")
    assert_same_tree(load_hf(root / "back"), load_hf(root / "hf"))


def test_export_hf_torchtitan_dry_run_writes_nothing_and_lists_the_plan(titan_run, tmp_path):
    model, _, root = titan_run
    result = run("export-hf", root / "step-3", tmp_path / "out", "--preset", "torchtitan-llama",
                 "--hf-assets", root / "hf", "--dtype", "bf16", "--dry-run")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    lines = result.stdout.splitlines()
    assert lines[1].startswith("  would write ") and lines[1].endswith("(dry run: nothing written)")
    assert "    layers.N.attention.qkv_linear.wq.weight -> model.layers.N.self_attn.q_proj.weight (x2): q/k rows " \
           "reordered (rotary)" in lines
    assert "    layers.N.feed_forward.w3.weight         -> model.layers.N.mlp.up_proj.weight (x2)" in lines
    written = json.loads((root / "hf" / "config.json").read_text())
    assert any(line.startswith("    model.safetensors  ") for line in lines)
    assert any(line.startswith("    config.json  ") for line in lines)
    if written["tie_word_embeddings"]:
        assert "  left out (1 key):" in lines
        assert any(line.startswith("    lm_head.weight: tied to the input embedding") for line in lines)
    tied = 1 if written["tie_word_embeddings"] else 0
    assert f"  written as bfloat16: all {21 - tied} tensors" in lines


def test_meta_llama_single_file_to_hf(titan_run, tmp_path):
    # Meta's consolidated.00.pth: torchtitan <= 0.2's names, output.weight, and params.json beside it.
    from transformers import LlamaForCausalLM

    model, titan, _ = titan_run
    meta = {k.replace("qkv_linear.", "").replace("lm_head", "output"): v for k, v in titan.items()}
    (tmp_path / "original").mkdir()
    torch.save({**meta, "rope.freqs": torch.ones(HEAD_DIM // 2)}, tmp_path / "original" / "consolidated.00.pth")
    (tmp_path / "original" / "params.json").write_text(json.dumps(
        {"dim": DIM, "n_heads": HEADS, "n_kv_heads": KV_HEADS, "n_layers": LAYERS, "norm_eps": EPS,
         "rope_theta": THETA, "vocab_size": VOCAB}))
    result = run("convert", tmp_path / "original" / "consolidated.00.pth", tmp_path / "hf", "--to", "hf",
                 "--preset", "meta-llama")
    assert "    rope.freqs: not a weight (meta-llama)" in result.stdout.splitlines()
    (tmp_path / "hf" / "config.json").write_text(model.config.to_json_string())
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert_tensor_identical(loaded(TOKENS).logits, model(TOKENS).logits, "logits")


def test_meta_llama_refuses_model_parallel_files(tmp_path):
    (tmp_path / "original").mkdir()
    for i in range(2):
        torch.save({"tok_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "original" / f"consolidated.0{i}.pth")
    result = CliRunner().invoke(cli, ["convert", str(tmp_path / "original" / "consolidated.00.pth"),
                                      str(tmp_path / "hf"), "--to", "hf", "--preset", "meta-llama"])
    assert result.exit_code == 2
    assert ("one of 2 model-parallel files (consolidated.00.pth ... consolidated.01.pth); --preset meta-llama reads "
            "a single-file checkpoint") in result.stderr
    assert not (tmp_path / "hf").exists()

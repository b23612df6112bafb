"""A small decoder-only transformer with what real checkpoints carry: an embedding tied to ``lm_head``,
attention and MLP blocks, RMS norms and a persistent buffer. Parameter names follow Hugging Face LLaMA
(``model.layers.0.self_attn.q_proj.weight``) so exports look like the checkpoints users convert.

With ``TinyConfig(rope=True)`` it is a LLaMA: rotary position embeddings in attention instead of the added
``pos_table`` buffer, so that its export loads in ``LlamaForCausalLM`` (what :meth:`TinyConfig.hf_config`
names) with nothing missing or unexpected and computes the same logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "TinyConfig", "TinyTransformer", "batch", "next_token_loss"]


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 96
    seq: int = 16
    rope: bool = False
    """Rotary position embeddings, as LLaMA's (theta 10000), instead of the ``pos_table`` buffer."""

    def hf_config(self) -> dict:
        """A LLaMA ``config.json`` for this shape, for ``export-hf --hf-assets``: the model it describes is this
        one with ``rope=True`` (without, the export carries ``model.pos_table``, which LLaMA does not have)."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab,
                "hidden_size": self.dim, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.heads, "intermediate_size": self.ffn, "tie_word_embeddings": True,
                "max_position_embeddings": self.seq, "rms_norm_eps": _EPS, "rope_theta": _THETA,
                "hidden_act": "silu", "torch_dtype": "float32"}


_EPS = 1e-6
_THETA = 10000.0


def _rotary(cfg: TinyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaMA's rotary tables (cos, sin) of shape (seq, head_dim): each frequency repeated for both halves."""
    head = cfg.dim // cfg.heads
    freqs = torch.outer(torch.arange(cfg.seq).float(), 1.0 / _THETA ** (torch.arange(0, head, 2).float() / head))
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _EPS) * self.weight


class Attention(nn.Module):
    cos: torch.Tensor  # rotary tables, buffers registered in __init__ with rope
    sin: torch.Tensor

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.heads, self.rope = cfg.heads, cfg.rope
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
        if cfg.rope:  # not persistent: LLaMA keeps its rotary tables out of the state dict too
            cos, sin = _rotary(cfg)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.rope:
            cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    pos_table: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        if cfg.rope:
            return
        pos = torch.arange(cfg.seq).unsqueeze(1) / (10000 ** (torch.arange(0, cfg.dim, 2) / cfg.dim))
        table = torch.zeros(cfg.seq, cfg.dim)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos), torch.cos(pos)
        self.register_buffer("pos_table", table / math.sqrt(cfg.dim))  # persistent: it is in the state dict

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        # In the activations' dtype, as LLaMA casts its rotary tables: under FSDP1 MixedPrecision with fp32
        # buffers, an fp32 table would make x fp32 for bf16 layers that share the root's unit (no auto-wrap).
        if not self.cfg.rope:
            x = x + self.pos_table[: tokens.shape[1]].to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyTransformer(nn.Module):
    def __init__(self, cfg: TinyConfig = TinyConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Decoder(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        nn.init.normal_(self.model.embed_tokens.weight, std=0.02)  # as LLaMA initialises; N(0, 1) gives huge logits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self, tokens)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each next token of ``tokens`` (batch, seq + 1).

    ``model`` may be a wrapper (DDP, FSDP1) around a :class:`TinyTransformer`: this calls the wrapper's
    forward, whose hooks gather and reduce, where ``wrapper.loss`` would reach past them to the inner module.
    """
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch(cfg: TinyConfig, step: int, size: int = 4, rank: int = 0) -> torch.Tensor:
    """Deterministic token batch for ``step`` (and ``rank``, for data parallel runs)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, cfg.vocab, (size, cfg.seq + 1), generator=g)

"""Tiny models for the LOCAL tests, importable as ``fixtures_models:tiny`` by the ``model=`` option.

Sizes are odd on purpose (7, 11, 13), so that flat parameters straddle ranks mid-row and FSDP1 has to pad
them, both for address alignment (``use_orig_params=True``) and for divisibility by the world size.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "TinyNet", "tiny", "train_step"]


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.down(torch.relu(self.up(x)))


class TinyNet(nn.Module):
    """Embedding tied to the output head (as LLaMA-style models often are), two blocks, two buffers."""

    def __init__(self, vocab: int = 13, dim: int = 7, hidden: int = 11, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("steps", torch.tensor([3, 1, 4], dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny() -> TinyNet:
    return TinyNet()


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step on a batch of tokens drawn from ``seed`` (any wrapper of a :class:`TinyNet`, mixed
    precision included: the loss is taken in fp32)."""
    tokens = torch.randint(0, 13, (4, 9), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().logsumexp(-1).mean().backward()
    optim.step()
    optim.zero_grad()

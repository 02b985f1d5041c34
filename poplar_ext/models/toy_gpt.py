"""A small GPT-style language model and a synthetic token data set (nothing is downloaded), from a few thousand
parameters (CPU tests) to >100M (GPU profiling). See docs/profiling.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F

from poplar_ext.models.synthetic import random_tokens
from poplar_ext.reductions import REDUCTIONS


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256
    """Number of token ids."""
    sequence_length: int = 32
    """Tokens per sample (the context length)."""
    num_layers: int = 2
    num_heads: int = 2
    hidden_size: int = 64
    """Width of the residual stream; must divide by num_heads."""

    @classmethod
    def gpt2_small(cls, *, sequence_length: int = 512) -> GPTConfig:
        """GPT-2 small shape (~124M parameters with a 50257 vocabulary)."""
        return cls(vocab_size=50257, sequence_length=sequence_length, num_layers=12, num_heads=12, hidden_size=768)


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp_in = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.mlp_out = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)
        self.num_heads = cfg.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        shape = (batch, seq, self.num_heads, width // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer. ``model(tokens)`` returns the mean next-token loss.

    ``activation_checkpointing = True`` recomputes each block's forward in backward (torch.utils.checkpoint,
    non-reentrant) instead of keeping its activations: the same gradients, less memory, more compute."""

    activation_checkpointing: bool = False
    """Read by forward; declared on the class, which is how `poplar_ext.activation_checkpointing` knows
    it can switch this model."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(
                f"GPTConfig.hidden_size: expected a multiple of num_heads ({cfg.num_heads}), found {cfg.hidden_size}"
            )
        self.cfg = cfg
        # Seeded construction: every rank (and the single-process reference in tests)
        # builds bit-identical initial weights without a broadcast.
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.sequence_length, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
                elif name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()

    def forward(self, tokens: torch.Tensor, *, reduction: str = "mean") -> torch.Tensor:
        """Next-token cross-entropy over ``tokens`` (shape: batch x sequence_length)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1], device=tokens.device)
        x = self.embed(inputs) + self.position(positions)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        # Per-sample mean over tokens first, so "mean" is the mean over samples: the
        # loss weighting in poplar_ext assumes a loss that is a mean over samples.
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        per_sample = per_token.view(targets.shape).mean(dim=1)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {', '.join(map(repr, REDUCTIONS))}, found {reduction!r}")
        # token_mean: every sample has as many label tokens, so the token mean is the sample mean
        return per_sample.sum() if reduction == "sum" else per_sample.mean()


def num_parameters(model: nn.Module) -> int:
    """Total parameter count."""
    return sum(p.numel() for p in model.parameters())


class SyntheticTokens(torch.utils.data.Dataset):
    """A deterministic data set of random token sequences (sample i is the same everywhere).

    Each item is a LongTensor of ``sequence_length + 1`` tokens, so the model sees
    ``sequence_length`` inputs and as many targets."""

    def __init__(self, *, num_samples: int, sequence_length: int, vocab_size: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples: expected an integer >= 1, found {num_samples}")
        self.num_samples = num_samples
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        # A generator per item keeps items independent of access order, which the exactly-once data tests rely on.
        return random_tokens(self.vocab_size, (self.sequence_length + 1,), seed=self.seed * 1_000_003 + index)

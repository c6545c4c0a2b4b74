"""A small decoder-only transformer (pre-LN, character level) whose attention is one switch.

``attention="sdpa"`` calls ``torch.nn.functional.scaled_dot_product_attention``; ``attention="fa2edu"`` calls
``fa2edu.torch.flash_attention`` (FA2 Alg. 1 forward, Alg. 2 backward: NumPy on the CPU; on CUDA kernels_gpu's fast
float32 kernels, or its tensor-core kernels for float16/bfloat16 and under ``torch.autocast``).
Everything else is identical, so two models built from the same seed differ only in who computes attention.

Default size: 2 layers, d_model = 64, 2 heads of d = 32, context 64, about 0.1 M parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "ATTENTIONS"]

ATTENTIONS = ("sdpa", "fa2edu")


@dataclass
class GPTConfig:
    vocab_size: int
    context: int = 64
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    attention: str = "sdpa"                  # "sdpa" or "fa2edu"
    block_sizes: tuple[int, int] | None = None   # fa2edu's (B_r, B_c); None: its default rule

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model = {self.d_model} must be a multiple of n_head = {self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x):
        B, N, C = x.shape
        H = self.config.n_head
        # (B, N, 3C) → three (B, H, N, d) views; the transpose makes them non-contiguous, as in most GPTs.
        q, k, v = (t.view(B, N, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        if self.config.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            from fa2edu.torch import flash_attention

            # N_q = N_k here, so fa2edu's bottom-right causal mask is SDPA's top-left one.
            y = flash_attention(q, k, v, causal=True, block_sizes=self.config.block_sizes)
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm and a (tied) output projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids, targets=None):
        """ids (B, N) → logits (B, N, vocab), and the mean cross-entropy against ``targets`` if given."""
        N = ids.shape[1]
        x = self.token(ids) + self.position(torch.arange(N, device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.token.weight.T          # weights tied with the token embedding
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

"""The models that the tests and the training benchmarks train.

:class:`CharTransformer` is a small decoder-only, character-level transformer (the
model of ``qcoll-bench train``, ``tune`` and the convergence test); :data:`TINY` is
its size in most tests. :func:`char_transformer` and :func:`tiny_model` build one from
a seed, so that two processes (or a sharded run and its single-process oracle) start
from the same values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TransformerConfig:
    vocab: int = 256        # bytes
    context: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Token embedding tied with the output head; learned positions on the root module."""

    def __init__(self, cfg: TransformerConfig = TransformerConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.context, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight
        self.apply(self._init)
        nn.init.normal_(self.pos, std=0.02)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx) + self.pos[: idx.shape[1]].to(self.embed.weight.dtype)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def units(self) -> list[nn.Module]:
        """The ZeRO units: the embedding, each block, the final norm (the head is tied)."""
        return [self.embed, *self.blocks, self.ln_f]


TINY = TransformerConfig(context=32, d_model=64, n_layers=2, n_heads=2)
"""The tests' size: two blocks of width 64 over 32 bytes of context."""


def char_transformer(cfg: TransformerConfig = TransformerConfig(), seed: int = 0) -> CharTransformer:
    """A :class:`CharTransformer` of size ``cfg`` with initial values from ``torch.manual_seed(seed)``
    (which also leaves the global generator seeded, as the callers have always had it)."""
    torch.manual_seed(seed)
    return CharTransformer(cfg)


def tiny_model(seed: int = 0, cfg: TransformerConfig = TINY) -> CharTransformer:
    """:func:`char_transformer` at the tests' size :data:`TINY` (or ``cfg``), seed first."""
    return char_transformer(cfg, seed)


def byte_llama(context: int, seed: int = 0) -> nn.Module:
    """A Llama decoder from ``transformers.LlamaConfig`` on bytes (vocabulary 256, 4 layers, hidden
    128, 4 heads, intermediate 344), about the char transformer's size; needs ``transformers``
    (the test extra). No downloads: built from the config with ``seed``'s initial values."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=context + 1, attn_implementation="sdpa"))


def causal_lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's loss on the window ``x`` plus the last target (it shifts the labels itself)."""
    ids = torch.cat([x, y[:, -1:]], dim=1)
    return model(input_ids=ids, labels=ids).loss

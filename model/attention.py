"""Grouped-query attention without positional rotation (the Mamba layers carry position)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import KVCache
from model.config import HybridConfig


class Attention(nn.Module):
    """q/k/v/o projections and ``scaled_dot_product_attention``. Input/output: (batch, seq, hidden)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(
        self,
        hidden: Tensor,
        cache: KVCache | None = None,
        use_cache: bool = False,
        head_mask: Tensor | None = None,
    ) -> tuple[Tensor, KVCache | None]:
        """hidden: (b, l, hidden); ``head_mask`` (num_heads,) weights query heads before ``o_proj``."""
        b, seq, _ = hidden.shape
        q = self.q_proj(hidden).view(b, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(b, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(b, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        past = 0
        if cache is None and use_cache:
            cache = KVCache.empty(b, self.num_kv_heads, self.head_dim, seq + 64, k)
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        gqa = self.num_heads != self.num_kv_heads
        padding = cache.attention_mask(past + seq) if cache is not None else None  # (b, 1, 1, past + seq)
        if past == 0 and padding is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif seq == 1:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=padding, enable_gqa=gqa)
        else:  # a chunk after a prefix: query i sees keys up to past + i (and no padding slot)
            total = past + seq
            allowed = torch.ones(seq, total, dtype=torch.bool, device=q.device).tril(diagonal=past)
            if padding is not None:
                allowed = allowed & padding
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
        if head_mask is not None:
            out = out * head_mask.to(out.dtype)[None, :, None, None]
        out = out.transpose(1, 2).reshape(b, seq, self.num_heads * self.head_dim)
        return self.o_proj(out), cache

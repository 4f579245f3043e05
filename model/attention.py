"""Grouped-query attention without positional rotation (the Mamba layers carry position)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import KVCache
from model.config import HybridConfig
from model.fastops import linear


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
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif seq == 1:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        else:  # a chunk after a prefix: query i sees keys up to past + i
            total = past + seq
            allowed = torch.ones(seq, total, dtype=torch.bool, device=q.device).tril(diagonal=past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
        if head_mask is not None:
            out = out * head_mask.to(out.dtype)[None, :, None, None]
        out = out.transpose(1, 2).reshape(b, seq, self.num_heads * self.head_dim)
        return self.o_proj(out), cache

    def decode_step(self, hidden: Tensor, cache: KVCache, residual: Tensor) -> tuple[Tensor, KVCache]:
        """One cached decode token without a head mask: hidden, residual (b, hidden_size) -> residual + output.

        The new key/value go straight into the preallocated cache slot. The query heads of a KV group are
        consecutive (as ``enable_gqa`` pairs them), so one query's attention works on (batch * kv_heads)
        groups with the group's heads as rows: no repeat of K/V. A short cache takes broadcast products and
        sums instead of ``scaled_dot_product_attention`` / ``bmm`` / ``softmax``: those CPU kernels open an
        OpenMP parallel region whatever the size, and on a shared CPU one region can wait a whole scheduler
        time slice for its second thread (milliseconds, against microseconds of arithmetic). An empty or
        full cache takes :meth:`forward`.
        """
        b, past = hidden.shape[0], cache.length
        if past == 0 or past >= cache.k.shape[2]:
            out, new = self.forward(hidden[:, None], cache, True)
            return residual + out[:, 0], new
        kv, d = self.num_kv_heads, self.head_dim
        q = linear(self.q_proj, hidden).view(b * kv, self.num_heads // kv, d)
        cache.k.select(2, past).copy_(linear(self.k_proj, hidden).view(b, kv, d))
        cache.v.select(2, past).copy_(linear(self.v_proj, hidden).view(b, kv, d))
        cache.length = n = past + 1
        cap = cache.k.shape[2]
        k = cache.k.reshape(b * kv, cap, d).narrow(1, 0, n)  # a view of the cache (it is contiguous)
        v = cache.v.reshape(b * kv, cap, d).narrow(1, 0, n)
        if q.numel() * n <= _SMALL_ATTENTION:
            scores = (q.unsqueeze(2) * k.unsqueeze(1)).sum(-1).mul_(d**-0.5)  # (b * kv, heads per group, n)
            # softmax; expm1 + 1 rather than exp, whose vectorised kernel is threaded from 128 elements up
            p = torch.expm1(scores - scores.amax(-1, keepdim=True)).add_(1.0)
            p = p.div_(p.sum(-1, keepdim=True))
            out = (p.unsqueeze(-1) * v.unsqueeze(1)).sum(2)  # (b * kv, heads per group, head_dim)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(d**-0.5)
            out = torch.bmm(torch.softmax(scores, dim=-1), v)
        return linear(self.o_proj, out.reshape(b, self.num_heads * d), residual), cache


_SMALL_ATTENTION = 1 << 15
"""Query elements x cached tokens up to which a decode step's attention uses broadcast products (ATen's
grain size: below it elementwise kernels run on one thread, so that path opens no parallel region)."""

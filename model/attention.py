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

    def decode_step(self, hidden: Tensor, cache: KVCache, residual: Tensor) -> tuple[Tensor, KVCache]:
        """One cached decode token without a head mask: hidden, residual (b, hidden_size) -> residual + output.

        The new key/value go straight into the preallocated cache slot, and one query needs no transposes:
        (b, heads, 1, head_dim) is the memory of (b, 1, heads * head_dim). With several threads, a short
        cache takes broadcast products and sums instead of ``scaled_dot_product_attention`` (see
        :func:`_broadcast_attention`). An empty or full cache takes :meth:`forward`.
        """
        b, past = hidden.shape[0], cache.length
        if past == 0 or past >= cache.k.shape[2]:
            out, new = self.forward(hidden[:, None], cache, True)
            return residual + out[:, 0], new
        kv, d, heads = self.num_kv_heads, self.head_dim, self.num_heads
        modules = self._modules  # not self.q_proj etc.: module attributes cost a failed lookup first
        q = linear(modules["q_proj"], hidden)
        cache.k.select(2, past).copy_(linear(modules["k_proj"], hidden).view(b, kv, d))
        cache.v.select(2, past).copy_(linear(modules["v_proj"], hidden).view(b, kv, d))
        cache.length = n = past + 1
        k, v = cache.k.narrow(2, 0, n), cache.v.narrow(2, 0, n)  # (b, kv, n, d) views of the cache
        if cache.pad is not None:  # rows of different lengths: mask each row's leading padding slots
            mask = cache.attention_mask(n)
            out = F.scaled_dot_product_attention(q.view(b, heads, 1, d), k, v, attn_mask=mask, enable_gqa=heads != kv)
        elif _use_broadcast(q.numel() * n):
            out = _broadcast_attention(q.view(b * kv, heads // kv, d), k, v)
        else:
            out = F.scaled_dot_product_attention(q.view(b, heads, 1, d), k, v, enable_gqa=heads != kv)
        return linear(modules["o_proj"], out.reshape(b, heads * d), residual), cache


_SMALL_ATTENTION = 1 << 15
"""Query elements x cached tokens up to which a multi-threaded decode step uses :func:`_broadcast_attention`
(ATen's grain size: below it elementwise kernels run on one thread, so that path opens no parallel region)."""


def _use_broadcast(work: int) -> bool:
    """Whether one query's attention over ``work`` = query elements x cached tokens takes the broadcast path:
    small, and more than one thread (with one thread no parallel region is ever opened)."""
    return work <= _SMALL_ATTENTION and torch.get_num_threads() > 1


def _broadcast_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One query per head: q (b * kv, heads per kv group, d), k / v (b, kv, n, d) -> (b * kv, heads per group, d).

    The query heads of a KV group are consecutive (as ``enable_gqa`` pairs them), so each group is a batch
    with its heads as rows: no repeat of K/V. Broadcast products and sums instead of
    ``scaled_dot_product_attention`` / ``bmm`` / ``softmax``: those CPU kernels open an OpenMP parallel
    region whatever the size, and on a shared CPU one region can wait a whole scheduler time slice for its
    second thread (milliseconds, against microseconds of arithmetic).
    """
    b, kv, n, d = k.shape
    k = k.reshape(b * kv, 1, n, d)  # a view when the cache is contiguous
    v = v.reshape(b * kv, n, d)
    scores = (q.unsqueeze(2) * k).sum(-1).mul_(d**-0.5)  # (b * kv, heads per group, n)
    # softmax; expm1 + 1 rather than exp, whose vectorised kernel is threaded from 128 elements up
    p = torch.expm1(scores - scores.amax(-1, keepdim=True)).add_(1.0)
    p = p.div_(p.sum(-1, keepdim=True))
    return (p.unsqueeze(-1) * v.unsqueeze(1)).sum(2)

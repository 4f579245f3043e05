"""Mixture of experts (nemotron_h): sigmoid router with a selection-only bias, squared-ReLU experts.

Routing, per token:
1. ``scores = sigmoid(x @ gate.weight.T)`` (float32).
2. Selection uses ``scores + e_score_correction_bias`` (optionally limited to the best
   ``topk_group`` of ``n_group`` expert groups); the bias never enters the weights.
3. The selected scores are renormalised to sum to 1 (``norm_topk_prob``) and multiplied
   by ``routed_scaling_factor``.
Experts run on the tokens routed to them: assignments are sorted by expert and each
expert processes one contiguous slice (a loop over experts, never over tokens).
A shared expert sees every token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from model.config import HybridConfig
from model.mlp import MLP, relu2

RoutingObserver = Callable[[Tensor, Tensor, Tensor], None]
"""Called with (indices (T, k), weights (T, k), expert output L2 norms (T, k)) when set."""


class TopKRouter(nn.Module):
    """``weight`` (E, hidden) and the selection-only ``e_score_correction_bias`` (E,)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: Tensor, expert_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: (T, hidden) -> (indices (T, k) long, weights (T, k) float32).

        ``expert_mask`` (E,): experts with mask 0 are never selected (their selection
        score gets log(0) = -inf); a soft mask also scales the chosen weights.
        """
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        choice = scores + self.e_score_correction_bias.float()
        if expert_mask is not None:
            choice = choice + torch.log(expert_mask.float().clamp_min(0.0))
        if self.n_group > 1:
            t = choice.shape[0]
            grouped = choice.view(t, self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~group_mask.repeat_interleave(grouped.shape[-1], dim=1), -torch.inf)
        idx = choice.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if expert_mask is not None:
            w = w * expert_mask.float()[idx]
        return idx, w * self.scaling


class Experts(nn.Module):
    """Stacked expert weights: ``up_proj`` (E, ffn, hidden), ``down_proj`` (E, hidden, ffn)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        e, f, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = e
        self.up_proj = nn.Parameter(torch.empty(e, f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))

    def forward(
        self,
        x: Tensor,
        idx: Tensor,
        weights: Tensor,
        ffn_mask: Tensor | None = None,
        observer: RoutingObserver | None = None,
    ) -> Tensor:
        """x: (T, hidden); idx, weights: (T, k) -> (T, hidden) = sum_j w_j * expert_j(x)."""
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // k
        xs = x[token]
        pieces = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            h = relu2(xs[start : start + n] @ self.up_proj[e].t())
            if ffn_mask is not None:
                h = h * ffn_mask.to(h.dtype)
            pieces.append(h @ self.down_proj[e].t())
            start += n
        ys = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[-1])
        if observer is not None:
            norms = torch.empty(t * k, device=x.device, dtype=torch.float32)
            norms[order] = ys.detach().float().norm(dim=-1)
            observer(idx, weights.detach(), norms.view(t, k))
        w = weights.reshape(-1)[order].to(ys.dtype)
        return x.new_zeros(t, x.shape[-1]).index_add_(0, token, ys * w[:, None])


class MoE(nn.Module):
    """Routed experts plus the always-on shared expert. Input/output: (batch, seq, hidden)."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_shared_expert_intermediate_size, bias=config.mlp_bias)
            if config.n_shared_experts
            else None
        )
        self.observer: RoutingObserver | None = None

    def forward(
        self,
        hidden: Tensor,
        expert_mask: Tensor | None = None,
        ffn_mask: Tensor | None = None,
        shared_ffn_mask: Tensor | None = None,
    ) -> Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        idx, w = self.gate(x, expert_mask)
        out = self.experts(x, idx, w, ffn_mask, self.observer).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden, shared_ffn_mask)
        return out

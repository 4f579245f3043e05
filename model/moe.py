"""Mixture of experts (nemotron_h): sigmoid router with a selection-only bias, squared-ReLU experts.

Routing, per token:
1. ``scores = sigmoid(x @ gate.weight.T)`` (float32).
2. Selection uses ``scores + e_score_correction_bias`` (optionally limited to the best
   ``topk_group`` of ``n_group`` expert groups); the bias never enters the weights.
3. The selected scores are renormalised to sum to 1 (``norm_topk_prob``) and multiplied
   by ``routed_scaling_factor``.
Experts run on the tokens routed to them, by one of three equivalent paths chosen by
how many (token, expert) assignments there are and how large the experts are
(:func:`expert_path`):

* fewer assignments than experts (``T * k < E``, e.g. one token) of experts too large to read
  in full: only the selected experts run (no sort, and only their bytes are read);
* otherwise, with little arithmetic wasted: every expert on every token, weighted by zero
  where unselected (a handful of large ops);
* otherwise :func:`expert_loop`: assignments sorted by expert, each expert on one contiguous
  slice of its tokens (a loop over experts, never over tokens).

A shared expert sees every token.

The arithmetic is written once, on tensors (:func:`router_scores`, :func:`top_experts`,
:func:`routing_weights`, :func:`route`; :func:`every_expert_up`, :func:`dense_routing`, :func:`mix_down`,
:func:`dense_experts`): the modules here call it, and so do the decode steps of :mod:`model.decode`, eager and
compiled (these functions are traced by ``torch.compile``: no host reads, no branch on a tensor's values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import HybridConfig
from model.mlp import MLP, relu2

RoutingObserver = Callable[[Tensor, Tensor, Tensor], None]
"""Called with (indices (T, k), weights (T, k), expert output L2 norms (T, k)) when set."""

_DENSE_MAX_WASTED_MACS = 1 << 22
"""Multiply-adds spent on unselected experts up to which few tokens (decoding, short prompts) run every
expert: below it, a few large ops cost less than grouping tokens by expert."""

_SMALL_EXPERTS = 1 << 16
"""Weights per projection (E * F * H) up to which experts are cheaper to read in full than to select on
the host and loop over, even with fewer assignments than experts."""

ExpertPath = Literal["sparse", "dense", "grouped"]


def expert_path(tokens: int, top_k: int, num_experts: int, ffn: int, hidden: int) -> ExpertPath:
    """How ``tokens`` tokens with ``top_k`` of ``num_experts`` experts of shape (ffn, hidden) are computed.

    ``sparse``: fewer assignments than experts and experts too large to read in full (a loop over the
    selected experts); ``dense``: every expert on every token, when that wastes at most
    :data:`_DENSE_MAX_WASTED_MACS` multiply-adds; ``grouped``: tokens sorted by expert, one slice each.
    """
    small = num_experts * ffn * hidden <= _SMALL_EXPERTS
    if tokens * top_k < num_experts and not small:
        return "sparse"
    if tokens * (num_experts - top_k) * ffn * hidden <= _DENSE_MAX_WASTED_MACS:
        return "dense"
    return "grouped"


# ---------------------------------------------------------------------- the arithmetic, on tensors
def _float32(t: Tensor) -> Tensor:
    """``t`` in float32: itself when it already is, without the ``to`` call (an operator dispatch: the one-token
    decode step counts them)."""
    return t if t.dtype == torch.float32 else t.float()


def router_scores(x: Tensor, weight: Tensor) -> Tensor:
    """Routing step 1: x (T, hidden), the router's weight (E, hidden) -> float32 scores sigmoid(x @ weight.T)
    (T, E)."""
    return torch.sigmoid(F.linear(_float32(x), _float32(weight)))


def top_experts(scores: Tensor, bias: Tensor, top_k: int, in_order: bool = True) -> Tensor:
    """Routing step 2 without an expert mask or a group limit: scores (..., E) float32, the selection-only bias
    (E,) -> the ``top_k`` experts of ``scores + bias`` (..., k) int64. ``in_order``: in descending order of that
    sum (the router's order), else in whatever order ``topk`` leaves them (the decode steps': no sort)."""
    return torch.topk(scores + _float32(bias), top_k, sorted=in_order).indices


def routing_weights(scores: Tensor, idx: Tensor, renormalise: bool, scaling: float) -> Tensor:
    """Routing step 3: scores (..., E) float32, selected experts idx (..., k) -> their weights (..., k), the
    selected scores renormalised to sum to 1 (when ``renormalise``) and multiplied by ``scaling``."""
    w = scores.gather(-1, idx)
    if renormalise:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling


def route(
    scores: Tensor, bias: Tensor, top_k: int, renormalise: bool, scaling: float, in_order: bool = True
) -> tuple[Tensor, Tensor]:
    """Routing steps 2 and 3 (:func:`top_experts`, :func:`routing_weights`) of float32 scores (..., E) ->
    (selected experts (..., k), their weights (..., k) float32)."""
    idx = top_experts(scores, bias, top_k, in_order)
    return idx, routing_weights(scores, idx, renormalise, scaling)


def every_expert_up(x: Tensor, up: Tensor) -> Tensor:
    """Every expert's activated up projection of every token: x (T, hidden), up (E, F, hidden) in any layout ->
    relu2 (T, E, F), any layout."""
    e, f, h = up.shape
    if up.stride(0) == f * up.stride(1):  # (E*F, H) is a view: one GEMM for every expert
        return relu2(torch.mm(x, up.view(e * f, h).t())).view(x.shape[0], e, f)
    # strided experts (a budget view, or stored inputs-major): batched, never a copy of them
    return relu2(torch.matmul(x, up.transpose(1, 2))).transpose(0, 1)  # (T, E, F) view of (E, T, F)


def dense_routing(idx: Tensor, weights: Tensor, num_experts: int) -> Tensor:
    """The routing as a dense matrix: idx, weights (T, k) -> (T, E) in weights' dtype, each token's weight
    at its selected experts and zero at the others."""
    return weights.new_zeros(idx.shape[0], num_experts).scatter(1, idx, weights)


def mix_down(act: Tensor, mix: Tensor, down: Tensor, residual: Tensor | None = None) -> Tensor:
    """Scale every expert's activations by its routing weight and project down, summing over experts.

    act: (T, E, F), any layout; mix: (T, E) routing weights in act's dtype (zero for unselected experts);
    down: (E, hidden, F). Returns (T, hidden), plus ``residual`` (T, hidden) when given: one of act's dtype is
    added by the GEMM (one rounding), one of another (a float32 residual stream) after it, promoted. With
    ``down`` stored inputs-major the stacked (E * F, hidden) matrix is a view and this is one GEMM; else a
    batched matmul and a sum over experts.
    """
    t, e, f = act.shape
    act = act * mix.unsqueeze(-1)
    down_t = down.transpose(1, 2)  # (E, F, hidden)
    fused = residual is not None and residual.dtype == act.dtype
    if down_t.is_contiguous():
        flat = act.reshape(t, e * f)
        stacked = down_t.view(e * f, -1)
        if fused:
            return torch.addmm(residual, flat, stacked)
        out = flat @ stacked
    else:
        out = torch.bmm(act.transpose(0, 1), down_t).sum(0)
        if fused:
            return out.add_(residual)
    return out if residual is None else residual + out


def dense_experts(
    x: Tensor, idx: Tensor, weights: Tensor, up: Tensor, down: Tensor, residual: Tensor | None = None
) -> Tensor:
    """Every expert on every token, mixed by the routing (zero for unselected experts): x (T, hidden) in the
    experts' dtype, idx / weights (T, k), up (E, F, hidden), down (E, hidden, F) -> (T, hidden) (+ residual, as
    :func:`mix_down` adds it). The same sum as running only the selected experts (an unselected one adds an
    exact 0), in a handful of large ops."""
    act = every_expert_up(x, up)
    mix = dense_routing(idx, weights, up.shape[0]).to(act.dtype)
    return mix_down(act, mix, down, residual)


# F.grouped_mm has a CPU kernel from torch 2.9 (public name from 2.10); up to 2.10 it required 16-byte
# aligned inputs, which memory-mapped checkpoints do not guarantee.
_HAS_GROUPED_MM: bool = hasattr(F, "grouped_mm") and tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 11)


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

        ``expert_mask`` (E,) with values m in [0, 1] (a 0/1 prefix, or the router's mixture of
        prefixes): selection runs on ``m * (scores + bias)`` and the weights are ``m * scores``,
        renormalised over the selected experts after masking, so a partly masked expert is both
        chosen less often and weighted less. Experts with ``m == 0`` are never selected (their
        selection score is -inf): with a 0/1 mask this is exactly the router of the sliced model,
        even where a kept expert's ``scores + bias`` is negative.
        """
        scores = router_scores(x, self.weight)  # 1.
        choice = scores + self.e_score_correction_bias.float()  # 2.
        if expert_mask is not None:
            m = expert_mask.float()
            choice = torch.where(m > 0, m * choice, -torch.inf)
            scores = scores * m
        if self.n_group > 1:
            t = choice.shape[0]
            grouped = choice.view(t, self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~group_mask.repeat_interleave(grouped.shape[-1], dim=1), -torch.inf)
        idx = choice.topk(self.top_k, dim=-1).indices
        return idx, routing_weights(scores, idx, self.norm_topk_prob, self.scaling)  # 3.


def expert_loop(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    num_experts: int,
    expert: Callable[[Tensor, int], Tensor],
    observer: RoutingObserver | None = None,
    stacked: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """``sum_j weights[:, j] * expert(x, idx[:, j])``, each expert run once on the tokens routed to it.

    x: (T, hidden); idx, weights: (T, k); ``expert(rows, e)``: (n, hidden) -> (n, out) for expert ``e``.
    Assignments are sorted by expert (stably), so expert ``e`` sees one contiguous slice of the gathered
    tokens; its outputs are scaled by their routing weights and summed back per token (``index_add``).
    ``stacked(rows, counts)`` replaces the loop with one call over every expert's slice at once (a grouped
    GEMM; ``counts`` (E,) tokens per expert). ``observer`` gets (idx, weights, output norms (T, k)).
    Returns (T, out).
    """
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    token = order // k
    rows = x[token]
    if stacked is not None:
        ys = stacked(rows, counts)
    else:
        pieces, start = [], 0
        for e, n in enumerate(counts.tolist()):
            if n:
                pieces.append(expert(rows[start : start + n], e))
                start += n
        ys = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[-1])
    if observer is not None:
        norms = torch.empty(t * k, device=x.device, dtype=torch.float32)
        norms[order] = ys.detach().float().norm(dim=-1)
        observer(idx, weights.detach(), norms.view(t, k))
    w = weights.reshape(-1)[order].to(ys.dtype)
    return ys.new_zeros(t, ys.shape[-1]).index_add_(0, token, ys * w[:, None])


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
        e, f, h = self.up_proj.shape
        path = expert_path(t, k, e, f, h)
        if path == "sparse":
            return self._sparse(x, idx, weights, ffn_mask, observer)
        if path == "dense":
            return self._dense(x, idx, weights, ffn_mask, observer)
        return self._grouped(x, idx, weights, ffn_mask, observer)

    def expert(self, x: Tensor, e: int, ffn_mask: Tensor | None = None) -> Tensor:
        """Expert ``e`` on x: (n, hidden) -> (n, hidden). ``up_proj[e]`` / ``down_proj[e]`` are views (no copy,
        also for strided budget views of a wider parent)."""
        act = relu2(F.linear(x, self.up_proj[e]))
        if ffn_mask is not None:
            act = act * ffn_mask.to(act.dtype)
        return F.linear(act, self.down_proj[e])

    def _sparse(
        self, x: Tensor, idx: Tensor, weights: Tensor, ffn_mask: Tensor | None, observer: RoutingObserver | None
    ) -> Tensor:
        """Fewer assignments than experts: run only the selected experts.

        One token reads its routing on the host (``tolist``, a handful of numbers) and adds each selected
        expert's output, scaled, onto the sum; several go through :func:`expert_loop`, which skips the
        experts no token chose.
        """
        t, k = idx.shape
        if t != 1:
            return expert_loop(x, idx, weights, self.num_experts, lambda r, e: self.expert(r, e, ffn_mask), observer)
        ys = [self.expert(x, e, ffn_mask) for e in idx[0].tolist()]
        if observer is not None:
            norms = torch.stack([y.detach().float().norm() for y in ys]).view(1, k)
            observer(idx, weights.detach(), norms)
        out = ys[0] * weights[0, 0].to(ys[0].dtype)
        for j in range(1, k):
            out = out + ys[j] * weights[0, j].to(ys[j].dtype)
        return out

    def _grouped(
        self, x: Tensor, idx: Tensor, weights: Tensor, ffn_mask: Tensor | None, observer: RoutingObserver | None
    ) -> Tensor:
        """Each expert runs on the tokens routed to it (:func:`expert_loop`); on CPU, with torch's grouped
        GEMM, one call per projection over every expert's slice (no loop, no host copy of the counts)."""
        stacked = None
        if _HAS_GROUPED_MM and x.device.type == "cpu":  # CUDA grouped GEMMs want bf16 on recent GPUs

            def stacked(rows: Tensor, counts: Tensor) -> Tensor:
                offs = counts.cumsum(0).to(torch.int32)
                act = relu2(F.grouped_mm(rows, self.up_proj.transpose(1, 2), offs=offs))
                if ffn_mask is not None:
                    act = act * ffn_mask.to(act.dtype)
                return F.grouped_mm(act, self.down_proj.transpose(1, 2), offs=offs)

        expert = lambda r, e: self.expert(r, e, ffn_mask)  # noqa: E731
        return expert_loop(x, idx, weights, self.num_experts, expert, observer, stacked)

    def _dense(
        self,
        x: Tensor,
        idx: Tensor,
        weights: Tensor,
        ffn_mask: Tensor | None,
        observer: RoutingObserver | None,
    ) -> Tensor:
        """Every expert on every token, mixed with the routing weights (zero for unselected experts).

        Same sum as :meth:`_grouped` (an unselected expert adds an exact 0) in a handful of large ops instead
        of sort + bincount + gather + a loop over experts + scatter (:func:`dense_experts`, with the FFN mask and
        the observer between its steps). The routing weights scale the (T, E, F) activations before the down
        projection, so the down projection sums over experts by itself (:func:`mix_down`).
        """
        t = idx.shape[0]
        up, down = self.up_proj, self.down_proj
        act = every_expert_up(x, up)
        if ffn_mask is not None:
            act = act * ffn_mask.to(act.dtype)
        if observer is not None:
            ys = torch.bmm(act.transpose(0, 1), down.transpose(1, 2))  # (E, T, hidden): per expert
            rows = torch.arange(t, device=x.device)[:, None]
            observer(idx, weights.detach(), ys.detach()[idx, rows].float().norm(dim=-1))
        return mix_down(act, dense_routing(idx, weights, self.num_experts).to(act.dtype), down)


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
        """hidden: (..., hidden) -> same. Masks: ``expert_mask`` (E,), ``ffn_mask`` (F,), ``shared_ffn_mask``."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        idx, w = self.gate(x, expert_mask)
        out = self.experts(x, idx, w, ffn_mask, self.observer).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden, shared_ffn_mask)
        return out

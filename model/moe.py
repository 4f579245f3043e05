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

* fewer assignments than experts (``T * k < E``, e.g. a batch-1 decode step) of experts too
  large to read in full: a loop over the selected experts only, each a pair of GEMVs on views
  of the stacked weights (no sort, no scatter, and only the selected experts' bytes are read);
* otherwise, with little arithmetic wasted: every expert on every token, weighted by zero
  where unselected (far fewer ops);
* otherwise assignments are sorted by expert and each expert processes one contiguous
  slice (a loop over experts, never over tokens).

A shared expert sees every token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import HybridConfig
from model.mlp import MLP, relu2, relu2_

RoutingObserver = Callable[[Tensor, Tensor, Tensor], None]
"""Called with (indices (T, k), weights (T, k), expert output L2 norms (T, k)) when set."""

# Few tokens (decoding, short prompts): running every expert on every token is cheaper than grouping
# tokens by expert, as long as the multiply-adds spent on unselected experts stay below this (~0.2 ms of
# one CPU core). At hidden 128 with 8 experts of width 64, top-2, that is up to ~80 tokens; measured there
# at 16 tokens 190 us dense vs 550 us grouped, equal near 128 tokens.
_DENSE_MAX_WASTED_MACS = 1 << 22

# Experts this small (E * F * H weights per projection, 256 KB in float32) cost less to read in full than
# the host round trip and per-expert loop of the sparse path: at 2 tokens x top-2 of 8 experts of 64 x 128,
# 181 us dense vs 559 us sparse. Larger experts with fewer assignments than experts take the sparse path,
# which reads only the selected experts' bytes (at batch 1 on a large model that is what a step costs).
_SMALL_EXPERTS = 1 << 16

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
        w, bias = self.weight, self.e_score_correction_bias
        if x.dtype == w.dtype == bias.dtype == torch.float32:  # no dtype round trips (a decode step is op-bound)
            scores = torch.sigmoid(F.linear(x, w))
            choice = scores + bias
        else:
            scores = torch.sigmoid(x.float() @ w.float().t())
            choice = scores + bias.float()
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
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling if self.scaling != 1.0 else w  # x * 1.0 == x: skip the op

    def decode_mix(self, x: Tensor) -> Tensor:
        """The routing of a decode step as a dense (T, E) matrix: the weights :meth:`forward` gives, placed at
        the chosen experts' columns, zeros elsewhere (what :meth:`Experts._dense` builds from idx and weights).

        For float32 rows, no expert mask and no grouped routing, autograd off; x: (T, hidden). The
        renormalisation and scaling run in place on the gathered weights and the scatter writes straight
        into the mix, so there are no temporaries and no dtype cast; the values equal :meth:`forward`'s up
        to float rounding.
        """
        scores = torch.sigmoid(F.linear(x, self._parameters["weight"]))  # (T, E)
        idx = torch.topk(scores + self._buffers["e_score_correction_bias"], self.top_k, sorted=False).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w.div_(w.sum(-1, keepdim=True).add_(1e-20))
        if self.scaling != 1.0:
            w = w.mul_(self.scaling)
        return torch.zeros_like(scores).scatter_(1, idx, w)


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

    def _expert(self, x: Tensor, e: int, ffn_mask: Tensor | None) -> Tensor:
        """Expert ``e`` on x: (n, hidden) -> (n, hidden). ``up_proj[e]`` / ``down_proj[e]`` are views (no copy,
        also for strided budget views of a wider parent)."""
        params = self._parameters  # not self.up_proj: a module attribute costs a failed lookup first
        act = relu2(F.linear(x, params["up_proj"][e]))
        if ffn_mask is not None:
            act = act * ffn_mask.to(act.dtype)
        return F.linear(act, params["down_proj"][e])

    def _sparse(
        self, x: Tensor, idx: Tensor, weights: Tensor, ffn_mask: Tensor | None, observer: RoutingObserver | None
    ) -> Tensor:
        """Fewer assignments than experts: run only the selected experts (a loop over them).

        The routing is read on the host (``tolist``): a handful of numbers, and the loop needs them as
        Python ints to take views of the selected experts' weights. The weights become Python floats,
        which multiply float32 tensors exactly (a float32 value round-trips through a double).
        """
        t, k = idx.shape
        ids = idx.tolist()
        norms = torch.empty(t, k, device=x.device, dtype=torch.float32) if observer is not None else None
        if t == 1 and not weights.requires_grad:  # a batch-1 decode step: no indexing, direct accumulation
            ws = weights[0].tolist()
            out = None
            for j, e in enumerate(ids[0]):
                y = self._expert(x, e, ffn_mask)
                if norms is not None:
                    norms[0, j] = y.detach().float().norm()
                out = y * ws[j] if out is None else out.add_(y, alpha=ws[j])
        else:
            per_expert: dict[int, list[tuple[int, int]]] = {}
            for ti, row in enumerate(ids):
                for j, e in enumerate(row):
                    per_expert.setdefault(e, []).append((ti, j))
            out = x.new_zeros(t, x.shape[-1])
            for e, pairs in per_expert.items():
                tokens = torch.tensor([ti for ti, _ in pairs], device=x.device)
                slots = torch.tensor([j for _, j in pairs], device=x.device)
                y = self._expert(x[tokens], e, ffn_mask)
                if norms is not None:
                    norms[tokens, slots] = y.detach().float().norm(dim=-1)
                out = out.index_add(0, tokens, y * weights[tokens, slots].to(y.dtype)[:, None])
        if observer is not None:
            observer(idx, weights.detach(), norms)
        return out

    def _grouped(
        self, x: Tensor, idx: Tensor, weights: Tensor, ffn_mask: Tensor | None, observer: RoutingObserver | None
    ) -> Tensor:
        """Each expert runs on the tokens routed to it (assignments sorted by expert, one slice each)."""
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        token = order // k
        xs = x[token]
        if _HAS_GROUPED_MM and x.device.type == "cpu":
            # One grouped GEMM per projection: no loop over experts and no host copy of the counts
            # (forward 2.1 vs 3.3 ms at 1024 tokens x top-2 of 8 experts; backward on par).
            offs = counts.cumsum(0).to(torch.int32)
            h = relu2(F.grouped_mm(xs, self.up_proj.transpose(1, 2), offs=offs))
            if ffn_mask is not None:
                h = h * ffn_mask.to(h.dtype)
            ys = F.grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        else:  # CUDA grouped GEMMs want bf16 on recent GPUs; a loop over expert slices works everywhere
            pieces = []
            start = 0
            for e, n in enumerate(counts.tolist()):
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
        of sort + bincount + gather + a loop over experts + scatter. The routing weights scale the (T, E, F)
        activations before the down projection, so the down projection sums over experts by itself: one
        GEMM over the (E * F) inputs when the stacked ``down_proj`` is stored inputs-major, else a batched
        matmul and a sum.
        """
        t, k = idx.shape
        down = self._parameters["down_proj"]
        e = down.shape[0]
        act = self._every_expert_up(x, relu2)
        if ffn_mask is not None:
            act = act * ffn_mask.to(act.dtype)
        if observer is not None:
            ys = torch.bmm(act.transpose(0, 1), down.transpose(1, 2))  # (E, T, hidden): per-expert outputs
            rows = torch.arange(t, device=x.device)[:, None]
            observer(idx, weights.detach(), ys.detach()[idx, rows].float().norm(dim=-1))
        mix = weights.new_zeros(t, e).scatter_(1, idx, weights).to(act.dtype)  # (T, E)
        return self._mix_down(act, mix)

    def _every_expert_up(self, x: Tensor, activation: Callable[[Tensor], Tensor]) -> Tensor:
        """Every expert's activated up projection of every token: x (T, hidden) -> (T, E, F), any layout."""
        up = self._parameters["up_proj"]
        e, f, h = up.shape
        if up.stride(0) == f * up.stride(1):  # (E*F, H) is a view: one GEMM for every expert
            return activation(torch.mm(x, up.view(e * f, h).t())).view(x.shape[0], e, f)
        # strided experts (a budget view, or stored inputs-major): batched, never a copy of them
        return activation(torch.matmul(x, up.transpose(1, 2))).transpose(0, 1)  # (T, E, F) view of (E, T, F)

    def decode_dense(self, x: Tensor, mix: Tensor, residual: Tensor) -> Tensor:
        """:meth:`_dense` for a decode step, autograd off: x (T, hidden), mix (T, E) from
        :meth:`TopKRouter.decode_mix`, residual (T, hidden) added by the down projection -> (T, hidden).
        The activation runs in place on the fresh GEMM output."""
        return self._mix_down(self._every_expert_up(x, relu2_), mix, residual)

    def _mix_down(self, act: Tensor, mix: Tensor, residual: Tensor | None = None) -> Tensor:
        """Scale every expert's activations by its routing weight and project down, summing over experts.

        act: (T, E, F), any layout; mix: (T, E) routing weights (zero for unselected experts); residual:
        (T, hidden) added by the GEMM when given. Returns (T, hidden). With ``down_proj`` stored
        inputs-major the stacked (E * F, hidden) matrix is a view and this is one GEMM; else a batched
        matmul and a sum over experts.
        """
        t, e, f = act.shape
        act = act * mix.unsqueeze(-1)
        down_t = self._parameters["down_proj"].transpose(1, 2)  # (E, F, hidden)
        if down_t.is_contiguous():
            flat = act.reshape(t, e * f)
            down = down_t.view(e * f, -1)
            return flat @ down if residual is None else torch.addmm(residual, flat, down)
        out = torch.bmm(act.transpose(0, 1), down_t).sum(0)
        return out if residual is None else out.add_(residual)


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

    def decode_step(self, x: Tensor, residual: Tensor) -> Tensor:
        """``residual + forward(x)`` for a decode step without masks, autograd off: x (rows, hidden) -> same.

        With fewer assignments than experts (a batch-1 step) the routing is finished on the host: the
        selected experts' scores are renormalised in Python floats (double precision, then rounded once to
        float32 where they scale an expert's output), and each selected expert's output is added, scaled,
        onto the shared expert's output, itself added onto the residual by its GEMM. Otherwise, or with
        grouped routing, an observer or non-float32 weights, this is :meth:`forward` plus the residual.
        """
        modules = self._modules  # not self.gate etc.: module attributes cost a failed lookup first
        gate, experts, shared = modules["gate"], modules["experts"], modules.get("shared_experts")
        k = gate.top_k
        if (
            k >= gate.num_experts
            or gate.n_group > 1
            or self.observer is not None
            or not isinstance(experts, Experts)  # e.g. quantized experts: their own forward
            or x.dtype != torch.float32
        ):
            return residual + self.forward(x)
        if x.shape[0] != 1:
            return self._decode_rows(x, residual, gate, experts, shared)
        scores = torch.sigmoid(F.linear(x, gate._parameters["weight"]))  # (1, E), float32
        idx = torch.topk(scores + gate._buffers["e_score_correction_bias"], k).indices
        ids = idx.view(-1).tolist()
        w = scores.view(-1).tolist()
        w = [w[e] for e in ids]
        if gate.norm_topk_prob:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        w = [v * gate.scaling for v in w]
        out = residual if shared is None else shared.decode_step(x, residual)
        for e, we in zip(ids, w, strict=True):
            y = experts._expert(x, e, None)
            out = out.add_(y, alpha=we) if out is not residual else torch.add(out, y, alpha=we)
        return out

    def _decode_rows(
        self, x: Tensor, residual: Tensor, gate: TopKRouter, experts: Experts, shared: MLP | None
    ) -> Tensor:
        """:meth:`decode_step` for several rows (T, hidden) -> (T, hidden).

        The shared expert's output, itself on the residual, is the addend of the routed experts: on the
        dense path it is added by their down-projection GEMM.
        """
        e, f, h = experts._parameters["up_proj"].shape
        base = residual if shared is None else shared.decode_step(x, residual)
        if expert_path(x.shape[0], gate.top_k, e, f, h) == "dense":
            return experts.decode_dense(x, gate.decode_mix(x), base)
        idx, w = gate(x)
        return experts(x, idx, w).add_(base)

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

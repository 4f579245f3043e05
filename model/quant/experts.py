"""Quantized routed experts: the stacked ``model.moe.Experts`` with every expert in FP8 or NVFP4.

Design choices:

* One :class:`QuantExpert` per routed expert, registered under its index (``"0"``, ``"1"``, ...),
  each holding two :class:`~model.quant.qlinear.QuantLinear` (``up_proj`` (F, H), ``down_proj``
  (H, F)). The state dict keys are therefore ``experts.{j}.up_proj.weight`` /
  ``.weight_scale`` / ``.weight_scale_2`` / ``.input_scale`` -- the per-expert layout serving
  engines read -- with no renaming step between the module and the file.
* Scales are per expert: FP8 has one weight scale (and one static input scale) per expert
  projection; NVFP4 has one fp32 global scale per expert projection and fp8 block scales of 16
  along the input dimension (H for ``up_proj``, F for ``down_proj``). A per-expert global scale
  keeps a small expert from losing its block-scale range to a large neighbour; slicing the expert
  axis to a prefix never touches it.
* :meth:`QuantExperts.forward` has exactly the contract of :meth:`model.moe.Experts.forward`
  (``ffn_mask`` on the post-activation channels, ``observer`` receiving expert output norms) and
  the same token ordering (stable sort by expert, one contiguous slice per expert, ``index_add_``
  back), so with equal weights the two give the same result and masks / REAP / generation keep
  working on a quantized model.
* Dequantization: on the fly (only the experts a batch routes to are dequantized) or cached
  (each expert's dense weight is kept after first use, in the activation dtype). Measured on CPU
  (``benchmarks/bench_quant_decode.py``, batch-1 decode, see ``benchmarks/RESULTS.md``), caching is
  2.6-6x faster for NVFP4 and 1.3-3.6x for FP8, because unpacking and scaling the codes costs far
  more than the matmuls of one token; it is therefore the default (:data:`DEFAULT_CACHE_DEQUANTIZED`),
  at the price of one dense copy of each used expert. Pass ``cache_dequantized=False`` to keep only
  the quantized bytes resident.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from model.mlp import relu2
from model.moe import Experts, RoutingObserver

from .qlinear import QuantFormat, QuantLinear

__all__ = ["DEFAULT_CACHE_DEQUANTIZED", "QuantExpert", "QuantExperts"]

DEFAULT_CACHE_DEQUANTIZED = True
"""Cache dequantized weights by default (faster decoding on CPU; see the module docstring)."""


class QuantExpert(nn.Module):
    """One routed expert ``down_proj(relu(up_proj(x))^2)`` with quantized, bias-free projections."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        fmt: QuantFormat,
        cache_dequantized: bool = DEFAULT_CACHE_DEQUANTIZED,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        kw = {"bias": False, "fmt": fmt, "cache_dequantized": cache_dequantized, "device": device}
        self.up_proj = QuantLinear(hidden_size, ffn_size, **kw)  # weight (F, H)
        self.down_proj = QuantLinear(ffn_size, hidden_size, **kw)  # weight (H, F)


class QuantExperts(nn.Module):
    """Quantized stacked experts; children ``"0" .. "E-1"`` are :class:`QuantExpert`.

    Args:
        num_experts: E, routed experts.
        hidden_size: H, model width (``up_proj`` input, ``down_proj`` output).
        ffn_size: F, expert intermediate width.
        fmt: ``"fp8"`` or ``"nvfp4"`` (NVFP4 needs H and F multiples of 16).
        cache_dequantized: keep dense copies of used expert weights (see the module docstring).
        device: where to allocate the (zero) buffers; fill them with :meth:`from_experts` or
            ``load_state_dict``.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_size: int,
        fmt: QuantFormat,
        cache_dequantized: bool = DEFAULT_CACHE_DEQUANTIZED,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_size = ffn_size
        self.fmt: QuantFormat = fmt
        for j in range(num_experts):
            self.add_module(str(j), QuantExpert(hidden_size, ffn_size, fmt, cache_dequantized, device))

    # ------------------------------------------------------------------ construction
    @classmethod
    @torch.no_grad()
    def from_experts(
        cls,
        experts: Experts,
        fmt: QuantFormat,
        cache_dequantized: bool = DEFAULT_CACHE_DEQUANTIZED,
        up_input_amax: Tensor | None = None,
        down_input_amax: Tensor | None = None,
    ) -> QuantExperts:
        """Quantize dense stacked experts, each expert and projection with its own scales.

        Args:
            experts: ``up_proj`` (E, F, H) and ``down_proj`` (E, H, F).
            fmt: target format.
            cache_dequantized: see the class.
            up_input_amax / down_input_amax: optional (E,) observed input amax per expert; sets the
                static FP8 ``input_scale`` of every expert's projection (fp8 only).
        """
        e, f, h = experts.up_proj.shape
        q = cls(e, h, f, fmt, cache_dequantized, device=experts.up_proj.device)
        for j in range(e):
            q[j].up_proj.set_weight(experts.up_proj[j].detach())
            q[j].down_proj.set_weight(experts.down_proj[j].detach())
            if up_input_amax is not None:
                q[j].up_proj.calibrate_input_scale(up_input_amax[j])
            if down_input_amax is not None:
                q[j].down_proj.calibrate_input_scale(down_input_amax[j])
        return q

    def __getitem__(self, j: int) -> QuantExpert:
        return self._modules[str(j)]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[QuantExpert]:
        return (self[j] for j in range(self.num_experts))

    def __len__(self) -> int:
        return self.num_experts

    @torch.no_grad()
    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """Dense stacked weights ``(up (E, F, H), down (E, H, F))`` in ``dtype`` (what the forward uses)."""
        up = torch.stack([ex.up_proj.dequantized_weight(dtype) for ex in self])
        down = torch.stack([ex.down_proj.dequantized_weight(dtype) for ex in self])
        return up, down

    def set_cache_dequantized(self, enabled: bool) -> None:
        """Switch caching of dense expert weights on or off (drops existing caches)."""
        for ex in self:
            for lin in (ex.up_proj, ex.down_proj):
                lin.cache_dequantized = enabled
                lin.clear_cache()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        x: Tensor,
        idx: Tensor,
        weights: Tensor,
        ffn_mask: Tensor | None = None,
        observer: RoutingObserver | None = None,
    ) -> Tensor:
        """x: (T, H); idx, weights: (T, k) -> (T, H) = sum_j w_j * expert_j(x).

        ``ffn_mask`` (F,) weights the post-activation channels of every expert (FFN width axis);
        ``observer`` gets (idx, weights, expert output L2 norms (T, k)), as for the dense module.
        """
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
            expert = self[e]
            h = relu2(expert.up_proj(xs[start : start + n]))
            if ffn_mask is not None:
                h = h * ffn_mask.to(h.dtype)
            pieces.append(expert.down_proj(h))
            start += n
        ys = torch.cat(pieces) if pieces else x.new_zeros(0, x.shape[-1])
        if observer is not None:
            norms = torch.empty(t * k, device=x.device, dtype=torch.float32)
            norms[order] = ys.detach().float().norm(dim=-1)
            observer(idx, weights.detach(), norms.view(t, k))
        w = weights.reshape(-1)[order].to(ys.dtype)
        return x.new_zeros(t, x.shape[-1]).index_add_(0, token, ys * w[:, None])

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_size}, fmt={self.fmt}"

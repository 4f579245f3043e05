"""Quantized routed experts: the stacked ``model.moe.Experts`` with every expert in FP8 or NVFP4.

One :class:`QuantExpert` per routed expert, under its index, holding two
:class:`~model.quant.qlinear.QuantLinear` (``up_proj`` (F, H), ``down_proj`` (H, F)), so the state
dict keys are the per-expert ``experts.{j}.up_proj.weight`` layout serving engines read. Scales are
per expert. :meth:`QuantExperts.forward` has the contract and token order of
:meth:`model.moe.Experts.forward`. Dequantized weights are cached after first use by default
(:data:`DEFAULT_CACHE_DEQUANTIZED`; ``cache_dequantized=False`` keeps only the quantized bytes).

Design notes: docs/quantization.md ("Quantized routed experts").
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from model.mlp import relu2
from model.moe import Experts, RoutingObserver, expert_loop

from .qlinear import QuantFormat, QuantLinear

__all__ = ["DEFAULT_CACHE_DEQUANTIZED", "QuantExpert", "QuantExperts"]

DEFAULT_CACHE_DEQUANTIZED = True
"""Cache dequantized weights by default (faster decoding on CPU; figures in ``benchmarks/RESULTS.md``)."""


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
        return getattr(self, str(j))

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

        def expert(rows: Tensor, e: int) -> Tensor:
            h = relu2(self[e].up_proj(rows))
            if ffn_mask is not None:
                h = h * ffn_mask.to(h.dtype)
            return self[e].down_proj(h)

        return expert_loop(x, idx, weights, self.num_experts, expert, observer)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_size}, fmt={self.fmt}"

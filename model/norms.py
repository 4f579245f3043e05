"""RMS norms of the nemotron_h family, with the exact correction for masked channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.masks import NormFraction


def _fraction_terms(fraction: Tensor | NormFraction) -> tuple[Tensor, Tensor]:
    """(eps factor E[p], output scale E[sqrt p]); a bare tensor p is a 0/1 mask's fraction: (p, sqrt p)."""
    if isinstance(fraction, NormFraction):
        return fraction.fraction, fraction.scale
    return fraction, fraction.sqrt()


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` computed in float32, cast back to the input dtype.

    With ``fraction`` = p (the alive share of channels, the rest being exact zeros),
    the result equals the norm of the sliced vector: eps becomes ``eps * p`` and the
    output is multiplied by ``sqrt(p)``. A :class:`~model.masks.NormFraction` (a soft mask)
    gives ``eps * E[p]`` and the output scale ``E[sqrt p]``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor, fraction: Tensor | NormFraction | None = None) -> Tensor:
        """x: (..., hidden) -> (..., hidden)."""
        if fraction is None and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # Same arithmetic in the same order (pow, mean, +eps, rsqrt, two products) through one call:
            # fewer Python-level ops, which is most of a norm's cost when decoding one token.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True)
        if fraction is None:
            h = h * torch.rsqrt(var + self.eps)
        else:
            p, scale = _fraction_terms(fraction)
            h = h * torch.rsqrt(var + self.eps * p) * scale
        return (self.weight.float() * h).to(dtype)


class GatedGroupRMSNorm(nn.Module):
    """Mamba2's gated norm: RMS-normalise ``y * silu(z)`` per group of ``group_size`` channels.

    ``fraction`` is the alive share of heads in every group (the same k per group), or a
    :class:`~model.masks.NormFraction` for a soft head mask (as in :class:`RMSNorm`).
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: Tensor, z: Tensor, fraction: Tensor | NormFraction | None = None) -> Tensor:
        """y, z: (..., d_inner) -> (..., d_inner)."""
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        if fraction is None and self.group_size == h.shape[-1] and dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(h, self.weight.shape, self.weight, self.eps)  # one group: the plain norm
        shape = h.shape
        h = h.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        if fraction is None:
            h = F.rms_norm(h, (self.group_size,), None, self.eps)  # same arithmetic, fewer calls (RMSNorm)
        else:
            var = h.pow(2).mean(-1, keepdim=True)
            p, scale = _fraction_terms(fraction)
            h = h * torch.rsqrt(var + self.eps * p) * scale
        return self.weight * h.view(shape).to(dtype)

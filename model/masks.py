"""Prefix masks that make the full model compute a smaller nested sub-model.

A mask multiplies activations channel-wise. Hard masks hold 0/1 (one
architecture); soft masks hold a mixture of prefix masks (``sum_k p_k * prefix_k``,
values in [0, 1], non-increasing) for the budget router. Every field is optional:
``None`` means "that axis is full", and costs nothing in the forward pass.

Norm correction: a pre-norm over a vector whose fraction ``p`` of channels is
alive must equal the norm of the sliced vector, which is
``sqrt(p) * x / sqrt(mean_full(x^2) + eps * p)``. ``active_fraction`` gives what every
norm needs: ``E[p]`` for the eps (the mean of the mask) and ``E[sqrt p]`` for the output
scale. For a soft mask the two differ (``sqrt(E[p]) >= E[sqrt p]``); the router's mixture
is a mixture of sliced models, each scaled by its own ``sqrt(p)``, so the output scale is
the expectation of those. It is read off the mask itself: a mixture of prefix masks is
non-increasing, and the drop from entry j-1 to entry j is the probability that exactly j
entries are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor


@dataclass
class LayerMask:
    """Masks of one layer; each tensor multiplies the named activation.

    Shapes: ``mamba_heads`` (mamba_num_heads,), ``attn_heads`` (num_attention_heads,),
    ``ffn`` (intermediate width of the dense MLP or of every routed expert),
    ``shared_ffn`` (shared-expert width), ``experts`` (n_routed_experts,),
    ``keep`` () scalar gate on the whole layer's residual update (depth).
    """

    mamba_heads: Tensor | None = None
    attn_heads: Tensor | None = None
    ffn: Tensor | None = None
    shared_ffn: Tensor | None = None
    experts: Tensor | None = None
    keep: Tensor | None = None


@dataclass
class ModelMask:
    """Masks of the whole model: ``hidden`` (hidden_size,) and one :class:`LayerMask` per layer."""

    hidden: Tensor | None = None
    layers: list[LayerMask] = field(default_factory=list)

    def layer(self, index: int) -> LayerMask | None:
        return self.layers[index] if index < len(self.layers) else None


class NormFraction(NamedTuple):
    """What a masked norm needs: ``fraction`` = E[p] () scales eps, ``scale`` = E[sqrt p] () scales the output.

    For a 0/1 mask both are exact: ``p`` and ``sqrt(p)``.
    """

    fraction: Tensor
    scale: Tensor


def active_fraction(mask: Tensor | None, groups: int = 1) -> NormFraction | None:
    """E[p] and E[sqrt p] of the alive fraction ``p`` of a (possibly soft) mask; ``None`` for a full axis.

    ``mask``: (n,), a 0/1 prefix mask or a mixture of prefix masks (values non-increasing), or, with
    ``groups`` > 1, such a mask repeated per group (group-major, (groups * n_per_group,)). With
    ``m[n] = 0``, ``P(p = j / n) = m[j - 1] - m[j]``, so ``E[sqrt p] = sum_j (m[j-1] - m[j]) sqrt(j / n)``
    (differentiable in the mask). E[p] is the mean of the mask.
    """
    if mask is None:
        return None
    m = mask.float().reshape(groups, -1)  # (groups, n): the same prefix mixture in every group
    n = m.shape[-1]
    drop = m - torch.cat([m[:, 1:], m.new_zeros(groups, 1)], dim=-1)  # (groups, n): P(exactly j + 1 kept)
    root = (torch.arange(1, n + 1, device=m.device, dtype=m.dtype) / n).sqrt()
    return NormFraction(fraction=mask.mean(), scale=(drop * root).sum(-1).mean())


def prefix_mask(size: int, keep: int, device: torch.device | None = None, dtype=torch.float32) -> Tensor:
    """(size,) with ones on the first ``keep`` entries, zeros after."""
    m = torch.zeros(size, device=device, dtype=dtype)
    m[:keep] = 1.0
    return m


def grouped_prefix_mask(
    n_heads: int, n_groups: int, keep_per_group: int, device: torch.device | None = None, dtype=torch.float32
) -> Tensor:
    """(n_heads,) keeping the first ``keep_per_group`` heads inside every group (heads are group-major)."""
    per = n_heads // n_groups
    return prefix_mask(per, keep_per_group, device, dtype).repeat(n_groups)

"""Prefix masks that make the full model compute a smaller nested sub-model.

A mask multiplies activations channel-wise. Hard masks hold 0/1 (one
architecture); soft masks hold a mixture of prefix masks (``sum_k p_k * prefix_k``,
values in [0, 1], non-increasing) for the budget router. Every field is optional:
``None`` means "that axis is full", and costs nothing in the forward pass.

Norm correction: a pre-norm over a vector whose fraction ``p`` of channels is
alive must equal the norm of the sliced vector, which is
``sqrt(p) * x / sqrt(mean_full(x^2) + eps * p)``. ``active_fraction`` gives the
``p`` used by every norm (the mean of the mask, i.e. the expected fraction for a
soft mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def active_fraction(mask: Tensor | None) -> Tensor | None:
    """Fraction of alive channels ``p`` of a (possibly soft) mask: its mean. ``None`` for a full axis."""
    return None if mask is None else mask.mean()


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

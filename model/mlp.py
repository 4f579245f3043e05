"""Dense squared-ReLU MLP (nemotron_h '-' layers and the MoE shared expert)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def relu2(x: Tensor) -> Tensor:
    """Squared ReLU."""
    return F.relu(x).square()


class MLP(nn.Module):
    """``down_proj(relu(up_proj(x))^2)``; input/output (..., hidden)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor, ffn_mask: Tensor | None = None) -> Tensor:
        """``ffn_mask`` (intermediate,) weights the post-activation channels (FFN width axis)."""
        h = relu2(self.up_proj(x))
        if ffn_mask is not None:
            h = h * ffn_mask.to(h.dtype)
        return self.down_proj(h)

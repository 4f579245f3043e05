"""Dense squared-ReLU MLP (nemotron_h '-' layers and the MoE shared expert)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from model.fastops import linear


def relu2(x: Tensor) -> Tensor:
    """Squared ReLU."""
    return F.relu(x).square()


def relu2_(x: Tensor) -> Tensor:
    """Squared ReLU in place, for a fresh tensor autograd does not track (a decode step's GEMM output)."""
    return x.relu_().square_()


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

    def decode_step(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """``forward(x)`` (+ ``residual``) without a mask, autograd off: x (rows, hidden) -> (rows, hidden).

        The activation is squared in place (it is a fresh tensor) and the residual is added by the down
        projection's GEMM.
        """
        modules = self._modules  # not self.up_proj: a module attribute costs a failed lookup first
        return linear(modules["down_proj"], relu2_(linear(modules["up_proj"], x)), residual)

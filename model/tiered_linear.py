"""Linear layers whose rows (or input columns) are stored in another order than the caller's.

The storage of :mod:`model.nested_layout` (Mamba projections laid out tier by tier, so every budget's
rows are one prefix): a layer reads a prefix of its storage with one GEMM and gathers its outputs (or its
inputs) into the caller's order with one ``index_select``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.split_linear import param


class _Tiered(nn.Module):
    """What both tiered layers hold: the (prefix) storage view ``weight_t``, a bias, the caller-order
    gather ``order`` (None: identity) and, under ``index_name``, the original index of every storage
    position (a nested view of this layer builds its own prefix and order from it)."""

    def __init__(self, weight_t: Tensor, bias: Tensor | None, order: Tensor | None, index_name: str, index: Tensor):
        super().__init__()
        self.weight_t = param(weight_t)
        self.register_parameter("bias", param(bias) if bias is not None else None)
        self.register_buffer("order", order, persistent=False)
        self.register_buffer(index_name, index, persistent=False)
        self.in_features = weight_t.shape[0]
        self.out_features = weight_t.shape[1]


class TieredRows(_Tiered):
    """A linear layer whose output rows are stored tier by tier: ``y = (x @ W + b)[..., order]``.

    ``weight_t``: (in, n) view of the (in, total) inputs-major storage, whose column j holds output row
    ``storage_rows[j]`` of the original (out, in) weight; ``bias``: (n,) in storage order or None; ``order``:
    (out,) position in the prefix of each output in the caller's order, or None when they coincide.
    x: (..., in) -> (..., out).
    """

    def __init__(self, weight_t: Tensor, bias: Tensor | None, order: Tensor | None, storage_rows: Tensor) -> None:
        super().__init__(weight_t, bias, order, "storage_rows", storage_rows)
        if order is not None:
            self.out_features = order.numel()

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        params = self._parameters
        w, b = params["weight_t"], params["bias"]
        y = torch.mm(x2, w) if b is None else torch.addmm(b, x2, w)
        order = self._buffers["order"]
        if order is not None:
            y = y.index_select(1, order)
        return y if x.dim() == 2 else y.view(*lead, -1)


class TieredCols(_Tiered):
    """A linear layer whose input columns are stored tier by tier: ``y = x[..., order] @ W + b``.

    ``weight_t``: (n, out) view of the (total, out) inputs-major storage, whose row j holds input column
    ``storage_cols[j]`` of the original weight; ``order``: (n,) index into the caller's input for each
    storage row, or None when they coincide; ``bias``: (out,) or None. x: (..., n) -> (..., out).
    """

    def __init__(self, weight_t: Tensor, bias: Tensor | None, order: Tensor | None, storage_cols: Tensor) -> None:
        super().__init__(weight_t, bias, order, "storage_cols", storage_cols)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x: (..., n) -> (..., out), plus ``residual`` (same shape as the output) when given, which is
        the GEMM's addend (with the bias)."""
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        order = self._buffers["order"]
        if order is not None:
            x2 = x2.index_select(1, order)
        params = self._parameters
        w, b = params["weight_t"], params["bias"]
        base = residual if residual is None or x.dim() == 2 else residual.reshape(x2.shape[0], -1)
        if b is not None:
            base = b if base is None else base + b
        y = torch.mm(x2, w) if base is None else torch.addmm(base, x2, w)
        return y if x.dim() == 2 else y.view(*lead, -1)


__all__ = ["TieredCols", "TieredRows"]

"""Linear layers whose weights are views of runs of rows (or columns) of one parent ``nn.Linear``.

A budget keeping k of the H/G heads of every group keeps G row runs of a projection (or G column runs
of the output projection). No 2-D view covers such a pattern, so :func:`row_linear` and
:func:`col_linear` return a plain ``nn.Linear`` over a view when the kept rows / columns are one run,
and otherwise a :class:`RowSplitLinear` / :class:`ColSplitLinear` over one 2-D view per run: one GEMM
per run, outputs concatenated (rows) or summed (columns). Nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.elastic.slicing import index_runs


def param(t: Tensor) -> nn.Parameter:
    """A frozen parameter around ``t`` (a view stays a view)."""
    return nn.Parameter(t, requires_grad=False)


class RowSplitLinear(nn.Module):
    """``cat([x @ W_i^T + b_i])`` over row runs ``W_i`` (views) of one parent weight.

    x: (..., in) -> (..., sum of the runs' rows).
    """

    def __init__(self, weights: Sequence[Tensor], biases: Sequence[Tensor] | None = None) -> None:
        super().__init__()
        self.weights = nn.ParameterList([param(w) for w in weights])
        self.biases = nn.ParameterList([param(b) for b in biases]) if biases else None
        self.in_features = weights[0].shape[1]
        self.out_features = sum(w.shape[0] for w in weights)
        # the same parameters as a plain list: iterating a ParameterList costs a module lookup per item
        biases_or_none = self.biases if self.biases is not None else [None] * len(weights)
        self.runs = list(zip(self.weights, biases_or_none, strict=True))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([F.linear(x, w, b) for w, b in self.runs], dim=-1)


class ColSplitLinear(nn.Module):
    """``sum_i x_i @ W_i^T + b`` with ``x`` split along its last dim to the column runs ``W_i`` (views).

    x: (..., sum of the runs' columns) -> (..., out).
    """

    def __init__(self, weights: Sequence[Tensor], bias: Tensor | None = None) -> None:
        super().__init__()
        self.weights = nn.ParameterList([param(w) for w in weights])
        self.bias = param(bias) if bias is not None else None
        self.sizes = [w.shape[1] for w in weights]
        self.in_features = sum(self.sizes)
        self.out_features = weights[0].shape[0]
        self.runs = list(self.weights)  # plain list, as RowSplitLinear.runs

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x: (..., in) -> (..., out); plus ``residual`` (same shape as the output) when given.

        The bias, the residual and the runs before are each GEMM's addend (``F.linear``'s bias argument).
        """
        out = residual
        if self.bias is not None:
            out = self.bias if out is None else out + self.bias
        for piece, w in zip(x.split(self.sizes, dim=-1), self.runs, strict=True):
            out = F.linear(piece, w, out)
        return out


def row_linear(lin: nn.Linear, rows: Tensor | None, h: int) -> nn.Module:
    """``lin`` restricted to ``rows`` (None: all) and the first ``h`` input columns, as views."""
    w = lin.weight.detach()[:, :h]
    bias = lin.bias.detach() if lin.bias is not None else None
    blocks = [(0, w.shape[0])] if rows is None else index_runs(rows)
    ws = [w.narrow(0, start, n) for start, n in blocks]
    bs = [bias.narrow(0, start, n) for start, n in blocks] if bias is not None else None
    if len(ws) > 1:
        return RowSplitLinear(ws, bs)
    out = nn.Linear(h, ws[0].shape[0], bias=bs is not None, device="meta")
    out.weight = param(ws[0])
    if bs is not None:
        out.bias = param(bs[0])
    return out


def col_linear(lin: nn.Linear, cols: Tensor | None, h: int) -> nn.Module:
    """``lin`` restricted to its first ``h`` output rows and to the input columns ``cols``, as views."""
    w = lin.weight.detach()[:h]
    bias = lin.bias.detach()[:h] if lin.bias is not None else None
    blocks = [(0, w.shape[1])] if cols is None else index_runs(cols)
    ws = [w.narrow(1, start, n) for start, n in blocks]
    if len(ws) > 1:
        return ColSplitLinear(ws, bias)
    out = nn.Linear(ws[0].shape[1], h, bias=bias is not None, device="meta")
    out.weight = param(ws[0])
    if bias is not None:
        out.bias = param(bias)
    return out

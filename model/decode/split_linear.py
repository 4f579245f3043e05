"""Linear layers whose weights are views of index blocks of one parent ``nn.Linear``.

A budget keeping k of the H/G heads of every group keeps G row blocks of a projection (or G column
blocks of the output projection). No 2-D view covers such a block pattern, so :func:`row_linear` and
:func:`col_linear` return a plain ``nn.Linear`` over a view when the kept rows / columns are one
prefix, and otherwise a :class:`RowSplitLinear` / :class:`ColSplitLinear`: every run of equal blocks
at a constant spacing becomes one strided 3-D view applied as one batched matmul. Nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def param(t: Tensor) -> nn.Parameter:
    """A frozen parameter around ``t`` (a view stays a view)."""
    return nn.Parameter(t, requires_grad=False)


def runs(index: Tensor) -> list[tuple[int, int]]:
    """Maximal contiguous runs of a 1-D index as (start, length): ``[0,1,2,8,9] -> [(0,3), (8,2)]``."""
    idx = index.tolist()
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def regular_groups(blocks: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Consecutive runs of equal length at a constant spacing, as (start, length, spacing, count).

    ``[(0, 4), (8, 4), (16, 4), (40, 2)] -> [(0, 4, 8, 3), (40, 2, 0, 1)]``. Kept heads form such
    groups: the first k heads of every group of a group-major layout are G runs of k * head_dim rows,
    one group-size apart, so one strided 3-D view covers all G of them.
    """
    out: list[tuple[int, int, int, int]] = []
    for start, length in blocks:
        if out:
            s0, n0, step, count = out[-1]
            nxt = s0 + step * count
            if n0 == length and (count == 1 and start >= s0 + n0 or count > 1 and start == nxt):
                out[-1] = (s0, n0, start - s0 if count == 1 else step, count + 1)
                continue
        out.append((start, length, 0, 1))
    return out


def _block_view(t: Tensor, dim: int, group: tuple[int, int, int, int]) -> Tensor:
    """The runs ``group`` of ``t`` along ``dim`` as a view: a narrow for one run, else a strided 3-D view.

    2-D ``t`` along dim 0 (rows): (count, length, cols); along dim 1 (columns): (count, rows, length).
    1-D ``t``: (count, length).
    """
    start, length, step, count = group
    if count == 1:
        return t.narrow(dim, start, length)
    windows = t.narrow(dim, start, step * (count - 1) + length).unfold(dim, length, step)
    if t.dim() == 1:
        return windows  # (count, length)
    return windows.transpose(1, 2) if dim == 0 else windows.transpose(0, 1)


_SPAN_MIN_KEPT = 0.5
"""Kept share of the rows a :class:`RowSplitLinear`'s blocks span from which one input row takes one GEMV
over the whole span and a gather of the kept outputs. A one-row product is memory-bound: with the parent
stored inputs-major the span is one block of long rows, while the kept blocks are short strided runs.
With several rows the product is compute-bound and the blocks, which do less arithmetic, stay the path."""


class RowSplitLinear(nn.Module):
    """``cat([x @ W_i^T + b_i])`` over row blocks ``W_i`` (views) of one parent weight.

    A block is either a 2-D (rows, in) view or a strided 3-D (count, rows, in) view of ``count`` equal
    row runs at a constant spacing (see :func:`regular_groups`), applied as one batched matmul: a budget
    keeping k heads of every group runs one matmul per projection part instead of one per group.
    x: (..., in) -> (..., sum of block rows).

    ``span`` (optional): the parent rows from the first kept row to the last as one (span, in) view, its
    bias view (or None) and the positions of the kept rows in it; a single input row then takes one GEMV
    over the span and an ``index_select`` of the kept outputs (see :data:`_SPAN_MIN_KEPT`).
    """

    def __init__(
        self,
        weights: Sequence[Tensor],
        biases: Sequence[Tensor] | None = None,
        span: tuple[Tensor, Tensor | None, Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in weights])
        self.biases = nn.ParameterList([nn.Parameter(b, requires_grad=False) for b in biases]) if biases else None
        self.in_features = weights[0].shape[-1]
        self.out_features = sum(w[..., 0].numel() for w in weights)
        # What forward reads, as plain lists: iterating a ParameterList costs a module attribute lookup per
        # item. Per block: the weight as F.linear takes it (2-D) or transposed for matmul (3-D: (count, in,
        # rows)), and the bias shaped for the block's output, or None. The tensors are views of the weights.
        self._blocks = [
            (w if w.dim() == 2 else w.transpose(1, 2), None if b is None else (b if w.dim() == 2 else b.unsqueeze(1)))
            for w, b in zip(weights, biases if biases else [None] * len(weights), strict=True)
        ]
        # the span's weight and bias are views like _blocks (plain attributes: not parameters counted twice);
        # the kept positions are a buffer, so they follow .to() and count as this module's own bytes
        self._span = None if span is None else (span[0], span[1])
        if span is not None:
            self.register_buffer("span_index", span[2], persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        if rows == 1 and self._span is not None:
            w, b = self._span
            out = F.linear(x2, w, b).index_select(1, self._buffers["span_index"])
            return out if x.dim() == 2 else out.view(*lead, -1)
        outs = []
        for w, b in self._blocks:
            if w.dim() == 2:
                outs.append(F.linear(x2, w, b))
                continue
            y = torch.bmm(x2.expand(w.shape[0], rows, -1), w)  # (count, rows of x, n)
            if b is not None:
                y = y + b
            # one row: (count, 1, n) is already the memory of (1, count * n)
            outs.append(y.view(1, -1) if rows == 1 else y.transpose(0, 1).reshape(rows, -1))
        out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return out if x.dim() == 2 else out.view(*lead, -1)


class ColSplitLinear(nn.Module):
    """``sum_i x_i @ W_i^T + b`` with ``x`` split along its last dim to the column blocks ``W_i`` (views).

    A block is either a 2-D (out, cols) view or a strided 3-D (count, out, cols) view of ``count`` equal
    column runs (one batched matmul and a sum over them). x: (..., sum of block columns) -> (..., out).
    """

    def __init__(self, weights: Sequence[Tensor], bias: Tensor | None = None) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(w, requires_grad=False) for w in weights])
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.sizes = [w.shape[-1] * (w.shape[0] if w.dim() == 3 else 1) for w in weights]
        self.in_features = sum(self.sizes)
        self.out_features = weights[0].shape[-2]
        # plain list of (weight as F.linear takes it, or transposed for addbmm: (count, cols, out)) views, as
        # RowSplitLinear keeps its blocks
        self._blocks = [w if w.dim() == 2 else w.transpose(1, 2) for w in weights]

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x: (..., in) -> (..., out); plus ``residual`` (same shape as the output) when given.

        A strided 3-D block is one ``addbmm`` (the sum over its column runs of ``x_run @ W_run^T``, added
        onto what came before), the bias and the residual are the first block's addend.
        """
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        base = residual if residual is None or x.dim() == 2 else residual.reshape(rows, -1)
        if self.bias is not None:
            base = self.bias.expand(rows, -1) if base is None else base + self.bias
        out = base
        pieces = x2.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (x2,)
        for p, w in zip(pieces, self._blocks, strict=True):
            if w.dim() == 2:
                out = F.linear(p, w, out)  # out (bias, residual, earlier blocks) is the GEMM's addend
                continue
            count, n, _ = w.shape
            # (count, rows of x, n): one row is already that memory; more rows are a strided view
            parts = p.view(count, 1, n) if rows == 1 else p.reshape(rows, count, n).transpose(0, 1)
            out = torch.bmm(parts, w).sum(0) if out is None else torch.addbmm(out, parts, w)
        assert out is not None
        return out if x.dim() == 2 else out.view(*lead, -1)


def row_linear(lin: nn.Linear, rows: Tensor | None, h: int) -> nn.Module:
    """``lin`` restricted to ``rows`` (None: all) and the first ``h`` input columns, as views."""
    w = lin.weight.detach()[:, :h]
    groups = [(0, w.shape[0], 0, 1)] if rows is None else regular_groups(runs(rows))
    ws = [_block_view(w, 0, g) for g in groups]
    bs = [_block_view(lin.bias.detach(), 0, g) for g in groups] if lin.bias is not None else None
    if len(ws) == 1 and ws[0].dim() == 2:
        out = nn.Linear(h, ws[0].shape[0], bias=bs is not None, device="meta")
        out.weight = param(ws[0])
        if bs is not None:
            out.bias = param(bs[0])
        return out
    assert rows is not None  # all rows are one 2-D block
    lo, hi = int(rows.min()), int(rows.max()) + 1
    span = None
    if rows.numel() >= _SPAN_MIN_KEPT * (hi - lo):
        bias = lin.bias.detach()[lo:hi] if lin.bias is not None else None
        span = (w[lo:hi], bias, (rows - lo).to(device=w.device, dtype=torch.long))
    return RowSplitLinear(ws, bs, span)


def col_linear(lin: nn.Linear, cols: Tensor | None, h: int) -> nn.Module:
    """``lin`` restricted to its first ``h`` output rows and to the input columns ``cols``, as views."""
    w = lin.weight.detach()[:h]
    bias = lin.bias.detach()[:h] if lin.bias is not None else None
    groups = [(0, w.shape[1], 0, 1)] if cols is None else regular_groups(runs(cols))
    ws = [_block_view(w, 1, g) for g in groups]
    if len(ws) == 1 and ws[0].dim() == 2:
        out = nn.Linear(ws[0].shape[1], h, bias=bias is not None, device="meta")
        out.weight = param(ws[0])
        if bias is not None:
            out.bias = param(bias)
        return out
    return ColSplitLinear(ws, bias)

"""Small helpers for the single-token decode path, where a step costs what its operators cost to launch.

A batch-1 decode step of a small model runs a few hundred tiny ATen operators; each one costs about a
microsecond of dispatch, far more than its arithmetic. These helpers compute the same functions as the
general modules with fewer dispatches. They assume autograd is off (decode steps run under ``no_grad``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

from model.split_linear import ColSplitLinear, RowSplitLinear
from model.tiered_linear import TieredCols, TieredRows

_EPS: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}


def _eps_tensor(eps: float, like: Tensor) -> Tensor:
    """A (1, 1) tensor holding ``eps`` (the ``input`` of an ``addcmul``), one per (eps, dtype, device)."""
    key = (eps, like.dtype, like.device)
    t = _EPS.get(key)
    if t is None:
        t = _EPS[key] = torch.full((1, 1), eps, dtype=like.dtype, device=like.device)
    return t


def rms_norm_rows(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim of x: (rows, d) -> (rows, d).

    ``mean(x^2) + eps`` is ``n * n / d + eps`` with n the row's Euclidean norm: one ``vector_norm``
    reduction and one ``addcmul`` onto a cached eps, then rsqrt and two products, 5 dispatches where
    ``F.rms_norm`` (a composite on CPU) takes 7. The sum of squares as a GEMV (``addmm`` against a ones
    column) takes as many dispatches but is slower: ``addmm`` first copies its broadcast eps into the
    output. The norm squared differs from ``mean(x^2)`` by float rounding only.
    """
    if x.dim() != 2:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (rows, 1)
    r = torch.addcmul(_eps_tensor(eps, x), n, n, value=1.0 / x.shape[-1]).rsqrt_()
    return x * r if weight is None else torch.mul(x, weight).mul_(r)


def _hooked(module: nn.Module) -> bool:
    """Whether a forward hook watches ``module`` (then it must be called, not its ``forward``)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
    )


def _plain(module: nn.Module) -> bool:
    """A plain :class:`~torch.nn.Linear` that no hook watches (so calling ``forward`` directly is safe)."""
    return type(module) is nn.Linear and not _hooked(module)


def linear(module: nn.Module, x: Tensor, residual: Tensor | None = None) -> Tensor:
    """``module(x)``, plus ``residual`` when given. x: (rows, in); residual: (rows, out).

    A plain :class:`~torch.nn.Linear` without hooks is applied directly (``Module.__call__``'s hook
    bookkeeping costs as much as a small GEMV's dispatch), and without a bias the residual is added by
    the GEMM itself (one operator instead of two). x must be 2-D when ``residual`` is given.
    """
    if _plain(module):
        params = module._parameters  # not module.weight: a module attribute costs a failed lookup first
        weight, bias = params["weight"], params["bias"]
        if residual is None:
            return F.linear(x, weight, bias)
        if bias is None:
            # F.linear on a 2-D input is addmm(bias, x, weight.t()) with any bias that broadcasts to the
            # output, so the residual is added by the GEMM itself, with one call and no transposed view
            return F.linear(x, weight, residual)
        return F.linear(x, weight, bias).add_(residual)
    kind = type(module)
    if (kind is ColSplitLinear or kind is TieredCols) and not _hooked(module):
        return module.forward(x, residual)  # the residual is the (first) GEMM's addend
    if (kind is RowSplitLinear or kind is TieredRows) and not _hooked(module):
        out = module.forward(x)
    else:
        out = module(x)
    return out if residual is None else out + residual


__all__ = ["linear", "rms_norm_rows"]

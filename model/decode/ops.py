"""Operators of the single-token decode step, where a step costs what its operators cost to launch.

A batch-1 decode step of a small model runs a few hundred tiny ATen operators; each costs about a
microsecond of dispatch, more than its arithmetic. These helpers compute what the general modules compute
with fewer dispatches, in any dtype and on any device. They assume autograd is off. They read modules'
parameter dictionaries directly: an ``nn.Module`` attribute that is a parameter or submodule is found only
after the ordinary attribute lookup fails, which costs more than the dictionary read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

from model.decode.kernels import PREPARED, prepared_linear
from model.decode.split_linear import ColSplitLinear, RowSplitLinear

_EPS: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}


def _eps_tensor(eps: float, like: Tensor) -> Tensor:
    """A (1, 1) tensor holding ``eps`` (the ``input`` of an ``addcmul``), one per (eps, dtype, device)."""
    key = (eps, like.dtype, like.device)
    t = _EPS.get(key)
    if t is None:
        t = _EPS[key] = torch.full((1, 1), eps, dtype=like.dtype, device=like.device)
    return t


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``: itself when it already is, without the ``to`` call (an operator dispatch)."""
    return t if t.dtype == dtype else t.to(dtype)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim: x (..., d) -> (..., d), x's dtype.

    ``mean(x^2) + eps`` is ``n * n / d + eps`` with n the Euclidean norm over the last dim, one
    ``vector_norm`` and one ``addcmul`` onto a cached eps, then rsqrt and two products (fewer dispatches
    than ``F.rms_norm``, a composite of about twenty operators on CPU). Other dtypes than float32 are
    normalised in float32 and cast back, as :class:`~model.norms.RMSNorm` does.
    """
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.float()
        weight = None if weight is None else weight.float()
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (rows, 1)
    r = torch.addcmul(_eps_tensor(eps, x), n, n, value=1.0 / x.shape[-1]).rsqrt_()
    out = x * r if weight is None else torch.mul(x, weight).mul_(r)
    return cast(out, dtype)


def hooked(module: nn.Module) -> bool:
    """Whether a forward hook watches ``module`` (then it must be called, not its ``forward``)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
    )


def linear(module: nn.Module, x: Tensor, residual: Tensor | None = None) -> Tensor:
    """``module(x)``, plus ``residual`` when given. x: (rows, in); residual: (rows, out), any float dtype.

    A plain :class:`~torch.nn.Linear` (or split projection) without hooks is applied directly, skipping
    ``Module.__call__``'s hook bookkeeping; a residual of the output's dtype is added by the GEMM itself
    (the addend of ``addmm``), one of another dtype (a float32 residual stream) after it, promoted.
    """
    kind = type(module)
    fuse = residual is not None and residual.dtype == x.dtype
    if kind is nn.Linear and not hooked(module):
        if PREPARED in module.__dict__:  # a copy for the kernel measured fastest (model.decode.kernels)
            out = prepared_linear(module, x, residual)
            if out is not None:
                return out
        params = module._parameters
        weight, bias = params["weight"], params["bias"]
        if fuse and bias is None:
            return F.linear(x, weight, residual)  # addmm(residual, x, weight.t()): one call
        out = F.linear(x, weight, bias)
    elif (kind is ColSplitLinear or kind is RowSplitLinear) and not hooked(module):
        if PREPARED in module.__dict__:  # one GEMM on the runs joined (model.decode.kernels)
            out = prepared_linear(module, x, residual)
            if out is not None:
                return out
        if kind is ColSplitLinear and fuse:
            return module.forward(x, residual)  # the residual is the first block's addend
        out = module.forward(x)
    else:  # quantized or hooked projections: their own call, whose output a hook may hold
        out = module(x)
        return out if residual is None else residual + out
    if residual is None:
        return out
    return out.add_(residual) if fuse else residual + out  # out is a fresh tensor here


__all__ = ["cast", "hooked", "linear", "rms_norm"]

"""FP8 E4M3 weight and activation quantization (pure-PyTorch reference).

Weights: one fp32 scale per tensor, ``scale = amax(|w|) / 448`` (1.0 for all zeros),
``q = fp8(clamp(w / scale, -448, 448))``. Activations: a static per-tensor scale calibrated from an
observed running amax (:class:`AmaxObserver`, :func:`calibrate_input_scale`), applied by
:func:`fake_quantize_fp8_activation`.

The format's precision: docs/quantization.md ("FP8 (E4M3)").
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "FP8_E4M3_MAX",
    "FP8_DTYPE",
    "AmaxObserver",
    "calibrate_input_scale",
    "dequantize_fp8",
    "fake_quantize_fp8_activation",
    "quantize_fp8",
]

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite E4M3 magnitude: 2^8 * 1.75 (== torch.finfo(torch.float8_e4m3fn).max).
FP8_E4M3_MAX = 448.0


def _check_float(x: Tensor, what: str) -> None:
    """Reject integer / bool / complex inputs with a message naming the argument."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")


def _check_finite(x: Tensor, what: str) -> None:
    """Non-finite values would poison the per-tensor amax (and hence every element's scale)."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} of shape {tuple(x.shape)} contains NaN or infinite values")


def _scale_from_amax(amax: Tensor) -> Tensor:
    """fp32 scalar ``amax / 448``, or 1.0 when ``amax == 0`` (a zero scale would divide by zero)."""
    amax = amax.to(torch.float32)
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


def quantize_fp8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize a tensor to FP8 E4M3 with one per-tensor scale.

    Args:
        w: floating-point tensor of any shape ``S`` (typically a weight ``(out, in)``).

    Returns:
        ``(q, scale)``: ``q`` is ``float8_e4m3fn`` of shape ``S``; ``scale`` is an fp32 scalar tensor
        (shape ``()``) equal to ``amax(|w|) / 448`` (1.0 for an all-zero or empty tensor), so that
        ``w ~= q.float() * scale``.
    """
    _check_float(w, "quantize_fp8: w")
    _check_finite(w, "quantize_fp8: w")
    w32 = w.detach().to(torch.float32)
    amax = w32.abs().amax() if w32.numel() > 0 else torch.zeros((), device=w32.device)
    scale = _scale_from_amax(amax)
    # amax / (amax / 448) can come out a few ulp above 448 in fp32; clamping keeps the cast from
    # producing NaN (float8_e4m3fn has no infinity) and pins the largest element to exactly 448.
    q = (w32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: Tensor, scale: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`quantize_fp8`.

    Args:
        q: ``float8_e4m3fn`` tensor of any shape ``S``.
        scale: per-tensor fp32 scale (scalar tensor or float).
        dtype: output dtype.

    Returns:
        Tensor of shape ``S`` and dtype ``dtype`` equal to ``fp32(q) * scale`` (computed in fp32,
        then cast).
    """
    if q.dtype != FP8_DTYPE:
        raise TypeError(f"dequantize_fp8: q must be {FP8_DTYPE}, got {q.dtype}")
    scale_t = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    if scale_t.numel() != 1:
        raise ValueError(f"dequantize_fp8: expected a per-tensor (scalar) scale, got shape {tuple(scale_t.shape)}")
    return (q.to(torch.float32) * scale_t.reshape(())).to(dtype)


def calibrate_input_scale(amax: float | Tensor) -> Tensor:
    """Static activation scale from an observed absolute maximum.

    Args:
        amax: observed ``max(|x|)`` over calibration data (float or scalar tensor, must be >= 0).

    Returns:
        fp32 scalar tensor ``amax / 448``; an amax of 0 (nothing observed but zeros) gives 1.0 so the
        scale is always usable as a divisor.
    """
    amax_t = torch.as_tensor(amax, dtype=torch.float32)
    if amax_t.numel() != 1:
        raise ValueError(f"calibrate_input_scale: amax must be a scalar, got shape {tuple(amax_t.shape)}")
    amax_t = amax_t.reshape(())
    if not bool(torch.isfinite(amax_t)) or float(amax_t) < 0:
        raise ValueError(f"calibrate_input_scale: amax must be finite and >= 0, got {float(amax_t)}")
    return _scale_from_amax(amax_t)


def fake_quantize_fp8_activation(x: Tensor, input_scale: Tensor | float) -> Tensor:
    """Quantize-dequantize an activation with a static per-tensor FP8 scale.

    Values beyond ``448 * input_scale`` saturate (as a real FP8 GEMM input would) instead of turning
    into NaN.

    Args:
        x: floating-point activation of any shape ``S``.
        input_scale: fp32 scalar scale from :func:`calibrate_input_scale`.

    Returns:
        Tensor of shape ``S`` and ``x.dtype`` holding ``fp32(fp8(clamp(x / s))) * s``.
    """
    _check_float(x, "fake_quantize_fp8_activation: x")
    s = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(())
    q = (x.to(torch.float32) / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return (q.to(torch.float32) * s).to(x.dtype)


class AmaxObserver:
    """Running absolute-maximum observer for static activation calibration.

    Feed it the activations a layer sees over a calibration set (``observer.update(x)``), then read
    :attr:`amax` or :meth:`scale`. Non-finite values are ignored so that a single overflowed batch
    cannot make the scale infinite.
    """

    def __init__(self) -> None:
        self._amax: Tensor | None = None
        self.num_updates = 0

    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """Fold ``max(|x|)`` over all elements of ``x`` (any shape) into the running amax."""
        _check_float(x, "AmaxObserver.update: x")
        self.num_updates += 1
        if x.numel() == 0:
            return
        a = x.detach().abs().to(torch.float32)
        a = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax()
        self._amax = a if self._amax is None else torch.maximum(self._amax, a.to(self._amax.device))

    @property
    def amax(self) -> Tensor:
        """fp32 scalar running amax (0.0 before any non-empty update)."""
        if self._amax is None:
            return torch.zeros((), dtype=torch.float32)
        return self._amax.clone()

    def scale(self) -> Tensor:
        """fp32 scalar static input scale ``amax / 448`` (1.0 when nothing but zeros was seen)."""
        return calibrate_input_scale(self.amax.cpu())

    def reset(self) -> None:
        """Forget everything observed so far."""
        self._amax = None
        self.num_updates = 0

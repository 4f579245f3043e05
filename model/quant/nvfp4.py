"""NVFP4 weight quantization (pure-PyTorch reference).

E2M1 codes (magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, sign in bit 3), two a byte (element ``2i``
in the low nibble), with two-level scales along the last (input) dimension: an fp32 global scale
``amax / (6 * 448)`` and an fp8 E4M3 scale per block of 16. Rounding is round-to-nearest-even on the
E2M1 grid, saturating at 6. Shapes: weight (..., in) -> codes uint8 (..., in // 2), block scales
(..., in // 16).

The format, rounding and error bound in full: docs/quantization.md ("NVFP4 (E2M1 with block scales)").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .fp8 import FP8_DTYPE, FP8_E4M3_MAX

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "NVFP4_BLOCK_SIZE",
    "compute_nvfp4_block_scales",
    "decode_e2m1",
    "dequantize_nvfp4",
    "encode_e2m1",
    "fake_quantize_nvfp4_activation",
    "nvfp4_error_bound",
    "nvfp4_global_scale",
    "nvfp4_input_scale",
    "pack_e2m1",
    "quantize_nvfp4",
    "slice_nvfp4",
    "unpack_e2m1",
]

NVFP4_BLOCK_SIZE = 16
E2M1_MAX = 6.0
# Magnitude for each 3-bit index (exponent bits, mantissa bit).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision boundaries between consecutive magnitudes; boundary k sits between index k and k + 1.
_MIDPOINTS: tuple[float, ...] = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:], strict=True))


def _decode_table(device: torch.device) -> Tensor:
    """16-entry fp32 lookup table indexed by the full 4-bit code; entry 8 is -0.0."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    # Negation (rather than multiplying by -1 after the fact) keeps the IEEE sign bit on zero.
    return torch.cat([mags, -mags])


def _check_float(x: Tensor, what: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {x.dtype}")


def _check_codes(codes: Tensor, what: str) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8 E2M1 codes, got dtype {codes.dtype}")
    if codes.numel() > 0 and int(codes.max()) > 15:
        raise ValueError(f"{what} holds values above 15; E2M1 codes are 4-bit")


def _check_weight(w: Tensor, fn: str) -> int:
    """Validate an (..., in) weight and return its number of blocks per row."""
    _check_float(w, f"{fn}: weight")
    if w.dim() < 1:
        raise ValueError(f"{fn}: weight must have at least one dimension, got a scalar")
    in_dim = w.shape[-1]
    if in_dim % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(
            f"{fn}: weight of shape {tuple(w.shape)} has input dimension {in_dim}; the input dimension "
            f"(last) must be a multiple of {NVFP4_BLOCK_SIZE} (NVFP4 block size)"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{fn}: weight of shape {tuple(w.shape)} contains NaN or infinite values")
    return in_dim // NVFP4_BLOCK_SIZE


# ---------------------------------------------------------------------------------------------------
# E2M1 element codec
# ---------------------------------------------------------------------------------------------------


def encode_e2m1(x: Tensor) -> Tensor:
    """Encode values (already divided by their scale) to 4-bit E2M1 codes.

    Round-to-nearest, ties-to-even-index, saturating at +-6; the sign bit is copied from ``x``
    (``torch.signbit``), so -0.0 and small negatives that round to zero give code 8 (negative zero).
    NaN has no E2M1 encoding; its code is unspecified (:func:`quantize_nvfp4` rejects NaN input).
    Inputs are first converted to fp32, so float64 values are rounded once before the E2M1 rounding.

    Args:
        x: floating-point tensor of any shape ``S``.

    Returns:
        uint8 tensor of shape ``S`` with values in ``[0, 15]``.
    """
    _check_float(x, "encode_e2m1: x")
    x32 = x.to(torch.float32)
    mag = x32.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x32.device)
    # bucketize(right=False) counts the boundaries strictly below |x|: the round-half-down index.
    idx = torch.bucketize(mag, mids)
    # Exactly on boundary k the candidates are k and k + 1; ties-to-even picks k + 1 when k is odd.
    on_boundary = mids[idx.clamp(max=len(_MIDPOINTS) - 1)] == mag
    idx = idx + (on_boundary & (idx % 2 == 1)).to(idx.dtype)
    # Values past the last boundary (5) already map to index 7 (= 6.0): saturation is built in.
    sign = torch.signbit(x32).to(torch.uint8)
    return (sign << 3) | idx.to(torch.uint8)


def decode_e2m1(codes: Tensor) -> Tensor:
    """Decode 4-bit E2M1 codes to fp32 values (code 8 decodes to -0.0).

    Args:
        codes: uint8 tensor of any shape ``S`` with values in ``[0, 15]``.

    Returns:
        fp32 tensor of shape ``S``.
    """
    _check_codes(codes, "decode_e2m1: codes")
    return _decode_table(codes.device)[codes.long()]


def pack_e2m1(codes: Tensor) -> Tensor:
    """Pack pairs of 4-bit codes into bytes: element ``2i`` -> low nibble, ``2i + 1`` -> high nibble.

    Args:
        codes: uint8 tensor ``(..., n)`` with ``n`` even and values in ``[0, 15]``.

    Returns:
        uint8 tensor ``(..., n // 2)``.
    """
    _check_codes(codes, "pack_e2m1: codes")
    if codes.dim() < 1 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_e2m1: last dimension must be even, got shape {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_e2m1`.

    Args:
        packed: uint8 tensor ``(..., m)``.

    Returns:
        uint8 codes ``(..., 2 * m)``.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_e2m1: packed must be uint8, got dtype {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError("unpack_e2m1: packed must have at least one dimension")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------------
# Scales
# ---------------------------------------------------------------------------------------------------


def nvfp4_global_scale(w: Tensor) -> Tensor:
    """fp32 scalar ``amax(|w|) / (6 * 448)``, or 1.0 for an all-zero (or empty) tensor."""
    _check_float(w, "nvfp4_global_scale: w")
    w32 = w.detach().to(torch.float32)
    amax = w32.abs().amax() if w32.numel() > 0 else torch.zeros((), device=w32.device)
    return torch.where(amax > 0, amax / (E2M1_MAX * FP8_E4M3_MAX), torch.ones_like(amax))


def nvfp4_input_scale(amax: Tensor | float) -> Tensor:
    """The static global activation scale of NVFP4 W4A4 from an observed activation amax.

    fp32 scalar ``amax / (6 * 448)`` (1.0 for a zero amax), ModelOpt's ``input_scale``: the engines divide
    activations by it before computing the per-block fp8 scales at run time.
    """
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(())
    if not bool(torch.isfinite(a)) or float(a) < 0:
        raise ValueError(f"nvfp4_input_scale: amax must be finite and >= 0, got {float(a)}")
    return torch.where(a > 0, a / (E2M1_MAX * FP8_E4M3_MAX), torch.ones_like(a))


def fake_quantize_nvfp4_activation(x: Tensor, input_scale: Tensor | float) -> Tensor:
    """NVFP4 activation round trip of W4A4: what an FP4 GEMM sees of ``x``.

    ``x`` (..., in), ``in`` a multiple of 16: per block of 16 along the last dimension a dynamic fp8 scale
    ``fp8(amax_block / (6 * input_scale))`` (saturating at 448), elements rounded to E2M1; returns the
    dequantized values in ``x.dtype``, same shape.
    """
    packed, block_scales, g = quantize_nvfp4(x.detach().to(torch.float32), input_scale)
    return dequantize_nvfp4(packed, block_scales, g, torch.float32).to(x.dtype)


def _as_global_scale(global_scale: Tensor | float, device: torch.device) -> Tensor:
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if g.numel() != 1:
        raise ValueError(f"NVFP4 global scale must be a scalar, got shape {tuple(g.shape)}")
    g = g.reshape(())
    if not bool(torch.isfinite(g)) or float(g) <= 0:
        raise ValueError(f"NVFP4 global scale must be finite and > 0, got {float(g)}")
    return g


def compute_nvfp4_block_scales(w: Tensor, global_scale: Tensor | float) -> Tensor:
    """Per-block fp8 scales for a given global scale.

    ``fp8_e4m3(clamp(amax_block / (6 * global_scale), 0, 448))``. With the default global scale the
    clamp is inactive up to fp32 rounding; with a caller-chosen (smaller) global scale it saturates
    the block scale at 448 and the block's elements then saturate at +-6.

    Args:
        w: floating-point weight ``(..., in)``, ``in`` a multiple of 16.
        global_scale: positive fp32 scalar.

    Returns:
        ``float8_e4m3fn`` tensor ``(..., in // 16)``.
    """
    n_blocks = _check_weight(w, "compute_nvfp4_block_scales")
    g = _as_global_scale(global_scale, w.device)
    blocks = w.detach().to(torch.float32).reshape(*w.shape[:-1], n_blocks, NVFP4_BLOCK_SIZE)
    amax_block = blocks.abs().amax(dim=-1)
    # The clamp guards the fp8 cast: float8_e4m3fn has no infinity, so overflow would become NaN.
    return (amax_block / (E2M1_MAX * g)).clamp(0.0, FP8_E4M3_MAX).to(FP8_DTYPE)


def _effective_scale(block_scales: Tensor, global_scale: Tensor) -> Tensor:
    """fp32 ``(..., n_blocks)`` product used identically by encode and decode (bitwise consistency)."""
    return block_scales.to(torch.float32) * global_scale


# ---------------------------------------------------------------------------------------------------
# Quantize / dequantize
# ---------------------------------------------------------------------------------------------------


def quantize_nvfp4(w: Tensor, global_scale: Tensor | float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize a weight to NVFP4.

    Args:
        w: floating-point weight ``(..., in)`` -- ``(out, in)`` for a linear layer or e.g.
            ``(E, out, in)`` for stacked experts; ``in`` must be a multiple of 16.
        global_scale: optional fp32 scalar overriding ``amax(|w|) / (6 * 448)`` (e.g. to share one
            global scale across tensors); block scales are clamped to 448 if it is too small.

    Returns:
        ``(packed, block_scales, global_scale)``: uint8 ``(..., in // 2)``, ``float8_e4m3fn``
        ``(..., in // 16)`` and an fp32 scalar tensor.
    """
    n_blocks = _check_weight(w, "quantize_nvfp4")
    g = nvfp4_global_scale(w) if global_scale is None else _as_global_scale(global_scale, w.device)
    block_scales = compute_nvfp4_block_scales(w, g)
    blocks = w.detach().to(torch.float32).reshape(*w.shape[:-1], n_blocks, NVFP4_BLOCK_SIZE)
    scale = _effective_scale(block_scales, g).unsqueeze(-1)
    # A zero effective scale (all-zero block, or a block so small its fp8 scale underflowed) would give
    # 0/0 = NaN; such blocks decode to zero whatever the codes are, so encode signed zeros.
    scaled = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1.0), blocks * 0.0)
    codes = encode_e2m1(scaled).reshape(w.shape)
    return pack_e2m1(codes), block_scales, g


def _check_packed(packed: Tensor, block_scales: Tensor, fn: str) -> None:
    if packed.dtype != torch.uint8:
        raise TypeError(f"{fn}: packed must be uint8, got dtype {packed.dtype}")
    if block_scales.dtype != FP8_DTYPE:
        raise TypeError(f"{fn}: block_scales must be {FP8_DTYPE}, got dtype {block_scales.dtype}")
    if packed.dim() < 1 or packed.shape[:-1] != block_scales.shape[:-1]:
        raise ValueError(
            f"{fn}: packed {tuple(packed.shape)} and block_scales {tuple(block_scales.shape)} must share "
            "leading dimensions"
        )
    if packed.shape[-1] * 2 != block_scales.shape[-1] * NVFP4_BLOCK_SIZE:
        raise ValueError(
            f"{fn}: packed {tuple(packed.shape)} holds {packed.shape[-1] * 2} elements per row but "
            f"block_scales {tuple(block_scales.shape)} cover {block_scales.shape[-1] * NVFP4_BLOCK_SIZE}"
        )


def dequantize_nvfp4(
    packed: Tensor,
    block_scales: Tensor,
    global_scale: Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_nvfp4`.

    Args:
        packed: uint8 ``(..., in // 2)``.
        block_scales: ``float8_e4m3fn`` ``(..., in // 16)``.
        global_scale: fp32 scalar.
        dtype: output dtype (the product is formed in fp32, then cast).

    Returns:
        Tensor ``(..., in)`` of dtype ``dtype``.
    """
    _check_packed(packed, block_scales, "dequantize_nvfp4")
    g = _as_global_scale(global_scale, packed.device)
    values = decode_e2m1(unpack_e2m1(packed))
    n_blocks = block_scales.shape[-1]
    values = values.reshape(*packed.shape[:-1], n_blocks, NVFP4_BLOCK_SIZE)
    out = values * _effective_scale(block_scales, g).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], n_blocks * NVFP4_BLOCK_SIZE).to(dtype)


def nvfp4_error_bound(w: Tensor, global_scale: Tensor | float | None = None) -> Tensor:
    """Per-element bound on ``|w - dequantize_nvfp4(*quantize_nvfp4(w))|`` from the format definition.

    With ``S`` the effective block scale and ``y = |w| / S``: half the grid spacing around ``y`` times
    ``S`` for ``y <= 6``, exactly ``|w| - 6 S`` (saturation) for ``y > 6``, ``|w|`` when ``S == 0``; plus
    a slack of ``2^-20 * max(|w|, 6 S)`` for fp32 rounding (docs/quantization.md, "NVFP4 (E2M1 with block scales)").

    Args:
        w: floating-point weight ``(..., in)``, ``in`` a multiple of 16.
        global_scale: the same optional override as :func:`quantize_nvfp4`.

    Returns:
        fp32 tensor of ``w``'s shape.
    """
    n_blocks = _check_weight(w, "nvfp4_error_bound")
    g = nvfp4_global_scale(w) if global_scale is None else _as_global_scale(global_scale, w.device)
    mag = w.detach().to(torch.float32).abs().reshape(*w.shape[:-1], n_blocks, NVFP4_BLOCK_SIZE)
    scale = _effective_scale(compute_nvfp4_block_scales(w, g), g).unsqueeze(-1).expand_as(mag)
    y = mag / torch.where(scale > 0, scale, 1.0)
    half_spacing = torch.where(y < 2.0, 0.25, torch.where(y < 4.0, 0.5, 1.0))
    bound = torch.where(y <= E2M1_MAX, half_spacing * scale, mag - E2M1_MAX * scale)
    bound = torch.where(scale > 0, bound, mag)
    bound = bound + 2.0**-20 * torch.maximum(mag, E2M1_MAX * scale)
    return bound.reshape(w.shape)


# ---------------------------------------------------------------------------------------------------
# Nesting: sub-matrices of a quantized weight
# ---------------------------------------------------------------------------------------------------


def slice_nvfp4(
    packed: Tensor,
    block_scales: Tensor,
    out_idx_or_len: int | Sequence[int] | Tensor | None = None,
    in_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Select output rows and an input prefix of an NVFP4 weight without requantizing.

    Blocks never straddle the input prefix when ``in_len`` is a multiple of 16, and the global scale
    is shared, so ``dequantize_nvfp4(*slice_nvfp4(p, s, o, i), g)`` equals
    ``dequantize_nvfp4(p, s, g)[..., o, :i]`` bitwise.

    Args:
        packed: uint8 ``(..., out, in // 2)``.
        block_scales: ``float8_e4m3fn`` ``(..., out, in // 16)``.
        out_idx_or_len: ``None`` (all rows), an int (prefix length) or a 1-D index sequence / tensor
            of output rows (e.g. a channel permutation or ranking).
        in_len: ``None`` (all inputs) or the input-prefix length, a multiple of 16.

    Returns:
        ``(packed, block_scales)`` of shapes ``(..., out', in_len // 2)`` and ``(..., out', in_len // 16)``;
        pass them to :func:`dequantize_nvfp4` with the original global scale.
    """
    _check_packed(packed, block_scales, "slice_nvfp4")
    full_in = packed.shape[-1] * 2
    if in_len is not None:
        if in_len % NVFP4_BLOCK_SIZE != 0 or not 0 <= in_len <= full_in:
            raise ValueError(
                f"slice_nvfp4: in_len={in_len} must be a multiple of {NVFP4_BLOCK_SIZE} (NVFP4 block size) "
                f"in [0, {full_in}]"
            )
        packed = packed[..., : in_len // 2]
        block_scales = block_scales[..., : in_len // NVFP4_BLOCK_SIZE]
    if out_idx_or_len is None:
        return packed, block_scales
    if packed.dim() < 2:
        raise ValueError(f"slice_nvfp4: output slicing needs a 2-D or higher weight, got {tuple(packed.shape)}")
    n_out = packed.shape[-2]
    if isinstance(out_idx_or_len, int):
        if not 0 <= out_idx_or_len <= n_out:
            raise ValueError(f"slice_nvfp4: output prefix {out_idx_or_len} outside [0, {n_out}]")
        return packed[..., :out_idx_or_len, :], block_scales[..., :out_idx_or_len, :]
    idx = torch.as_tensor(out_idx_or_len, dtype=torch.long, device=packed.device)
    if idx.dim() != 1:
        raise ValueError(f"slice_nvfp4: output indices must be 1-D, got shape {tuple(idx.shape)}")
    # Gather the fp8 scales through a uint8 view: index kernels do not cover float8 on every backend.
    scales_u8 = block_scales.view(torch.uint8).index_select(-2, idx.to(block_scales.device))
    return packed.index_select(-2, idx), scales_u8.view(FP8_DTYPE)

"""FP8 E4M3 and NVFP4 formats checked against their definitions.

Expected values are derived independently of the implementation under test: E2M1 values from the
bit layout, rounding from a brute-force nearest-grid-point search, scales from their formulas, and
error bounds from the grid spacing.
"""

from __future__ import annotations

import pytest
import torch

from model.quant import (
    FP8_E4M3_MAX,
    AmaxObserver,
    calibrate_input_scale,
    compute_nvfp4_block_scales,
    decode_e2m1,
    dequantize_fp8,
    dequantize_nvfp4,
    encode_e2m1,
    fake_quantize_fp8_activation,
    nvfp4_error_bound,
    pack_e2m1,
    quantize_fp8,
    quantize_nvfp4,
    slice_nvfp4,
    unpack_e2m1,
)

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_value_from_bits(code: int) -> float:
    """E2M1 per the bit layout: s | ee | m, exponent bias 1, subnormal when ee == 0."""
    sign, exp, man = code >> 3, (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2)
    return -mag if sign else mag


def reference_encode(x: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest grid magnitude, ties to the even index, saturate at 6, sign from signbit."""
    mag = x.abs().clamp(max=6.0).reshape(-1, 1)
    dist = (mag - GRID).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    even = torch.arange(8) % 2 == 0
    # Among the nearest candidates prefer an even index; argmax then picks it.
    idx = (nearest.int() * 2 + (nearest & even).int()).argmax(dim=1)
    sign = torch.signbit(x.reshape(-1)).to(torch.uint8)
    return ((sign << 3) | idx.to(torch.uint8)).reshape(x.shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit pattern, so -0.0 != 0.0 in comparisons."""
    return t.to(torch.float32).contiguous().view(torch.int32)


# ------------------------------------------------------------------------------------------------------
# E2M1 codec
# ------------------------------------------------------------------------------------------------------


def test_every_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor([e2m1_value_from_bits(c) for c in range(16)], dtype=torch.float32)
    assert torch.equal(bits(decode_e2m1(codes)), bits(expected))


def test_negative_zero_preserved():
    decoded = decode_e2m1(torch.tensor([0, 8], dtype=torch.uint8))
    assert decoded.tolist() == [0.0, 0.0]
    assert torch.signbit(decoded).tolist() == [False, True]
    # -0.0 and tiny negatives that round to zero keep the sign bit.
    assert encode_e2m1(torch.tensor([-0.0, -0.1, -0.25, 0.0, 0.1])).tolist() == [8, 8, 8, 0, 0]


def test_encode_grid_values_exact():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(encode_e2m1(decode_e2m1(codes)), codes)


@pytest.mark.parametrize(
    ("x", "expected"),
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_ties_round_to_even(x, expected):
    out = decode_e2m1(encode_e2m1(torch.tensor([x, -x])))
    assert out.tolist() == [expected, -expected]


def test_rounding_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    x = torch.empty(20000).uniform_(-8.0, 8.0, generator=gen)
    mids = (GRID[1:] + GRID[:-1]) / 2
    # Values one ulp either side of each decision boundary are where a wrong comparison would show.
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), mids])
    x = torch.cat([x, near, -near, GRID, -GRID])
    assert torch.equal(encode_e2m1(x), reference_encode(x))


def test_saturation_beyond_six():
    x = torch.tensor([6.0, 6.0001, 7.0, 100.0, 3.0e38, float("inf")])
    assert encode_e2m1(x).tolist() == [7] * 6
    assert encode_e2m1(-x).tolist() == [15] * 6


def test_codec_rejects_bad_dtypes():
    with pytest.raises(TypeError, match="floating-point"):
        encode_e2m1(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="uint8"):
        decode_e2m1(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="4-bit"):
        decode_e2m1(torch.tensor([16], dtype=torch.uint8))


# ------------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------------


def test_packing_order_even_element_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0x3, 0xF], [0x8, 0x0, 0x0, 0x7]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0xF3], [0x08, 0x70]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_pack_unpack_round_trip_and_errors():
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert pack_e2m1(codes).shape == (3, 5, 16)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4-bit"):
        pack_e2m1(torch.full((2,), 16, dtype=torch.uint8))


def test_quantized_codes_are_packed_in_order():
    # One block with a hand-picked pattern: amax 6 -> s_global = 6 / 2688, block scale exactly 448.
    row = torch.tensor([0.5, -1.0, 6.0, 0.0, -0.0, 3.0, 1.5, -6.0] + [0.0] * 8)
    packed, block_scales, global_scale = quantize_nvfp4(row.reshape(1, 16))
    assert block_scales.float().item() == 448.0
    assert packed.shape == (1, 8)
    # (low, high) pairs: (0.5 -> 1, -1 -> 10), (6 -> 7, 0 -> 0), (-0 -> 8, 3 -> 5), (1.5 -> 3, -6 -> 15)
    assert packed[0, :4].tolist() == [0xA1, 0x07, 0x58, 0xF3]
    assert packed[0, 4:].tolist() == [0, 0, 0, 0]
    assert torch.equal(bits(dequantize_nvfp4(packed, block_scales, global_scale)[0]), bits(row))


# ------------------------------------------------------------------------------------------------------
# NVFP4 scales and round trip
# ------------------------------------------------------------------------------------------------------


def test_global_and_block_scales_follow_definition():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 96, generator=gen) * torch.linspace(0.01, 3.0, 96)
    packed, block_scales, global_scale = quantize_nvfp4(w)
    assert packed.shape == (24, 48) and packed.dtype == torch.uint8
    assert block_scales.shape == (24, 6) and block_scales.dtype == torch.float8_e4m3fn
    assert global_scale.shape == () and global_scale.dtype == torch.float32
    assert torch.equal(global_scale, w.abs().max() / (6 * 448))
    amax_block = w.reshape(24, 6, 16).abs().amax(-1)
    expected = (amax_block / (6 * global_scale)).clamp(0, 448).to(torch.float8_e4m3fn)
    assert torch.equal(block_scales.view(torch.uint8), expected.view(torch.uint8))
    # The global scale maps the tensor amax to the top of the fp8 range, so the largest block hits 448.
    assert block_scales.float().max().item() == 448.0


def test_codes_match_reference_encoding():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=gen)
    packed, block_scales, global_scale = quantize_nvfp4(w)
    scale = (block_scales.float() * global_scale).repeat_interleave(16, dim=-1)
    assert torch.equal(unpack_e2m1(packed), reference_encode(w / scale))


def test_block_scale_clamped_with_given_global_scale():
    w = torch.full((2, 32), 1.0)
    w[0, :16] = 10.0
    # amax_block / (6 * g) = 10 / (6 * 1e-3) ~ 1667 > 448 for the first block.
    g = 1e-3
    block_scales = compute_nvfp4_block_scales(w, g)
    assert block_scales.float()[0, 0].item() == 448.0
    expected_other = torch.tensor(1.0 / (6 * g), dtype=torch.float32).to(torch.float8_e4m3fn).float()
    assert block_scales.float()[1, 0].item() == expected_other.item()
    packed, scales, gs = quantize_nvfp4(w, global_scale=g)
    assert torch.equal(scales.view(torch.uint8), block_scales.view(torch.uint8))
    deq = dequantize_nvfp4(packed, scales, gs)
    # The clamped block saturates at 6 * 448 * g; its error is exactly the saturation gap.
    sat = torch.tensor(6.0) * (torch.tensor(448.0) * torch.tensor(g, dtype=torch.float32))
    assert torch.equal(deq[0, :16], sat.expand(16))
    assert (deq - w).abs().le(nvfp4_error_bound(w, global_scale=g)).all()


def test_zero_tensor_and_zero_blocks():
    packed, block_scales, global_scale = quantize_nvfp4(torch.zeros(3, 32))
    assert global_scale.item() == 1.0
    assert not packed.any() and not block_scales.float().any()
    assert torch.equal(dequantize_nvfp4(packed, block_scales, global_scale), torch.zeros(3, 32))

    w = torch.randn(2, 48, generator=torch.Generator().manual_seed(4))
    w[1, 16:32] = 0.0
    packed, block_scales, global_scale = quantize_nvfp4(w)
    assert block_scales.float()[1, 1].item() == 0.0
    assert not unpack_e2m1(packed)[1, 16:32].any()
    deq = dequantize_nvfp4(packed, block_scales, global_scale)
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[1, 16:32], torch.zeros(16))


def definition_bound(w: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing times the effective scale, saturation gap above 6, |w| for a zero scale."""
    scale = (block_scales.float() * global_scale).repeat_interleave(16, dim=-1)
    y = w.abs() / scale.clamp_min(torch.finfo(torch.float32).tiny)
    half_spacing = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    bound = torch.where(y <= 6, half_spacing * scale, w.abs() - 6 * scale)
    bound = torch.where(scale > 0, bound, w.abs())
    # fp32 rounding of w / S and code * S.
    return bound + 2.0**-20 * torch.maximum(w.abs(), 6 * scale)


@pytest.mark.parametrize(
    "shape_and_kind",
    [((64, 128), "normal"), ((8, 32, 64), "normal"), ((48, 256), "heavy_tailed"), ((1, 16), "normal")],
)
def test_round_trip_within_definition_bound(shape_and_kind):
    shape, kind = shape_and_kind
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(shape, generator=gen)
    if kind == "heavy_tailed":
        # Spans ~10 decades so some block scales land in fp8 subnormals or underflow to zero.
        w = w * torch.exp(torch.randn(shape, generator=gen) * 4)
    packed, block_scales, global_scale = quantize_nvfp4(w)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert block_scales.shape == (*shape[:-1], shape[-1] // 16)
    deq = dequantize_nvfp4(packed, block_scales, global_scale)
    assert deq.shape == w.shape
    err = (deq - w).abs()
    assert err.le(definition_bound(w, block_scales, global_scale)).all()
    assert err.le(nvfp4_error_bound(w)).all()
    assert torch.equal(nvfp4_error_bound(w), definition_bound(w, block_scales, global_scale))


def test_dequantize_dtype_is_a_cast_of_fp32():
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(6))
    q = quantize_nvfp4(w)
    assert torch.equal(dequantize_nvfp4(*q, dtype=torch.bfloat16), dequantize_nvfp4(*q).to(torch.bfloat16))


def test_quantize_input_validation():
    with pytest.raises(ValueError, match=r"\(4, 24\).*multiple of 16 \(NVFP4 block size\)"):
        quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.randn(2, 3, 40))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_nvfp4(torch.full((1, 16), float("nan")))
    with pytest.raises(ValueError, match="scalar"):
        quantize_nvfp4(torch.tensor(1.0))
    packed, block_scales, global_scale = quantize_nvfp4(torch.randn(2, 32))
    with pytest.raises(ValueError, match="cover"):
        dequantize_nvfp4(packed[:, :8], block_scales, global_scale)
    with pytest.raises(TypeError, match="float8"):
        dequantize_nvfp4(packed, block_scales.float(), global_scale)


# ------------------------------------------------------------------------------------------------------
# Slicing (nesting)
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_len", [1, 7, 40])
@pytest.mark.parametrize("in_len", [16, 48, 128])
def test_slice_prefix_equals_dequantized_prefix_bitwise(out_len, in_len):
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(7))
    packed, block_scales, global_scale = quantize_nvfp4(w)
    full = dequantize_nvfp4(packed, block_scales, global_scale)
    p, s = slice_nvfp4(packed, block_scales, out_len, in_len)
    assert p.shape == (out_len, in_len // 2) and s.shape == (out_len, in_len // 16)
    assert torch.equal(bits(dequantize_nvfp4(p, s, global_scale)), bits(full[:out_len, :in_len]))


def test_slice_by_index_and_stacked_experts():
    w = torch.randn(3, 24, 64, generator=torch.Generator().manual_seed(8))
    packed, block_scales, global_scale = quantize_nvfp4(w)
    full = dequantize_nvfp4(packed, block_scales, global_scale)
    idx = torch.tensor([5, 0, 23, 7])
    p, s = slice_nvfp4(packed, block_scales, idx, 32)
    assert torch.equal(bits(dequantize_nvfp4(p, s, global_scale)), bits(full[:, idx, :32]))
    p, s = slice_nvfp4(packed, block_scales, None, None)
    assert p is packed and s is block_scales
    with pytest.raises(ValueError, match="multiple of 16"):
        slice_nvfp4(packed, block_scales, 4, 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        slice_nvfp4(packed, block_scales, 4, 80)
    with pytest.raises(ValueError, match="outside"):
        slice_nvfp4(packed, block_scales, 25, 16)


# ------------------------------------------------------------------------------------------------------
# FP8 E4M3
# ------------------------------------------------------------------------------------------------------


def test_fp8_scale_is_amax_over_448():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(9)) * 3
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert torch.equal(scale, w.abs().max() / 448)
    assert q.float().abs().max().item() == FP8_E4M3_MAX
    # The definition: clamp(w / scale) cast with the fp8 round-to-nearest-even conversion.
    assert torch.equal(q.view(torch.uint8), (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_round_trip_within_e4m3_precision():
    gen = torch.Generator().manual_seed(10)
    w = torch.randn(64, 64, generator=gen) * torch.exp(torch.randn(64, 64, generator=gen) * 2)
    q, scale = quantize_fp8(w)
    deq = dequantize_fp8(q, scale)
    # 3 mantissa bits: half an ulp is <= 2^-4 relative for normals (|w / scale| >= 2^-6); below that
    # the subnormal spacing is 2^-9, i.e. an absolute error <= 2^-10 * scale. Small factor: fp32 ops.
    bound = torch.maximum(2.0**-4 * w.abs(), 2.0**-10 * scale) * (1 + 2.0**-16)
    assert (deq - w).abs().le(bound).all()
    assert torch.equal(dequantize_fp8(q, scale, torch.bfloat16), deq.to(torch.bfloat16))


def test_fp8_zero_and_validation():
    q, scale = quantize_fp8(torch.zeros(4, 4))
    assert scale.item() == 1.0 and torch.equal(dequantize_fp8(q, scale), torch.zeros(4, 4))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_fp8(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp8(torch.tensor([1.0, float("inf")]))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_fp8(torch.ones(2), torch.tensor(1.0))


def test_calibrate_input_scale_and_observer():
    assert torch.equal(calibrate_input_scale(3.5), torch.tensor(3.5) / 448)
    assert torch.equal(calibrate_input_scale(torch.tensor(100.0)), torch.tensor(100.0) / 448)
    assert calibrate_input_scale(0.0).item() == 1.0
    with pytest.raises(ValueError, match=">= 0"):
        calibrate_input_scale(-1.0)

    obs = AmaxObserver()
    assert obs.amax.item() == 0.0 and obs.scale().item() == 1.0
    obs.update(torch.tensor([0.5, -2.0]))
    obs.update(torch.tensor([[1.0, float("inf")], [-7.0, 3.0]]))
    obs.update(torch.tensor([4.0]))
    assert obs.amax.item() == 7.0 and obs.num_updates == 3
    assert torch.equal(obs.scale(), torch.tensor(7.0) / 448)
    obs.reset()
    assert obs.amax.item() == 0.0


def test_fake_quantize_activation():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(11))
    s = calibrate_input_scale(x.abs().max())
    y = fake_quantize_fp8_activation(x, s)
    assert y.dtype == x.dtype and y.shape == x.shape
    expected = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    assert torch.equal(y, expected)
    assert (y - x).abs().le(torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) * (1 + 2.0**-16)).all()
    # Out-of-range activations saturate at 448 * s instead of becoming NaN.
    big = fake_quantize_fp8_activation(torch.tensor([1e6, -1e6]), s)
    assert torch.equal(big, torch.tensor([448.0, -448.0]) * s)
    # bf16 activations come back in bf16.
    assert fake_quantize_fp8_activation(x.bfloat16(), s).dtype == torch.bfloat16

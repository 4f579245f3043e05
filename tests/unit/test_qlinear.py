"""QuantLinear and quantize_module: numerics vs. dense Linear, state-dict layout, nesting, presets."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.quant import (
    QUANT_PRESETS,
    QuantLinear,
    calibrate_input_scale,
    dequantize_nvfp4,
    fake_quantize_fp8_activation,
    nvfp4_error_bound,
    quantize_module,
)

FORMATS = ["fp8", "nvfp4"]


def make_linear(in_f: int = 64, out_f: int = 48, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0.0, 0.05)
        if bias:
            lin.bias.normal_(0.0, 0.1)
    return lin


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of the same dtype (also for float8 and 0-d scales)."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def weight_error_bound(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per-element |W - deq(W)| bound from each format's definition."""
    if fmt == "nvfp4":
        return nvfp4_error_bound(weight)
    scale = weight.abs().max() / 448
    return torch.maximum(2.0**-4 * weight.abs(), 2.0**-10 * scale) * (1 + 2.0**-16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_output_close_to_dense_linear(fmt):
    lin = make_linear()
    q = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y_ref, y_q = lin(x), q(x)
        deq = q.dequantized_weight()
    assert y_q.shape == y_ref.shape
    # Exactly a dense matmul with the dequantized weight.
    assert torch.equal(y_q, F.linear(x, deq, lin.bias))
    # |y_q - y| <= sum_j |dW_ij| |x_j| with the definition's per-element weight bound (+ fp32 matmul slack).
    bound = x.abs() @ weight_error_bound(lin.weight.detach(), fmt).T
    slack = 1e-5 * (x.abs() @ lin.weight.detach().abs().T + lin.bias.detach().abs())
    assert (y_q - y_ref).abs().le(bound + slack).all()
    rel = ((y_q - y_ref).norm() / y_ref.norm()).item()
    assert rel < {"fp8": 0.05, "nvfp4": 0.2}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_keys_dtypes_shapes(fmt):
    q = QuantLinear.from_linear(make_linear(), fmt)
    sd = q.state_dict()
    if fmt == "fp8":
        assert set(sd) == {"weight", "weight_scale", "bias"}
        assert sd["weight"].dtype == torch.float8_e4m3fn and sd["weight"].shape == (48, 64)
        assert sd["weight_scale"].dtype == torch.float32 and sd["weight_scale"].shape == ()
        q.set_input_scale(calibrate_input_scale(5.0))
        sd = q.state_dict()
        assert set(sd) == {"weight", "weight_scale", "input_scale", "bias"}
        assert sd["input_scale"].dtype == torch.float32 and sd["input_scale"].shape == ()
    else:
        assert set(sd) == {"weight", "weight_scale", "weight_scale_2", "bias"}
        assert sd["weight"].dtype == torch.uint8 and sd["weight"].shape == (48, 32)
        assert sd["weight_scale"].dtype == torch.float8_e4m3fn and sd["weight_scale"].shape == (48, 4)
        assert sd["weight_scale_2"].dtype == torch.float32 and sd["weight_scale_2"].shape == ()
        assert torch.equal(
            q.dequantized_weight(), dequantize_nvfp4(sd["weight"], sd["weight_scale"], sd["weight_scale_2"])
        )
    no_bias = QuantLinear.from_linear(make_linear(bias=False), fmt)
    assert "bias" not in no_bias.state_dict()


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trip(fmt):
    src = QuantLinear.from_linear(make_linear(), fmt)
    if fmt == "fp8":
        src.set_input_scale(calibrate_input_scale(3.0))
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    # A freshly constructed module (zero buffers, no input_scale yet) must load everything.
    dst = QuantLinear(64, 48, bias=True, fmt=fmt)
    dst.load_state_dict(torch.load(buf, weights_only=True))
    for key, value in src.state_dict().items():
        assert same_bits(dst.state_dict()[key], value), key
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_cached_and_uncached_forward_agree(fmt):
    lin = make_linear()
    plain = QuantLinear.from_linear(lin, fmt, cache_dequantized=False)
    cached = QuantLinear.from_linear(lin, fmt, cache_dequantized=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(cached(x), plain(x))
        assert cached._dequant_cache is not None and plain._dequant_cache is None
        # Reloading new weights must invalidate the cache.
        other = QuantLinear.from_linear(make_linear(seed=9), fmt)
        cached.load_state_dict(other.state_dict())
        assert torch.equal(cached(x), other(x))
        cached.set_weight(lin.weight)
        cached.bias.copy_(lin.bias)
        assert torch.equal(cached(x), plain(x))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize(("in_len", "out_len"), [(32, 16), (48, 48), (40, 7), (64, 1)])
def test_prefix_forward_matches_full_weight_block(fmt, cache, in_len, out_len):
    lin = make_linear()
    q = QuantLinear.from_linear(lin, fmt, cache_dequantized=cache)
    x = torch.randn(3, in_len, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = q.dequantized_weight()
        y = q(x, out_features=out_len)
        expected = F.linear(x, full[:out_len, :in_len], lin.bias[:out_len])
    assert y.shape == (3, out_len)
    assert torch.equal(y, expected)
    assert torch.equal(q.dequantized_weight(out_features=out_len, in_features=in_len), full[:out_len, :in_len])


def test_prefix_out_of_range_rejected():
    q = QuantLinear.from_linear(make_linear(), "nvfp4")
    with pytest.raises(ValueError, match="input width"):
        q(torch.randn(2, 80))
    with pytest.raises(ValueError, match="out_features"):
        q(torch.randn(2, 64), out_features=49)


def test_fp8_input_scale_fake_quantizes_activations():
    lin = make_linear()
    q = QuantLinear.from_linear(lin, "fp8")
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    q.calibrate_input_scale(x.abs().max())
    assert torch.equal(q.input_scale, calibrate_input_scale(x.abs().max()))
    with torch.no_grad():
        expected = F.linear(fake_quantize_fp8_activation(x, q.input_scale), q.dequantized_weight(), lin.bias)
        assert torch.equal(q(x), expected)
        assert ((q(x) - lin(x)).norm() / lin(x).norm()).item() < 0.1
    q.set_input_scale(None)
    assert "input_scale" not in q.state_dict()
    with pytest.raises(ValueError, match="finite and > 0"):
        QuantLinear.from_linear(lin, "nvfp4").set_input_scale(0.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtype_casts_keep_quantized_buffers(fmt):
    q = QuantLinear.from_linear(make_linear(), fmt, cache_dequantized=True)
    before = {k: v.clone() for k, v in q.state_dict().items() if k != "bias"}
    q = q.to(torch.bfloat16)
    for key, value in before.items():
        assert same_bits(q.state_dict()[key], value), key
    assert q.bias.dtype == torch.bfloat16
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = q(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, q.dequantized_weight(torch.bfloat16), q.bias))


def test_constructor_validation():
    with pytest.raises(ValueError, match="multiple of 16"):
        QuantLinear(20, 8, fmt="nvfp4")
    with pytest.raises(ValueError, match="unknown format"):
        QuantLinear(16, 8, fmt="int4")
    q = QuantLinear(16, 8, fmt="fp8")
    with pytest.raises(ValueError, match="expected shape"):
        q.set_weight(torch.randn(8, 32))


# ------------------------------------------------------------------------------------------------------
# quantize_module presets
# ------------------------------------------------------------------------------------------------------


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))


class Mamba(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d)
        self.out_proj = nn.Linear(d, d)


class MoE(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 4, bias=False)
        self.experts = nn.ModuleList(
            nn.ModuleDict({"up_proj": nn.Linear(d, 2 * d), "down_proj": nn.Linear(2 * d, d)}) for _ in range(2)
        )


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, 2 * d)
        self.up_proj = nn.Linear(d, 2 * d)
        self.down_proj = nn.Linear(2 * d, d)


class Toy(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attn(d), Mamba(d), MoE(d), Mlp(d)])
        self.lm_head = nn.Linear(d, 50, bias=False)


EXPERTS = {f"layers.2.experts.{i}.{n}" for i in range(2) for n in ("up_proj", "down_proj")}
MLP = {"layers.3.gate_proj", "layers.3.up_proj", "layers.3.down_proj"}
MAMBA = {"layers.1.in_proj", "layers.1.out_proj"}
ATTN = {f"layers.0.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")}


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("default", EXPERTS | MLP | MAMBA),
        ("conservative", EXPERTS | MLP),
        ("all", EXPERTS | MLP | MAMBA | ATTN),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_module_presets(preset, expected, fmt):
    model = Toy()
    replaced = quantize_module(model, fmt, preset)
    assert set(replaced) == expected
    for name, module in model.named_modules():
        if name in expected:
            assert isinstance(module, QuantLinear) and module.fmt == fmt
        elif name.endswith(("_proj", "gate", "lm_head")):
            assert type(module) is nn.Linear, name
    assert type(model.lm_head) is nn.Linear and type(model.layers[2].gate) is nn.Linear


def test_quantize_module_keeps_outputs_close_and_validates():
    model = Toy()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(6))
    mlp = model.layers[3]
    with torch.no_grad():
        ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        quantize_module(model, "fp8", QUANT_PRESETS["default"])
        out = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert ((out - ref).norm() / ref.norm()).item() < 0.1

    odd = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    with pytest.raises(ValueError, match=r"'2'.*in_features=24.*multiple of 16"):
        quantize_module(odd, "nvfp4", "all")
    with pytest.raises(ValueError, match="unknown preset"):
        quantize_module(Toy(), "fp8", "aggressive")
    with pytest.raises(ValueError, match="unknown format"):
        quantize_module(Toy(), "int8")

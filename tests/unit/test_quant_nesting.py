"""Nesting survives quantization: extract any budget from one quantized checkpoint, bitwise and in logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.checkpoint import WEIGHTS_NAME
from model.config import HybridConfig
from model.elastic import Architecture, extract, hard_mask
from model.elastic.budgets import UnknownBudgetError
from model.elastic.export import read_elastic
from model.quant import (
    QUANT_PRESETS,
    check_nvfp4_alignment,
    dequantize_model,
    extract_quantized_budget,
    load_quantized_budget,
    load_quantized_model,
    quantize_checkpoint,
)
from tests.unit.test_quant_checkpoint import NESTED, build_nested, calib_batches, input_ids

FORMATS = ["fp8", "nvfp4"]
BUDGETS = ["mid", "small"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Nested checkpoints quantized once per (format, preset); "all" also quantizes attention (o_proj gathers)."""
    root = tmp_path_factory.mktemp("qnest")
    src = build_nested(root / "nested")
    out = {}
    for fmt in FORMATS:
        for preset in ("default", "all"):
            out[fmt, preset] = quantize_checkpoint(src, root / f"{fmt}-{preset}", fmt, preset, calib_batches())
    return out


@pytest.fixture(scope="module")
def extracted(quantized) -> dict[tuple[str, str, str], Path]:
    return {
        (fmt, preset, b): extract_quantized_budget(path, b, path.parent / f"{path.name}-{b}")
        for (fmt, preset), path in quantized.items()
        for b in BUDGETS
    }


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize("preset", ["default", "all"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_extract_then_dequantize_equals_dequantize_then_extract(quantized, extracted, fmt, budget, preset):
    info = read_elastic(quantized[fmt, preset])
    full_dense = dequantize_model(load_quantized_model(quantized[fmt, preset]))
    reference = extract(full_dense, info.budget(budget).architecture, info.depth_order).state_dict()
    ours = dequantize_model(load_quantized_model(extracted[fmt, preset, budget])).state_dict()
    assert set(ours) == set(reference)
    bad = [k for k in reference if not same_bits(ours[k], reference[k])]
    assert not bad, bad


@pytest.mark.parametrize("preset", ["default", "all"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_extracted_logits_equal_masked_quantized_full_model(quantized, extracted, fmt, budget, preset):
    info = read_elastic(quantized[fmt, preset])
    full = load_quantized_model(quantized[fmt, preset])
    sub = load_quantized_model(extracted[fmt, preset, budget])
    mask = hard_mask(info.config, info.budget(budget).architecture, info.depth_order)
    ids = input_ids()
    with torch.no_grad():
        masked, alone = full(ids, mask=mask).logits, sub(ids).logits
    torch.testing.assert_close(alone, masked, rtol=1e-5, atol=1e-5)
    # and the in-memory path gives the same model as the written one
    with torch.no_grad():
        assert torch.equal(load_quantized_budget(quantized[fmt, preset], budget)(ids).logits, alone)


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_tensor_scales_untouched_and_blocks_sliced(quantized, extracted, fmt):
    full = file_tensors(quantized[fmt, "all"])
    small = file_tensors(extracted[fmt, "all", "small"])
    per_tensor = ("weight_scale", "input_scale") if fmt == "fp8" else ("weight_scale_2",)
    # small drops layer 3: parent layer 4 is its layer 3, parent layer 5 its layer 4
    pairs = {"backbone.layers.0.mixer.out_proj": "backbone.layers.0.mixer.out_proj",
             "backbone.layers.1.mixer.o_proj": "backbone.layers.1.mixer.o_proj",
             "backbone.layers.5.mixer.experts.1.down_proj": "backbone.layers.4.mixer.experts.1.down_proj",
             "backbone.layers.4.mixer.down_proj": "backbone.layers.3.mixer.down_proj"}  # fmt: skip
    for src, dst in pairs.items():
        for leaf in per_tensor:
            assert same_bits(small[f"{dst}.{leaf}"], full[f"{src}.{leaf}"]), (dst, leaf)
    assert "backbone.layers.4.mixer.experts.2.up_proj.weight" not in small  # experts >= 2 dropped
    assert "backbone.layers.5.mixer.experts.0.up_proj.weight" not in small  # only 5 layers remain
    if fmt == "nvfp4":
        # Mamba out_proj: 2 groups x 32 channels -> the first 16 of each group (whole blocks), 16 of 32 rows
        w, s = small["backbone.layers.0.mixer.out_proj.weight"], small["backbone.layers.0.mixer.out_proj.weight_scale"]
        fw, fs = full["backbone.layers.0.mixer.out_proj.weight"], full["backbone.layers.0.mixer.out_proj.weight_scale"]
        assert w.shape == (16, 16) and s.shape == (16, 2)
        assert torch.equal(w, torch.cat([fw[:16, 0:8], fw[:16, 16:24]], dim=1))
        assert same_bits(s, torch.cat([fs[:16, 0:1], fs[:16, 2:3]], dim=1))


def test_extracted_config(quantized, extracted):
    cfg = json.loads((extracted["nvfp4", "default", "small"] / "config.json").read_text())
    assert "elastic" not in cfg
    assert cfg["hidden_size"] == 16 and cfg["hybrid_override_pattern"] == "M*M-E" and cfg["n_routed_experts"] == 2
    qc = cfg["quantization_config"]
    assert qc["quant_algo"] == "W4A16_NVFP4" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    # layer 3 (dropped) vanishes from the ignore list; layer 5 is renumbered to 4
    assert "backbone.layers.4.mixer.gate" in qc["ignore"] and "backbone.layers.5.mixer.gate" not in qc["ignore"]
    hf = json.loads((extracted["nvfp4", "default", "small"] / "hf_quant_config.json").read_text())
    assert qc["ignore"] == hf["quantization"]["exclude_modules"]
    config = HybridConfig.from_json_file(extracted["nvfp4", "default", "small"] / "config.json")
    assert config.num_hidden_layers == 5


def test_unknown_budget_and_unquantized_source(quantized, tmp_path):
    with pytest.raises(UnknownBudgetError, match="valid budgets"):
        extract_quantized_budget(quantized["fp8", "default"], "huge", tmp_path / "x")
    src = quantized["fp8", "default"].parent / "nested"
    with pytest.raises(ValueError, match="not a quantized checkpoint"):
        extract_quantized_budget(src, "mid", tmp_path / "y")


def test_alignment_check_names_axis_and_width():
    """Grouped Mamba heads of 8 channels: keeping 1 of 2 heads per group keeps 8 of 16 channels a group."""
    config = HybridConfig(**{**NESTED, "mamba_head_dim": 8})
    archs = {"full": Architecture(), "thin": Architecture(mamba_heads=2)}
    with pytest.raises(ValueError, match=r"budget 'thin': mamba_heads=2 keeps 16 input columns .*out_proj"):
        check_nvfp4_alignment(config, archs, None, QUANT_PRESETS["default"])
    check_nvfp4_alignment(config, archs, None, QUANT_PRESETS["conservative"])  # out_proj stays dense: fine
    attn = {"full": Architecture(), "a": Architecture(attn_heads=2)}
    config = HybridConfig(**{**NESTED, "head_dim": 8})
    check_nvfp4_alignment(config, attn, None, QUANT_PRESETS["default"])  # attention is not quantized
    with pytest.raises(ValueError, match="attn_heads=2"):
        check_nvfp4_alignment(config, attn, None, QUANT_PRESETS["all"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_registry_serves_quantized_budgets_at_their_own_size(quantized, fmt):
    """``sliced`` budgets compute what the masked quantized parent computes, from their own smaller tensors,
    through the decode path serving runs (prefill, then cached single-token steps)."""
    from model.decode.budget_view import BudgetRegistry
    from model.generate import SamplingParams, generate

    folder = quantized[fmt, "default"]
    sliced = BudgetRegistry.from_checkpoint(folder, quantized_budgets="sliced")
    masked = BudgetRegistry.from_checkpoint(folder, quantized_budgets="masked")
    assert sliced.names == masked.names
    parent_bytes = sum(t.numel() * t.element_size() for t in sliced.full.state_dict().values())
    prompts = [input_ids()[0, :6].tolist(), input_ids()[1, :9].tolist()]
    for name in BUDGETS:
        a, b = sliced.get(name), masked.get(name)
        assert (a.mode, b.mode) == ("sliced", "masked")
        own = sum(t.numel() * t.element_size() for t in a.state_dict().values())
        assert own < parent_bytes  # its own slice, not the parent
        ids = input_ids()
        with torch.no_grad():
            torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-5, atol=1e-5)
        params = SamplingParams(max_new_tokens=6)
        assert generate(a, prompts, params) == generate(b, prompts, params)
    first = sliced.names[0]
    assert sliced.get(first).mode == "masked"  # the parent's own size: the parent itself

"""Quantized checkpoints as the engines' ModelOpt loaders read them: configs, tensor names, dtypes, shapes.

The table below is written from the loaders' source (vLLM main at c621af16, the commit of upstream PR #45383):
  vllm/model_executor/layers/quantization/modelopt.py
    102-118   QUANT_ALGOS: FP8, NVFP4 (W4A4), W4A16_NVFP4 (weight-only)
    458-505   ModelOptFp8LinearMethod: weight fp8 (out, in), weight_scale / input_scale fp32 per tensor
    1084-1095 NVFP4 hf_quant_config.json must hold group_size, kv_cache_quant_algo, exclude_modules
    1123-1195 ModelOptNvFp4LinearMethod: weight uint8 (out, in/2), input_scale fp32, weight_scale_2 fp32,
              weight_scale fp8 (out, in/group_size)
    1433-1547 ModelOptNvFp4FusedMoE: per-expert w13/w2 weight, weight_scale, weight_scale_2, input_scale
  vllm/model_executor/models/nemotron_h.py 664-680 experts.J.up_proj -> w13 (w1), experts.J.down_proj -> w2
  vllm/model_executor/model_loader/weight_utils.py 1406-1408 mixer.{k,v}_proj.{k,v}_scale -> mixer.attn.*
ModelOpt (a2fbac7b) modelopt/torch/export/quant_utils.py 1583-1705 / 680-789 (hf_quant_config.json) and
convert_hf_config.py 130-282 (config.json quantization_config).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.config import HybridConfig
from model.elastic import ElasticSpace
from model.elastic.budgets import BudgetSet
from model.elastic.export import export_nested
from model.elastic.router import BudgetRouter, RouterConfig
from model.hybrid import HybridLM
from model.quant import extract_quantized_budget, load_quantized_model, quantize_checkpoint
from tests.conftest import TINY

FP8, U8, F32 = "F8_E4M3", "U8", "F32"
# per quantized linear (out, in): leaf -> (dtype, shape)
TABLE = {
    "fp8": {"weight": (FP8, lambda o, i: (o, i)), "weight_scale": (F32, lambda o, i: ()),
            "input_scale": (F32, lambda o, i: ())},
    "nvfp4": {"weight": (U8, lambda o, i: (o, i // 2)), "weight_scale": (FP8, lambda o, i: (o, i // 16)),
              "weight_scale_2": (F32, lambda o, i: ())},
    "nvfp4_w4a4": {"weight": (U8, lambda o, i: (o, i // 2)), "weight_scale": (FP8, lambda o, i: (o, i // 16)),
                   "weight_scale_2": (F32, lambda o, i: ()), "input_scale": (F32, lambda o, i: ())},
}  # fmt: skip
ALGO = {"fp8": "FP8", "nvfp4": "W4A16_NVFP4", "nvfp4_w4a4": "NVFP4"}
CFG = {**TINY, "hidden_size": 32, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 32}


@pytest.fixture(scope="module")
def nested(tmp_path_factory) -> Path:
    parent = HybridLM(HybridConfig(**CFG)).init_weights(7)
    space = ElasticSpace.model_validate({"hidden": [32, 16], "experts": [4, 3], "moe_ffn": [16]})
    budgets = BudgetSet.model_validate(
        {"budgets": [{"name": "full", "fraction": 1.0}, {"name": "small", "fraction": 0.7}]}
    )
    torch.manual_seed(0)
    router = BudgetRouter(parent.config, space, budgets, RouterConfig())
    return export_nested(parent, router, budgets, space, tmp_path_factory.mktemp("n") / "nested", allow_off_target=True)


def headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {k: (fh.get_slice(k).get_dtype(), tuple(fh.get_slice(k).get_shape())) for k in fh.keys()}  # noqa: SIM118


@pytest.mark.parametrize(("fmt", "preset"), [("fp8", "default"), ("nvfp4", "default"), ("nvfp4_w4a4", "default"),
                                             ("nvfp4_w4a4", "nemotron-nano")])  # fmt: skip
def test_configs_and_tensors_match_the_loaders(nested, tmp_path, fmt, preset):
    out = quantize_checkpoint(nested, tmp_path / fmt, fmt, preset)
    hf = json.loads((out / "hf_quant_config.json").read_text())
    q = hf["quantization"]
    assert hf["producer"]["name"] == "modelopt" and q["quant_algo"] == ALGO[fmt]
    assert list(q) == (["quant_algo", "kv_cache_quant_algo", "exclude_modules"] if fmt == "fp8" else
                       ["quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"])  # fmt: skip
    assert q["kv_cache_quant_algo"] == ("FP8" if preset == "nemotron-nano" else None)
    assert q["exclude_modules"] == sorted(q["exclude_modules"]) and "lm_head" in q["exclude_modules"]
    assert all(m == "lm_head" or m.startswith("backbone.") for m in q["exclude_modules"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == ALGO[fmt] and qc["ignore"] == q["exclude_modules"]
    group = qc["config_groups"]["group_0"]
    assert ("input_activations" in group) == (fmt != "nvfp4") and group["targets"] == ["Linear"]
    assert (qc.get("kv_cache_scheme") == {"dynamic": False, "num_bits": 8, "type": "float"}) == (preset != "default")

    t = headers(out)
    quantized = {k[: -len(".weight_scale")] for k in t if k.endswith(".weight_scale")}
    excluded = set(q["exclude_modules"])
    assert quantized and not quantized & excluded
    for name in quantized:
        out_f, in_f = (t[f"{name}.weight"][1][0], None)
        in_f = t[f"{name}.weight"][1][1] * (1 if fmt == "fp8" else 2)
        for leaf, (dtype, shape) in TABLE[fmt].items():
            assert t[f"{name}.{leaf}"] == (dtype, shape(out_f, in_f)), (name, leaf)
        assert f"{name}.input_scale" in t or fmt == "nvfp4"
    experts = [k for k in t if k[-len(".mixer.experts.0.up_proj.weight") :] == ".mixer.experts.0.up_proj.weight"]
    assert experts  # per expert, the names vLLM's nemotron_h maps onto w13 / w2
    if fmt == "nvfp4_w4a4":  # one activation scale per layer and projection: every engine computes the same
        for j in range(1, 4):
            up = [k.replace(".0.up_proj.weight", f".{j}.up_proj.input_scale") for k in experts]
            assert all(t[u] == (F32, ()) for u in up)
    kv = [k for k in t if k.endswith((".k_proj.k_scale", ".v_proj.v_scale"))]
    assert kv == ([] if preset == "default" else ["backbone.layers.1.mixer.k_proj.k_scale",
                                                   "backbone.layers.1.mixer.v_proj.v_scale"])  # fmt: skip
    if preset == "nemotron-nano":  # attention and the Mamba layer feeding it (layer 0) stay bf16
        assert {"backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.q_proj"} <= excluded
        assert "backbone.layers.2.mixer.in_proj" in quantized
    model = load_quantized_model(out)
    small = extract_quantized_budget(out, "small", tmp_path / f"{fmt}-small")
    assert json.loads((small / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == ALGO[fmt]
    ids = torch.randint(0, CFG["vocab_size"], (1, 12))
    with torch.no_grad():
        dense, got = HybridLM.from_pretrained(nested)(ids).logits, model(ids).logits
    assert torch.isfinite(got).all() and (got - dense).norm() / dense.norm() < 0.5


def test_w4a4_activation_scales_cover_every_budget(nested, tmp_path):
    from model.elastic.build_masks import hard_mask
    from model.elastic.export import read_elastic
    from model.quant.checkpoint import calibrate_input_amax, synthetic_calibration_batches

    out = quantize_checkpoint(nested, tmp_path / "w4a4", "nvfp4_w4a4", calibrate_budgets=True)
    model, info = HybridLM.from_pretrained(nested), read_elastic(nested)
    batches = synthetic_calibration_batches(CFG["vocab_size"])
    t = load_quantized_model(out)
    for budget in info.budgets:
        mask = hard_mask(model.config, budget.architecture, info.depth_order, torch.device("cpu"))
        amax = calibrate_input_amax(model, batches, [mask], "default")
        for name, m in t.named_modules():
            if getattr(m, "input_scale", None) is not None and name in amax:
                assert float(m.input_scale) * 6 * 448 >= float(amax[name]) * (1 - 1e-6), (budget.name, name)

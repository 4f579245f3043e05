"""Quantized checkpoints: file layout, config, numerics against the unquantized model, presets, integrity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.checkpoint import WEIGHTS_NAME, CheckpointError, write_manifest
from model.config import HybridConfig
from model.elastic import Architecture, ElasticSpace, count_params
from model.elastic.budgets import BudgetSet
from model.elastic.export import export_nested
from model.hybrid import HybridLM
from model.moe import Experts
from model.quant import (
    QuantExperts,
    QuantLinear,
    bound_dequantized_caches,
    calibrate_input_amax,
    dense_copy_holders,
    dequantize_model,
    held_dense_bytes,
    load_quantized_model,
    quantize_checkpoint,
)

FORMATS = ["fp8", "nvfp4"]

# Every width and every budget width along an input dimension is a multiple of 16 (NVFP4 blocks),
# per group for grouped heads: 1 of 2 Mamba heads (head_dim 16) and 1 of 2 query heads per KV group.
NESTED = dict(
    vocab_size=64,
    hidden_size=32,
    pattern="M*ME-E",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=8,
    chunk_size=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
)
SPACE = dict(
    hidden=[32, 16],
    mamba_heads=[4, 2],
    attn_heads=[4, 2],
    mlp_ffn=[64, 32],
    moe_ffn=[32, 16],
    shared_ffn=[32, 16],
    experts=[4, 3, 2],
    depth=[6, 5],
)
ARCHS = {
    "full": {},
    "mid": {"moe_ffn": 16, "experts": 3, "mamba_heads": 2},
    "small": {
        "hidden": 16, "mlp_ffn": 32, "moe_ffn": 16, "shared_ffn": 16, "experts": 2, "attn_heads": 2,
        "mamba_heads": 2, "depth": 5,
    },
}  # fmt: skip
DEPTH_ORDER = [3, 0, 1, 2, 4, 5]  # depth 5 drops layer 3 (an MoE layer): later layers are renumbered


def tiny_parent(seed: int = 0, **changes) -> HybridLM:
    """A random parent with distinct router scores (a zero router makes top-k a tie-break)."""
    model = HybridLM(HybridConfig(**{**NESTED, **changes})).init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.model.layers:
            if block.kind == "moe":
                block.mixer.gate.weight.copy_(torch.randn(block.mixer.gate.weight.shape, generator=g) * 0.5)
                block.mixer.gate.e_score_correction_bias.copy_(torch.randn(4, generator=g) * 0.1)
    return model.eval()


def build_nested(
    path: Path,
    archs: dict | None = None,
    space: dict | None = None,
    seed: int = 0,
    extra_files: dict[str, Path] | None = None,
    **changes,
) -> Path:
    """Export a tiny nested checkpoint (budget fractions set to the exact active fractions)."""
    model = tiny_parent(seed, **changes)
    archs = {n: Architecture(**a) for n, a in (archs or ARCHS).items()}
    full = count_params(model.config).active
    fractions = {n: count_params(model.config, a, DEPTH_ORDER).active / full for n, a in archs.items()}
    return export_nested(
        model,
        archs,
        BudgetSet.of(fractions),
        ElasticSpace(**(space or SPACE)),
        path,
        depth_order=DEPTH_ORDER,
        extra_files=extra_files,
    )


def calib_batches(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]


def input_ids() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def nested(tmp_path_factory) -> Path:
    return build_nested(tmp_path_factory.mktemp("quant") / "nested")


@pytest.fixture(scope="module")
def quantized(nested) -> dict[str, Path]:
    return {fmt: quantize_checkpoint(nested, nested.parent / fmt, fmt, "default", calib_batches()) for fmt in FORMATS}


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / WEIGHTS_NAME), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


# ---------------------------------------------------------------------- layout
@pytest.mark.parametrize("fmt", FORMATS)
def test_keys_dtypes_shapes(quantized, fmt):
    t = file_tensors(quantized[fmt])
    fp8 = torch.float8_e4m3fn
    in_proj = "backbone.layers.0.mixer.in_proj"  # (2*64 + 2*2*8 + 4, 32) = (164, 32)
    if fmt == "fp8":
        assert t[f"{in_proj}.weight"].dtype == fp8 and t[f"{in_proj}.weight"].shape == (164, 32)
        assert t[f"{in_proj}.weight_scale"].dtype == torch.float32 and t[f"{in_proj}.weight_scale"].shape == ()
        assert t[f"{in_proj}.input_scale"].dtype == torch.float32 and t[f"{in_proj}.input_scale"].shape == ()
        assert f"{in_proj}.weight_scale_2" not in t
    else:
        assert t[f"{in_proj}.weight"].dtype == torch.uint8 and t[f"{in_proj}.weight"].shape == (164, 16)
        assert t[f"{in_proj}.weight_scale"].dtype == fp8 and t[f"{in_proj}.weight_scale"].shape == (164, 2)
        assert t[f"{in_proj}.weight_scale_2"].dtype == torch.float32 and t[f"{in_proj}.weight_scale_2"].shape == ()
        assert f"{in_proj}.input_scale" not in t
    # routed experts: per expert, each with its own scales; no stacked tensor left
    experts = "backbone.layers.3.mixer.experts"
    assert f"{experts}.up_proj" not in t and f"{experts}.down_proj" not in t
    for j in range(4):
        up, down = t[f"{experts}.{j}.up_proj.weight"], t[f"{experts}.{j}.down_proj.weight"]
        assert up.shape == ((32, 32) if fmt == "fp8" else (32, 16))  # (F, H) / packed (F, H/2)
        assert down.shape == ((32, 32) if fmt == "fp8" else (32, 16))  # (H, F) / packed (H, F/2)
        if fmt == "nvfp4":
            assert t[f"{experts}.{j}.up_proj.weight_scale"].shape == (32, 2)
            assert t[f"{experts}.{j}.down_proj.weight_scale_2"].shape == ()
        else:
            assert t[f"{experts}.{j}.down_proj.input_scale"].shape == ()
    global_scale = "weight_scale" if fmt == "fp8" else "weight_scale_2"
    scales = {t[f"{experts}.{j}.up_proj.{global_scale}"].item() for j in range(4)}
    assert len(scales) == 4  # one scale per expert
    # always high precision
    for key in ("lm_head.weight", "backbone.embeddings.weight", "backbone.norm_f.weight",
                "backbone.layers.3.mixer.gate.weight", "backbone.layers.0.norm.weight",
                "backbone.layers.0.mixer.conv1d.weight"):  # fmt: skip
        assert t[key].dtype == torch.float32, key
    assert "lm_head.weight_scale" not in t and "backbone.layers.3.mixer.gate.weight_scale" not in t


@pytest.mark.parametrize("fmt", FORMATS)
def test_config_and_manifest(nested, quantized, fmt):
    cfg = json.loads((quantized[fmt] / "config.json").read_text())
    src = json.loads((nested / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == {"fp8": "FP8", "nvfp4": "W4A16_NVFP4"}[fmt]
    group = qc["config_groups"]["group_0"]["weights"]
    assert group.get("group_size") == (16 if fmt == "nvfp4" else None) and "kv_cache_scheme" not in qc
    assert "lm_head" in qc["ignore"] and "backbone.layers.1.mixer.q_proj" in qc["ignore"]
    assert "backbone.layers.3.mixer.gate" in qc["ignore"] and "backbone.layers.0.mixer.in_proj" not in qc["ignore"]
    assert cfg["elastic"] == src["elastic"]
    manifest = json.loads((quantized[fmt] / "manifest.json").read_text())
    assert {"model.safetensors", "config.json"} <= set(manifest["files"])


# ---------------------------------------------------------------------- numerics
@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_close_to_unquantized(nested, quantized, fmt):
    ref_model = HybridLM.from_pretrained(nested)
    q = load_quantized_model(quantized[fmt])
    ids = input_ids()
    with torch.no_grad():
        ref, out = ref_model(ids).logits, q(ids).logits
    rel = ((out - ref).norm() / ref.norm()).item()
    # Random weights of a 32-wide model: fp8 ~6%, nvfp4 ~17% relative logit error (a single nvfp4
    # element is off by up to 1/12 of its block amax); the bounds leave margin over measured values.
    assert rel < {"fp8": 0.12, "nvfp4": 0.3}[fmt], rel
    assert isinstance(q.model.layers[0].mixer.in_proj, QuantLinear)
    assert isinstance(q.model.layers[3].mixer.experts, QuantExperts)
    assert isinstance(q.lm_head, torch.nn.Linear) and not isinstance(q.lm_head, QuantLinear)


def test_nvfp4_is_exactly_its_dequantized_weights(quantized):
    """Weight-only NVFP4: the quantized model computes what a dense model with the decoded weights computes."""
    q = load_quantized_model(quantized["nvfp4"])
    dense = dequantize_model(q)
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(q(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cached_and_on_the_fly_dequantization_agree(quantized, fmt):
    ids = input_ids()
    with torch.no_grad():
        a = load_quantized_model(quantized[fmt], cache_dequantized=True)(ids).logits
        b = load_quantized_model(quantized[fmt], cache_dequantized=False)(ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dense_copies_stay_within_their_memory_bound(quantized, fmt):
    """A bound on the dense copies: modules in layer order keep one while it lasts (experts included), the rest
    dequantize at every call; after a forward the copies held are what was allotted, within the bound, and
    the logits are those of dequantizing everything at every call."""
    ids = input_ids()
    model = load_quantized_model(quantized[fmt], cache_dequantized=True)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    sizes = [m.out_features * m.in_features * 4 for m in linears]
    bound = sum(sizes) // 2
    allotted = bound_dequantized_caches([model, model], bound, torch.float32)  # a model twice counts once
    kept = [m.cache_dequantized for m in linears]
    assert 0 < allotted <= bound and 0 < sum(kept) < len(linears)
    assert allotted == sum(n for n, k in zip(sizes, kept, strict=True) if k)
    first_off = kept.index(False)
    assert all(kept[:first_off])  # layer order, first come first served
    with torch.no_grad():
        out = model(ids).logits
        ref = load_quantized_model(quantized[fmt], cache_dequantized=False)(ids).logits
    assert torch.equal(out, ref)
    held = sum(m._dequant_cache.nbytes for m in linears if m._dequant_cache is not None)
    assert held == allotted
    assert bound_dequantized_caches([model], 0, torch.float32) == 0
    assert all(m._dequant_cache is None and not m.cache_dequantized for m in linears)


def test_the_holders_of_dense_copies_are_found_once_and_report_what_they_hold(quantized):
    """:func:`~model.quant.dense_copy_holders`: the modules a bound left a dense copy to, each once however many
    models share it, in layer order; :func:`~model.quant.held_dense_bytes`: what they hold, nothing before their
    first call, the allotted bytes after it."""
    model = load_quantized_model(quantized["fp8"], cache_dequantized=True)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    bound = sum(m.out_features * m.in_features * 4 for m in linears) // 2
    allotted = bound_dequantized_caches([model], bound, torch.float32)
    holders = dense_copy_holders([model, model])
    assert holders == [m for m in linears if m.cache_dequantized] and 0 < len(holders) < len(linears)
    assert held_dense_bytes(holders) == 0  # the copies are made at a module's first call
    with torch.no_grad():
        model(input_ids())
    assert held_dense_bytes(holders) == allotted
    assert dense_copy_holders([load_quantized_model(quantized["fp8"], cache_dequantized=False)]) == []


def test_bf16_compute(quantized):
    q32 = load_quantized_model(quantized["nvfp4"])
    q16 = load_quantized_model(quantized["nvfp4"], dtype=torch.bfloat16)
    assert q16.model.embeddings.weight.dtype == torch.bfloat16
    assert q16.model.layers[0].mixer.in_proj.weight.dtype == torch.uint8  # the format is kept
    ids = input_ids()
    with torch.no_grad():
        a, b = q32(ids).logits, q16(ids).logits.float()
    assert ((a - b).norm() / a.norm()).item() < 0.05


def test_quant_experts_match_dense_experts(quantized):
    """Same routing order and contract (ffn_mask, observer) as model.moe.Experts with the decoded weights."""
    q = load_quantized_model(quantized["fp8"])
    qe: QuantExperts = q.model.layers[3].mixer.experts
    for ex in qe:  # weights only: drop activation scales for an exact comparison
        ex.up_proj.input_scale = None
        ex.down_proj.input_scale = None
    dense = dequantize_model(q).model.layers[3].mixer.experts
    assert isinstance(dense, Experts)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 32, generator=g)
    idx = torch.randint(0, 4, (7, 2), generator=g)
    w = torch.rand(7, 2, generator=g)
    mask = (torch.arange(32) < 16).float()
    seen = []
    with torch.no_grad():
        y_q = qe(x, idx, w, mask, lambda i, ww, n: seen.append(n))
        y_d = dense(x, idx, w, mask, lambda i, ww, n: seen.append(n))
    # F.linear and x @ W.T may take different BLAS paths: equal up to float rounding, not bitwise
    torch.testing.assert_close(y_q, y_d, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(seen[0], seen[1], rtol=1e-6, atol=1e-9)
    assert seen[0].shape == (7, 2)


def test_calibration_records_input_amax(nested):
    model = HybridLM.from_pretrained(nested)
    ids = calib_batches(1)
    amax = calibrate_input_amax(model, ids)
    with torch.no_grad():
        h0 = model.model.layers[0].norm(model.model.embeddings(ids[0]))
    torch.testing.assert_close(amax["model.layers.0.mixer.in_proj"], h0.abs().max())
    # every token reaches top-k experts, so the largest per-expert up_proj amax is the MoE input's amax
    ups = torch.stack([amax[f"model.layers.3.mixer.experts.{j}.up_proj"] for j in range(4)])
    shared = amax["model.layers.3.mixer.shared_experts.up_proj"]  # sees every token of the same input
    torch.testing.assert_close(ups.max(), shared)
    assert len(set(ups.tolist())) > 1  # per expert, not one shared value


# ---------------------------------------------------------------------- presets
def _dense_and_quantized(folder: Path) -> tuple[set[str], set[str]]:
    t = file_tensors(folder)
    quant = {k[: -len(".weight_scale")] for k in t if k.endswith(".weight_scale")}
    dense = {k[: -len(".weight")] for k in t if k.endswith(".weight")} - quant
    return dense, quant


@pytest.mark.parametrize("preset", ["default", "conservative", "all"])
def test_presets(nested, tmp_path, preset):
    folder = quantize_checkpoint(nested, tmp_path / preset, "nvfp4", preset)
    dense, quant = _dense_and_quantized(folder)
    always = {
        "lm_head",
        "backbone.embeddings",
        "backbone.norm_f",
        "backbone.layers.3.mixer.gate",
        "backbone.layers.0.norm",
    }
    assert always <= dense
    attention = {f"backbone.layers.1.mixer.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    mamba = {"backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj"}
    ffn = {"backbone.layers.4.mixer.up_proj", "backbone.layers.3.mixer.shared_experts.down_proj",
           "backbone.layers.3.mixer.experts.0.up_proj", "backbone.layers.5.mixer.experts.3.down_proj"}  # fmt: skip
    assert ffn <= quant  # MLPs and experts are quantized by every preset
    assert (attention <= quant) == (preset == "all") and (attention <= dense) == (preset != "all")
    assert (mamba <= dense) == (preset == "conservative") and (mamba <= quant) == (preset != "conservative")
    assert load_quantized_model(folder) is not None


# ---------------------------------------------------------------------- integrity and refusals
def test_corrupt_file_detected(quantized, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(quantized["nvfp4"], bad)
    data = bytearray((bad / WEIGHTS_NAME).read_bytes())
    data[-100] ^= 0xFF
    (bad / WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_quantized_model(bad)


def test_missing_and_mistyped_tensors_rejected(quantized, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "missing"
    shutil.copytree(quantized["nvfp4"], bad)
    t = file_tensors(bad)
    del t["backbone.layers.3.mixer.experts.2.down_proj.weight_scale_2"]
    save_file(t, str(bad / WEIGHTS_NAME))
    write_manifest(bad)
    with pytest.raises(CheckpointError, match=r"missing tensors .*experts\.2\.down_proj\.weight_scale_2"):
        load_quantized_model(bad)
    t = file_tensors(quantized["nvfp4"])
    t["backbone.layers.0.mixer.out_proj.weight_scale"] = t["backbone.layers.0.mixer.out_proj.weight_scale"].float()
    save_file(t, str(bad / WEIGHTS_NAME))
    write_manifest(bad)
    with pytest.raises(CheckpointError, match="wrong dtype"):
        load_quantized_model(bad)


def test_refuses_requantizing_and_unquantized_loads(quantized, nested, tmp_path):
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(quantized["fp8"], tmp_path / "again", "nvfp4")
    with pytest.raises(CheckpointError, match="not a quantized checkpoint"):
        load_quantized_model(nested)
    with pytest.raises(ValueError, match="unknown format"):
        quantize_checkpoint(nested, tmp_path / "x", "int4")


def test_odd_widths_rejected_for_nvfp4_only(tmp_path):
    archs = {"full": {}, "odd": {"hidden": 24, "moe_ffn": 24}}
    space = {"hidden": [32, 24], "moe_ffn": [32, 24]}
    src = build_nested(tmp_path / "odd", archs, space)
    with pytest.raises(ValueError) as err:
        quantize_checkpoint(src, tmp_path / "q", "nvfp4")
    msg = str(err.value)
    assert "budget 'odd'" in msg and "hidden=24" in msg and "moe_ffn=24" in msg and "multiple of 16" in msg
    assert not (tmp_path / "q").exists()
    # FP8 scales are per tensor: any width nests
    assert load_quantized_model(quantize_checkpoint(src, tmp_path / "q8", "fp8", calib_batches=calib_batches(1)))

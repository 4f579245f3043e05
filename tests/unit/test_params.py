"""Analytic parameter counts == the extracted model's tensors; the expectation is exact and differentiable."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model.config import HybridConfig
from model.elastic import (
    LAYER_AXES,
    Architecture,
    count_params,
    expected_params,
    expected_sizes,
    extract,
    soft_mask,
)
from tests.unit.test_elastic_masks import SPACE, VARIANTS, draw_arch, parent

NANO_V3 = dict(
    vocab_size=131072,
    hidden_size=2688,
    pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    mamba_num_heads=64,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    n_routed_experts=128,
    num_experts_per_tok=6,
    moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712,
    use_bias=False,
    mlp_bias=False,
)


def active_from_tensors(model) -> float:
    """Count the extracted model's tensors, routed experts weighted top-k of E (independent of the formula)."""
    n = 0.0
    for name, p in model.named_parameters():
        if ".mixer.experts." in name:
            n += p.numel() * model.config.num_experts_per_tok / p.shape[0]
        else:
            n += p.numel()
    return n


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parent_count_equals_model(variant):
    model = parent(variant)
    count = count_params(model.config)
    assert count.total == model.num_parameters()
    assert count.active == active_from_tensors(model)
    assert count.active < count.total


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_count_equals_extracted_model(data):
    model = parent(data.draw(st.sampled_from(list(VARIANTS))))
    arch, order = draw_arch(data)
    small = extract(model, arch, order)
    count = count_params(model.config, arch, order)
    assert count.total == small.num_parameters()
    assert count.active == active_from_tensors(small)


def expectations_of(arch: Architecture, config: HybridConfig, per_layer: bool) -> dict[str, torch.Tensor]:
    """The architecture's sizes as float tensors (per-layer vectors when asked)."""
    res = arch.resolve(config)
    out = {"hidden": torch.tensor(float(res.hidden))}
    field = {"mamba_heads": "mamba_heads", "attn_heads": "attn_heads", "mlp_ffn": "ffn", "moe_ffn": "ffn"}
    field.update({"shared_ffn": "shared_ffn", "experts": "experts"})
    for axis, kind in LAYER_AXES.items():
        values = [float(getattr(la, field[axis])) for la in res.layers if la.kind == kind]
        if per_layer:
            out[axis] = torch.tensor(values)
        elif values and len(set(values)) == 1:
            out[axis] = torch.tensor(values[0])
    return out


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize(
    "arch",
    [
        Architecture(),
        Architecture(hidden=24, mamba_heads=4, attn_heads=2, mlp_ffn=16, moe_ffn=8, shared_ffn=24, experts=4),
        Architecture(hidden=40, experts=2, depth=5, layers={0: {"mamba_heads": 2}, 5: {"moe_ffn": 16}}),
    ],
)
def test_expected_params_at_integers_equals_count(arch, per_layer):
    cfg = parent("biased").config
    order = [6, 2, 4, 0, 1, 3, 5, 7]
    exp = expectations_of(arch, cfg, per_layer or bool(arch.layers))
    if arch.depth is not None:
        exp["depth"] = torch.tensor(float(arch.depth))
    total, active = expected_params(cfg, exp, order)
    count = count_params(cfg, arch, order)
    assert (total.item(), active.item()) == (count.total, count.active)
    # keep probabilities (the soft mask's gates) instead of an expected depth
    if arch.depth is not None:
        keep = soft_mask(cfg, {"depth": torch.eye(3)[SPACE.depth.index(arch.depth)]}, SPACE, order)
        exp["depth"] = torch.stack([lm.keep for lm in keep.layers])
        assert expected_params(cfg, exp, order)[0].item() == count.total


def test_expected_params_has_gradients():
    cfg = parent().config
    logits = {a: torch.randn(3, requires_grad=True) for a in SPACE.elastic_axes}
    probs = {a: torch.softmax(v, -1) for a, v in logits.items()}
    full = count_params(cfg)
    total, active = expected_params(cfg, expected_sizes(SPACE, probs))
    loss = (active / full.active - 0.6).abs() + (total / full.total - 0.6).abs()
    loss.backward()
    for a, v in logits.items():
        assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0, a
    # per-layer probabilities give per-layer expectations
    per = expected_sizes(SPACE, {"mamba_heads": torch.full((3, 3), 1 / 3)})
    assert per["mamba_heads"].shape == (3,) and torch.allclose(per["mamba_heads"], torch.full((3,), 4.0))


def test_expected_params_rejects_bad_shapes():
    cfg = parent().config
    with pytest.raises(ValueError, match=r"mamba_heads has shape \(2,\); expected a scalar or \(3,\)"):
        expected_params(cfg, {"mamba_heads": torch.ones(2)})
    with pytest.raises(ValueError, match="unknown axes"):
        expected_params(cfg, {"width": torch.ones(())})


def test_nano_v3_scale():
    """The reported parent: ~31.6B total, ~3.6B active (embeddings and lm_head included)."""
    cfg = HybridConfig(**NANO_V3)
    full = count_params(cfg)
    vocab = 2 * cfg.vocab_size * cfg.hidden_size
    print(
        f"\nNemotron Nano v3: total {full.total / 1e9:.3f}B, active {full.active / 1e9:.3f}B "
        f"(active without embedding + lm_head {(full.active - vocab) / 1e9:.3f}B)"
    )
    assert abs(full.total / 31.6e9 - 1) < 0.02
    assert abs(full.active / 3.6e9 - 1) < 0.02
    small = count_params(cfg, Architecture(hidden=2048, moe_ffn=1280, experts=96))
    print(
        f"hidden 2048, expert width 1280, 96 experts: total {small.total / 1e9:.3f}B, active {small.active / 1e9:.3f}B"
    )
    assert small.total < full.total and small.active < full.active
    total, active = expected_params(cfg, {"hidden": torch.tensor(2688.0)})
    assert (total.item(), active.item()) == full

"""KD loss and the router's budget loss: values, dead zone, pinning and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from model.elastic import Architecture, ElasticSpace, count_params
from model.elastic.budgets import BudgetSet
from model.elastic.losses import budget_loss, kd_loss, pin_loss
from model.elastic.router import BudgetRouter, RouterConfig

SPACE = ElasticSpace(hidden=[32, 24, 16], moe_ffn=[16, 8], experts=[4, 3], mamba_heads=[4, 2], per_layer=True)


def _one_hot_probs(arch: dict[str, int]) -> dict[str, torch.Tensor]:
    """One-hot probabilities selecting ``arch`` (axis -> candidate) on every axis of SPACE."""
    out = {}
    for axis in SPACE.elastic_axes:
        choices = SPACE.choices(axis)
        p = torch.zeros(len(choices))
        p[choices.index(arch.get(axis, choices[0]))] = 1.0
        out[axis] = p.requires_grad_()
    return out


# ---------------------------------------------------------------------- KD
def test_kd_zero_for_identical_logits():
    logits = torch.randn(2, 5, 11)
    assert kd_loss(logits, logits.clone()).item() == pytest.approx(0.0, abs=1e-6)
    assert kd_loss(logits.bfloat16(), logits.bfloat16()).dtype == torch.float32


def test_kd_matches_hand_computed_kl():
    teacher = torch.tensor([[[0.0, math.log(3.0)]]])  # p_t = [1/4, 3/4]
    student = torch.tensor([[[0.0, 0.0]]])  # p_s = [1/2, 1/2]
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert kd_loss(student, teacher).item() == pytest.approx(expected, rel=1e-6)
    # forward KL(teacher || student), not the reverse
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kd_loss(student, teacher).item() != pytest.approx(reverse, rel=1e-3)


def test_kd_masks_tokens_and_reaches_the_student():
    torch.manual_seed(0)
    teacher = torch.randn(2, 3, 7)
    student = torch.randn(2, 3, 7, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.bool)
    got = kd_loss(student, teacher, mask)
    per_token = torch.stack([kd_loss(student[b, t][None], teacher[b, t][None]) for b, t in [(0, 0), (0, 1), (1, 1)]])
    torch.testing.assert_close(got, per_token.mean())
    got.backward()
    assert student.grad[0, 2].abs().sum() == 0 and student.grad[0, 0].abs().sum() > 0
    assert kd_loss(student, teacher, torch.zeros(2, 3)).item() == 0.0
    with pytest.raises(ValueError, match="same shape"):
        kd_loss(student, teacher[..., :5])
    with pytest.raises(ValueError, match="loss_mask"):
        kd_loss(student, teacher, torch.ones(3, 2))


# ---------------------------------------------------------------------- budget loss
def test_budget_loss_zero_inside_dead_zone_positive_outside(tiny_config):
    arch = {"hidden": 24, "moe_ffn": 8, "experts": 3}
    frac = count_params(tiny_config, Architecture(**arch)).active / count_params(tiny_config).active
    probs = _one_hot_probs(arch)
    inside = budget_loss(tiny_config, SPACE, probs, target=frac * 1.03, is_full=False)
    assert inside.loss.item() == 0.0
    assert inside.expected_active.item() == pytest.approx(count_params(tiny_config, Architecture(**arch)).active)
    assert inside.expected_total.item() == pytest.approx(count_params(tiny_config, Architecture(**arch)).total)
    outside = budget_loss(tiny_config, SPACE, probs, target=frac * 1.3, is_full=False)
    assert outside.loss.item() == pytest.approx(abs(1 / 1.3 - 1), rel=1e-5)
    above = budget_loss(tiny_config, SPACE, probs, target=frac / 1.2, is_full=False)
    assert above.loss.item() == pytest.approx(0.2, rel=1e-5)


def test_expected_sizes_are_probability_weighted(tiny_config):
    probs = {"hidden": torch.tensor([0.5, 0.0, 0.5])}  # E[hidden] = 24
    out = budget_loss(tiny_config, SPACE, probs, 0.5, is_full=False)
    assert out.expected_active.item() == pytest.approx(count_params(tiny_config, Architecture(hidden=24)).active)


def test_pinning_only_for_the_full_budget(tiny_config):
    probs = _one_hot_probs({"hidden": 24})  # exactly on target below, so only the pin term can be non-zero
    frac = count_params(tiny_config, Architecture(hidden=24)).active / count_params(tiny_config).active
    plain = budget_loss(tiny_config, SPACE, probs, frac, is_full=False)
    pinned = budget_loss(tiny_config, SPACE, probs, frac, is_full=True, pin_weight=10.0)
    assert plain.loss.item() == 0.0 and plain.pin.item() == 0.0
    # hidden one-hot at index 1 vs target index 0: MSE = (1 + 1) / 3; other axes are at their largest
    assert pinned.pin.item() == pytest.approx(2 / 3)
    assert pinned.loss.item() == pytest.approx(10.0 * 2 / 3, rel=1e-6)
    full = budget_loss(tiny_config, SPACE, _one_hot_probs({}), 1.0, is_full=True)
    assert full.loss.item() == 0.0
    # per-layer probabilities: mean over rows and choices
    assert pin_loss({"experts": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}).item() == pytest.approx(0.5)


def test_budget_loss_gradients_reach_router(tiny_config):
    budgets = BudgetSet.of({"full": 1.0, "small": 0.5})
    for per_layer in (False, True):
        router = BudgetRouter(tiny_config, SPACE, budgets, RouterConfig(per_layer=per_layer))
        sample = router(budgets.one_hot("small"), step=0, total_steps=10)
        # a target far below the initial sample, so the loss lies outside the dead zone
        out = budget_loss(tiny_config, SPACE, sample.probs, 0.3, is_full=False)
        assert out.loss.item() > 0
        kd = torch.tensor(0.25, requires_grad=True)
        (kd + out.loss).backward()  # the training objective: KD + alpha * budget loss, alpha = 1
        grads = [p.grad for p in router.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert sum(g.abs().sum().item() for g in grads) > 0
        # the full budget's pin term alone also moves the router
        router.zero_grad()
        sample = router(budgets.one_hot("full"), step=0, total_steps=10)
        budget_loss(tiny_config, SPACE, sample.probs, 1.0, is_full=True).loss.backward()
        assert sum(p.grad.abs().sum().item() for p in router.parameters()) > 0


def test_budget_loss_rejects_bad_input(tiny_config):
    with pytest.raises(ValueError, match="target fraction"):
        budget_loss(tiny_config, SPACE, _one_hot_probs({}), 0.0, is_full=False)
    with pytest.raises(ValueError, match="not an elastic axis"):
        budget_loss(tiny_config, SPACE, {"attn_heads": torch.tensor([1.0, 0.0])}, 0.5, is_full=False)

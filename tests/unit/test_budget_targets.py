"""Budgets stated by total and / or active parameter targets: validation, the budget loss's terms, the
joint feasibility check, export's per-target check and the feasible selection."""

from __future__ import annotations

import json

import pytest
import torch

from model.config import HybridConfig
from model.elastic import Architecture, ElasticSpace, count_params, expected_params
from model.elastic.budgets import Budget, BudgetSet, list_architectures
from model.elastic.export import export_nested, read_elastic
from model.elastic.losses import budget_loss
from model.elastic.router import BudgetRouter
from model.hybrid import HybridLM
from tests.conftest import TINY
from tests.unit.test_params import NANO_V3

SPACE = ElasticSpace(hidden=[32, 24, 16], moe_ffn=[16, 8], experts=[4, 3, 2])


def _fractions(cfg: HybridConfig, arch: Architecture) -> tuple[float, float]:
    c, full = count_params(cfg, arch), count_params(cfg)
    return c.total / full.total, c.active / full.active


def _one_hot(arch: dict[str, int], space: ElasticSpace = SPACE) -> dict[str, torch.Tensor]:
    out = {}
    for axis in space.elastic_axes:
        choices = space.choices(axis)
        p = torch.zeros(len(choices))
        p[choices.index(arch.get(axis, choices[0]))] = 1.0
        out[axis] = p
    return out


# ---------------------------------------------------------------------- budgets
def test_budget_targets_and_the_older_fraction_field():
    assert Budget(name="a", fraction=0.5).targets == {"active": 0.5}
    assert Budget(name="a", total=0.4, active=0.6).targets == {"total": 0.4, "active": 0.6}
    assert Budget(name="a", total=0.4).fraction == 0.4
    assert Budget.model_validate({"name": "a", "fraction": 0.6, "active": 0.6}).active == 0.6
    with pytest.raises(ValueError, match="states no target"):
        Budget(name="a")
    with pytest.raises(ValueError, match="disagrees with 'active'"):
        Budget(name="a", fraction=0.5, active=0.6)
    with pytest.raises(ValueError):
        Budget(name="a", total=1.2)


def test_budget_set_order_keys_and_round_trip():
    bs = BudgetSet(
        budgets=[
            Budget(name="s", total=0.38, active=0.56),
            Budget(name="full", fraction=1.0),
            Budget(name="m", total=0.73, active=0.78),
        ]
    )
    assert bs.names == ["full", "m", "s"]
    assert bs.key_kind == "active" and bs.fractions == [1.0, 0.78, 0.56]
    assert bs.full.targets == {"total": 1.0, "active": 1.0}  # the parent meets both
    assert BudgetSet.model_validate(json.loads(bs.model_dump_json())) == bs
    # total targets only: ordered and interpolated by the total target
    by_total = BudgetSet.of_targets({"full": {"total": 1.0}, "s": {"total": 0.4}, "m": {"total": 0.7}})
    assert by_total.key_kind == "total" and by_total.names == ["full", "m", "s"]
    torch.testing.assert_close(by_total.encode(0.55), torch.tensor([0.0, 0.5, 0.5]))
    # a budget with an active target only and one with a total target only cannot be ordered
    with pytest.raises(ValueError, match="every budget must state an active target, or every budget a total"):
        BudgetSet.of_targets({"full": {"active": 1.0}, "a": {"active": 0.5}, "t": {"total": 0.6}})
    with pytest.raises(ValueError, match="larger total target"):
        BudgetSet.of_targets(
            {"full": {"active": 1.0}, "m": {"total": 0.5, "active": 0.8}, "s": {"total": 0.6, "active": 0.5}}
        )
    with pytest.raises(ValueError, match="every target 1.0"):
        BudgetSet.of_targets({"full": {"total": 0.9, "active": 1.0}, "s": {"active": 0.5}})


def test_check_reachable_refuses_contradictory_targets(tiny_config):
    # 16 hidden channels and 2 experts: a low total; a high active target needs wide hidden -> no overlap
    small_t, small_a = _fractions(tiny_config, Architecture(hidden=16, moe_ffn=8, experts=2))
    ok = BudgetSet.of_targets({"full": {"active": 1.0}, "s": {"total": small_t, "active": small_a}})
    assert ok.check_reachable(tiny_config, SPACE) == pytest.approx(small_a)
    bad = BudgetSet.of_targets({"full": {"active": 1.0}, "s": {"total": small_t, "active": 0.9}})
    with pytest.raises(ValueError, match=r"budget 's' \(total 0\.\d+, active 0\.9\): no architecture.*the nearest"):
        bad.check_reachable(tiny_config, SPACE)
    low = BudgetSet.of_targets({"full": {"active": 1.0}, "s": {"total": small_t / 1.2, "active": small_a}})
    with pytest.raises(ValueError, match=r"budget 's' \(total target 0\.\d+\) cannot be reached.*total fraction"):
        low.check_reachable(tiny_config, SPACE)


def test_list_architectures():
    archs = list_architectures(SPACE)
    assert len(archs) == 3 * 2 * 3 and Architecture(hidden=16, moe_ffn=8, experts=2) in archs
    assert list_architectures(SPACE, limit=10) is None


# ---------------------------------------------------------------------- budget loss
def test_budget_loss_has_one_term_per_stated_target(tiny_config):
    arch = {"hidden": 24, "moe_ffn": 8, "experts": 3}
    t, a = _fractions(tiny_config, Architecture(**arch))
    probs = _one_hot(arch)
    # active on target, total 20% above its target: only the total term, |1.2 - 1| = 0.2
    out = budget_loss(tiny_config, SPACE, probs, Budget(name="b", total=t / 1.2, active=a), is_full=False)
    assert out.loss.item() == pytest.approx(0.2, rel=1e-6)
    assert out.ratios["total"].item() == pytest.approx(1.2) and out.ratios["active"].item() == pytest.approx(1.0)
    assert out.ratio.item() == pytest.approx(1.0)  # the key's (active) ratio
    # both off: the terms add, |1/1.3 - 1| + |1/0.8 - 1|
    both = budget_loss(tiny_config, SPACE, probs, Budget(name="b", total=t * 1.3, active=a * 0.8), is_full=False)
    assert both.loss.item() == pytest.approx((1 - 1 / 1.3) + (1 / 0.8 - 1), rel=1e-6)
    # inside the dead zone on both: zero
    inside = budget_loss(tiny_config, SPACE, probs, Budget(name="b", total=t * 1.04, active=a / 1.04), is_full=False)
    assert inside.loss.item() == 0.0
    # total target only
    only_total = budget_loss(tiny_config, SPACE, probs, Budget(name="b", total=t / 1.5), is_full=False)
    assert set(only_total.ratios) == {"total"} and only_total.loss.item() == pytest.approx(0.5, rel=1e-6)


def test_full_budget_has_no_dead_zone(tiny_config):
    # half 4 experts, half 3: E[experts] = 3.5; counts are linear in the expert count, so the expected
    # fractions are the midpoints between the parent (1.0) and the 3-expert architecture
    t3, a3 = _fractions(tiny_config, Architecture(experts=3))
    t, a = (1 + t3) / 2, (1 + a3) / 2
    assert 0.95 < t < 1.0 and 0.95 < a < 1.0
    probs = {**_one_hot({}), "experts": torch.tensor([0.5, 0.5, 0.0])}
    full = budget_loss(tiny_config, SPACE, probs, Budget(name="full", total=1.0, active=1.0), is_full=True)
    other = budget_loss(tiny_config, SPACE, probs, Budget(name="x", total=1.0, active=1.0), is_full=False)
    assert other.loss.item() == 0.0  # inside the dead zone for any budget but the full one
    # pin MSE of (0.5, 0.5, 0) against (1, 0, 0): (0.25 + 0.25) / 3
    assert full.pin.item() == pytest.approx(0.5 / 3)
    assert full.loss.item() == pytest.approx((1 - t) + (1 - a) + 10 * 0.5 / 3, rel=1e-6)


def test_total_target_gives_the_experts_axis_its_gradient():
    """On the real parent's shape the active count barely depends on the expert count; a total target does."""
    cfg = HybridConfig(**NANO_V3)
    space = ElasticSpace(hidden=[2688, 2304, 2048, 1792], moe_ffn=[1856, 1536, 1280, 1024], experts=[128, 96, 64])

    def experts_grad(budget: Budget) -> float:
        logits = torch.zeros(3, requires_grad=True)
        probs = {
            "hidden": torch.tensor([0.0, 0.0, 0.0, 1.0]),
            "moe_ffn": torch.tensor([0.0, 0.0, 0.0, 1.0]),
            "experts": torch.softmax(logits, -1),
        }
        budget_loss(cfg, space, probs, budget, is_full=False).loss.backward()
        return logits.grad.abs().sum().item()

    active_only = experts_grad(Budget(name="s", active=0.3))
    with_total = experts_grad(Budget(name="s", total=0.2, active=0.3))
    assert with_total > 50 * active_only > 0


def test_grouped_expected_params_equal_the_per_layer_sum():
    cfg = HybridConfig(**NANO_V3)
    g = torch.Generator().manual_seed(0)
    for depth in (None, torch.tensor(49.3, dtype=torch.float64), torch.rand(52, generator=g, dtype=torch.float64)):
        expected = {
            "hidden": torch.tensor(2011.7, dtype=torch.float64),
            "moe_ffn": torch.tensor(1300.2, dtype=torch.float64),
            "experts": torch.tensor(101.9, dtype=torch.float64),
            "mamba_heads": torch.tensor(56.0, dtype=torch.float64),
        }
        if depth is not None:
            expected["depth"] = depth
        fast = expected_params(cfg, expected)
        slow = expected_params(cfg, expected, by_layer=True)
        for f, s in zip(fast, slow, strict=True):
            assert f.item() == pytest.approx(s.item(), rel=1e-12)


# ---------------------------------------------------------------------- export and selection
@pytest.fixture(scope="module")
def parent() -> HybridLM:
    return HybridLM(HybridConfig(**TINY)).init_weights(3).eval()


def test_export_checks_every_stated_target(parent, tmp_path):
    cfg = parent.config
    mid = Architecture(hidden=24, moe_ffn=8, experts=3)
    t, a = _fractions(cfg, mid)
    archs = {"full": Architecture(), "mid": mid}
    good = BudgetSet.of_targets({"full": {"active": 1.0}, "mid": {"total": round(t, 4), "active": round(a, 4)}})
    path = export_nested(parent, archs, good, SPACE, tmp_path / "good")
    info = read_elastic(path)
    m = info.budget("mid")
    assert (m.total_target, m.active_target) == (round(t, 4), round(a, 4))
    assert m.total_fraction == pytest.approx(t) and m.active_fraction == pytest.approx(a)
    assert info.budget("full").total_target == 1.0
    assert info.budget_set == good
    # active on target, total target 10% below what the architecture has: refused, naming the total
    bad = BudgetSet.of_targets({"full": {"active": 1.0}, "mid": {"total": round(t / 1.1, 4), "active": round(a, 4)}})
    with pytest.raises(ValueError, match=r"budget 'mid': total fraction 0\.\d+ is 10\.\d% off the target"):
        export_nested(parent, archs, bad, SPACE, tmp_path / "bad")


def test_elastic_sections_from_before_two_targets_still_read(parent, tmp_path):
    archs = {"full": Architecture(), "mid": Architecture(hidden=24)}
    a = round(_fractions(parent.config, archs["mid"])[1], 4)
    path = export_nested(parent, archs, BudgetSet.of({"full": 1.0, "mid": a}), SPACE, tmp_path / "n")
    raw = json.loads((path / "config.json").read_text())
    for b in raw["elastic"]["budgets"]:  # the older layout: only "fraction" (the active target)
        for key in ("total_target", "active_target", "total_fraction"):
            b.pop(key)
    (path / "config.json").write_text(json.dumps(raw))
    info = read_elastic(path)
    assert info.budget("mid").active_target == a and info.budget("mid").total_target is None
    assert info.budget("mid").total_fraction == pytest.approx(_fractions(parent.config, archs["mid"])[0])
    assert info.budget_set.fractions == [1.0, a]


def test_feasible_selection_meets_both_targets(parent):
    cfg = parent.config
    target = Architecture(hidden=16, moe_ffn=16, experts=2)
    t, a = _fractions(cfg, target)
    budgets = BudgetSet.of_targets({"full": {"active": 1.0}, "s": {"total": t, "active": a}})
    router = BudgetRouter(cfg, SPACE, budgets)
    chosen = router.architectures(budgets, select="feasible")["s"]
    ct, ca = _fractions(cfg, chosen)
    assert abs(ct / t - 1) <= 0.05 and abs(ca / a - 1) <= 0.05
    # an active target alone admits architectures whose total is far from t
    loose = [x for x in list_architectures(SPACE) if abs(_fractions(cfg, x)[1] / a - 1) <= 0.05]
    assert any(abs(_fractions(cfg, x)[0] / t - 1) > 0.05 for x in loose)

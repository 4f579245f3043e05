"""Budget sets and the budget router: encodings, schedules, sampling, determinism, argmax architectures."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import HybridConfig
from model.elastic import ElasticSpace, count_params, soft_mask
from model.elastic.budgets import Budget, BudgetSet, UnknownBudgetError, smallest_active_fraction
from model.elastic.router import BudgetRouter, RouterConfig
from tests.conftest import TINY_SPACE


@pytest.fixture
def space() -> ElasticSpace:
    return ElasticSpace(**TINY_SPACE, per_layer=True)


@pytest.fixture
def budgets() -> BudgetSet:
    return BudgetSet.of({"small": 0.5, "full": 1.0, "mid": 0.75})


# ---------------------------------------------------------------------- budgets
def test_budget_set_sorted_and_validated(budgets):
    assert budgets.names == ["full", "mid", "small"]
    assert budgets.fractions == [1.0, 0.75, 0.5]
    assert budgets.full.name == "full" and budgets.index("small") == 2
    with pytest.raises(ValueError, match="full model"):
        BudgetSet.of({"a": 0.9, "b": 0.5})
    with pytest.raises(ValueError, match="unique"):
        BudgetSet(budgets=[Budget(name="a", fraction=1.0), Budget(name="a", fraction=0.5)])
    with pytest.raises(ValueError, match="share the active target"):
        BudgetSet.of({"a": 1.0, "b": 0.5, "c": 0.5})
    with pytest.raises(ValueError):
        Budget(name="x", fraction=1.5)
    with pytest.raises(ValueError):
        BudgetSet(budgets=[Budget(name="full", fraction=1.0)], extra=1)


def test_unknown_budget_lists_valid_names(budgets):
    with pytest.raises(UnknownBudgetError, match=r"valid budgets \['full', 'mid', 'small'\]"):
        budgets.index("tiny")
    with pytest.raises(KeyError):
        budgets.one_hot("tiny")


def test_one_hot_and_interpolated_encoding(budgets):
    assert budgets.one_hot("mid").tolist() == [0.0, 1.0, 0.0]
    assert budgets.encode(0.75).tolist() == [0.0, 1.0, 0.0]
    assert budgets.encode(1.0).tolist() == [1.0, 0.0, 0.0]
    torch.testing.assert_close(budgets.encode(0.6), torch.tensor([0.0, 0.4, 0.6]))
    torch.testing.assert_close(budgets.encode(0.875), torch.tensor([0.5, 0.5, 0.0]))
    assert math.isclose(budgets.encode(0.55).sum().item(), 1.0, rel_tol=1e-6)
    with pytest.raises(ValueError, match="outside the trained range"):
        budgets.encode(0.4)
    with pytest.raises(ValueError, match="outside the trained range"):
        budgets.encode(1.2)


def test_check_reachable(tiny_config, space):
    smallest = smallest_active_fraction(tiny_config, space)
    assert 0.0 < smallest < 1.0
    ok = BudgetSet.of({"full": 1.0, "edge": smallest / 1.04})  # inside the 5% dead zone
    assert ok.check_reachable(tiny_config, space) == pytest.approx(smallest)
    bad = BudgetSet.of({"full": 1.0, "tiny": smallest / 1.2})
    with pytest.raises(ValueError, match=r"budget 'tiny' \(active target 0\.\d+\).*active fraction 0\.\d+"):
        bad.check_reachable(tiny_config, space)


# ---------------------------------------------------------------------- schedules
def test_tau_and_scale_hit_their_endpoints(tiny_config, space, budgets):
    r = BudgetRouter(tiny_config, space, budgets, RouterConfig(tau_start=1.0, tau_end=0.05))
    assert r.tau(0, 1000) == pytest.approx(1.0)
    assert r.tau(1000, 1000) == pytest.approx(0.05)
    assert r.tau(500, 1000) == pytest.approx(math.sqrt(0.05))  # geometric
    decay = (0.05 / 1.0) ** (1 / 1000)
    assert r.tau(137, 1000) == pytest.approx(decay**137)
    assert r.scale(0, 1000) == pytest.approx(1.0)
    assert r.scale(1000, 1000) == pytest.approx(10.0)
    assert r.scale(500, 1000) == pytest.approx(5.5)
    assert r.tau(5000, 1000) == pytest.approx(0.05) and r.scale(5000, 1000) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        RouterConfig(tau_start=0.1, tau_end=1.0)


# ---------------------------------------------------------------------- sampling
@pytest.mark.parametrize("per_layer", [False, True])
def test_probs_sum_to_one_and_feed_soft_mask(tiny_config, space, budgets, per_layer):
    r = BudgetRouter(tiny_config, space, budgets, RouterConfig(per_layer=per_layer))
    sample = r(budgets.one_hot("mid"), step=10, total_steps=100)
    kinds = tiny_config.layer_kinds
    for axis, p in sample.probs.items():
        n = len(space.choices(axis))
        if per_layer and axis not in ("hidden", "depth"):
            kind = {"mamba_heads": "mamba", "attn_heads": "attention", "mlp_ffn": "mlp"}.get(axis, "moe")
            assert p.shape == (kinds.count(kind), n)
        else:
            assert p.shape == (n,)
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]))
        assert (p >= 0).all()
    soft_mask(tiny_config, sample.probs, space)  # shapes are what the mask builder expects


def test_sampling_is_deterministic_given_the_generator(tiny_config, space, budgets):
    r = BudgetRouter(tiny_config, space, budgets)
    x = budgets.one_hot("small")
    a = r(x, 3, 100, generator=torch.Generator().manual_seed(7))
    b = r(x, 3, 100, generator=torch.Generator().manual_seed(7))
    c = r(x, 3, 100, generator=torch.Generator().manual_seed(8))
    for axis in a.probs:
        assert torch.equal(a.probs[axis], b.probs[axis])
    assert any(not torch.equal(a.probs[k], c.probs[k]) for k in a.probs)
    # default generator: a function of (seed, step) only, identical on every worker
    r2 = BudgetRouter(tiny_config, space, budgets)
    d, e = r(x, 5, 100), r2(x, 5, 100)
    assert all(torch.equal(d.probs[k], e.probs[k]) for k in d.probs)
    f = r(x, 6, 100)
    assert any(not torch.equal(d.probs[k], f.probs[k]) for k in d.probs)


def test_hard_samples_are_one_hot_with_straight_through_gradient(tiny_config, space, budgets):
    r = BudgetRouter(tiny_config, space, budgets, RouterConfig(hard_sample_prob=1.0))
    sample = r(budgets.one_hot("mid"), 0, 100)
    assert sample.hard
    for p in sample.probs.values():
        assert set(p.detach().unique().tolist()) <= {0.0, 1.0}
        assert p.detach().sum().item() == 1.0
    # a loss that depends on the non-chosen entries too: only the relaxed path carries gradient
    w = {k: torch.arange(1.0, p.shape[-1] + 1) for k, p in sample.probs.items()}
    loss = sum((p * w[k]).sum() for k, p in sample.probs.items())
    loss.backward()
    grads = [p.grad for p in r.parameters()]
    assert all(g is not None for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0
    assert not r(budgets.one_hot("mid"), 0, 100, hard=False).hard
    never = BudgetRouter(tiny_config, space, budgets, RouterConfig(hard_sample_prob=0.0))
    assert not never(budgets.one_hot("mid"), 0, 100).hard
    assert never(budgets.one_hot("mid"), 0, 100, hard=True).hard


# ---------------------------------------------------------------------- initialisation and argmax
def test_initialisation_full_near_largest_small_spread(tiny_config, space, budgets):
    r = BudgetRouter(tiny_config, space, budgets)
    full = r.logits(budgets.one_hot("full"))
    small = r.logits(budgets.one_hot("small"))
    for axis in r.axes:
        p_full = torch.softmax(full[axis], -1)
        assert p_full[0].item() == pytest.approx(0.9, abs=0.02)
        p_small = torch.softmax(small[axis], -1)
        assert p_small.argmax().item() == len(space.choices(axis)) - 1  # smallest leans to smallest
        assert p_small.max().item() < 0.7  # but stays spread
    # the init is (nearly: up to the small random units) linear in the input
    mix = r.logits(budgets.encode(0.875))
    mid = r.logits(budgets.one_hot("mid"))
    for axis in r.axes:
        torch.testing.assert_close(mix[axis], 0.5 * (full[axis] + mid[axis]), atol=1e-2, rtol=0)


def test_argmax_architectures(tiny_config, space, budgets):
    r = BudgetRouter(tiny_config, space, budgets)
    archs = r.architectures()
    assert list(archs) == ["full", "mid", "small"]
    assert archs["full"].resolve(tiny_config).hidden == tiny_config.hidden_size
    assert count_params(tiny_config, archs["full"]) == count_params(tiny_config)
    assert archs == r.architectures(budgets)  # deterministic
    assert archs["small"].hidden == 16 and archs["small"].experts == 3


def test_per_layer_argmax_gives_layer_overrides(tiny_config, space, budgets):
    r = BudgetRouter(tiny_config, space, budgets, RouterConfig(per_layer=True))
    with torch.no_grad():  # make the first MoE layer choose the larger expert width for every budget
        head = r.heads["moe_ffn"][-1].weight  # (2 rows * 2 choices, hidden)
        head[0, : len(budgets)] = 10.0
    arch = r.argmax_arch(budgets.one_hot("small"))
    moe_layers = [i for i, k in enumerate(tiny_config.layer_kinds) if k == "moe"]
    assert arch.moe_ffn is None
    assert arch.layers[moe_layers[0]].moe_ffn == 16 and arch.layers[moe_layers[1]].moe_ffn == 8
    arch.validate(tiny_config, space)
    with pytest.raises(ValueError, match="per_layer"):
        BudgetRouter(tiny_config, ElasticSpace(**TINY_SPACE), budgets, RouterConfig(per_layer=True))


def test_axes_without_layers_get_no_head(budgets):
    cfg = HybridConfig(vocab_size=32, hidden_size=16, pattern="M*E", moe_intermediate_size=16, head_dim=4)
    space = ElasticSpace(hidden=[16, 8], mlp_ffn=[256, 128])
    r = BudgetRouter(cfg, space, budgets)
    assert r.axes == ["hidden"]
    with pytest.raises(ValueError, match="shape"):
        r(torch.ones(2), 0, 10)

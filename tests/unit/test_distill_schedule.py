"""The router schedule across both phases, budgets per micro-batch, and the per-rank router noise."""

from __future__ import annotations

import json
import math

import pytest
import torch

from components.distill.config import DistillConfig, with_router_schedule
from components.distill.draws import draw_budget, draw_hard_sample, router_generator
from components.distill.worker import deepspeed_config
from model.elastic import ElasticSpace
from model.elastic.budgets import BudgetSet
from model.elastic.router import BudgetRouter, RouterConfig


def _config(**changes) -> DistillConfig:
    base = {
        "teacher_uri": "parent",
        "output_dir": "out",
        "space": ElasticSpace(hidden=[32, 24]),
        "budgets": [{"name": "full", "fraction": 1.0}, {"name": "small", "total": 0.6, "active": 0.8}],
        "budget_probs": [0.6, 0.4],
    }
    return DistillConfig(**{**base, **changes})


# ---------------------------------------------------------------------- one schedule over both phases
def test_schedule_position():
    rc = RouterConfig()
    assert rc.schedule_at(0, 100) == (0, 100) and rc.schedule_at(99, 100) == (99, 100)
    cont = RouterConfig(step_offset=100, schedule_steps=140)
    assert cont.schedule_at(0, 40) == (100, 140) and cont.schedule_at(39, 40) == (139, 140)
    assert RouterConfig(step_offset=100).schedule_at(5, 40) == (105, 140)


def test_phase_two_continues_phase_one_anneal(tmp_path, tiny_config):
    p1 = with_router_schedule(_config(steps=640))
    assert (p1.router.step_offset, p1.router.schedule_steps) == (0, 640)
    init = tmp_path / "phase1"
    init.mkdir()
    (init / "distill.json").write_text(json.dumps({"steps": p1.steps, "router": p1.router.model_dump(mode="json")}))
    p2 = with_router_schedule(_config(phase=2, steps=240, init_from=str(init)))
    assert (p2.router.step_offset, p2.router.schedule_steps) == (640, 640)

    space = ElasticSpace(hidden=[32, 24, 16])
    router = BudgetRouter(tiny_config, space, BudgetSet.of({"full": 1.0, "s": 0.5}))
    last_p1 = router.tau(*p1.router.schedule_at(p1.steps - 1, p1.steps))
    first_p2 = router.tau(*p2.router.schedule_at(0, p2.steps))
    assert last_p1 == pytest.approx(0.05 ** (639 / 640))
    assert first_p2 == pytest.approx(0.05) and router.scale(*p2.router.schedule_at(0, p2.steps)) == 10.0

    # a schedule that spans both phases: 640 + 240 steps
    span = with_router_schedule(_config(steps=640, router={"schedule_steps": 880}))
    (init / "distill.json").write_text(json.dumps({"steps": 640, "router": span.router.model_dump(mode="json")}))
    p2 = with_router_schedule(_config(phase=2, steps=240, init_from=str(init)))
    assert (p2.router.step_offset, p2.router.schedule_steps) == (640, 880)
    assert router.tau(*span.router.schedule_at(639, 640)) == pytest.approx(0.05 ** (639 / 880))
    assert router.tau(*p2.router.schedule_at(0, 240)) == pytest.approx(0.05 ** (640 / 880))
    assert router.tau(*p2.router.schedule_at(240, 240)) == pytest.approx(0.05)
    assert router.scale(*p2.router.schedule_at(120, 240)) == pytest.approx(1 + 9 * 760 / 880)

    # explicit values win; an older phase-1 output without the fields continues from its own steps
    explicit = with_router_schedule(_config(phase=2, steps=240, init_from=str(init), router={"step_offset": 7}))
    assert explicit.router.step_offset == 7 and explicit.router.schedule_steps == 880
    (init / "distill.json").write_text(json.dumps({"steps": 500, "router": {"hidden": 128}}))
    old = with_router_schedule(_config(phase=2, steps=240, init_from=str(init)))
    assert (old.router.step_offset, old.router.schedule_steps) == (500, 500)
    (init / "distill.json").unlink()
    with pytest.raises(FileNotFoundError, match="router.step_offset"):
        with_router_schedule(_config(phase=2, steps=240, init_from=str(init)))


# ---------------------------------------------------------------------- budgets per micro-batch
def test_budget_draws_per_micro_batch():
    probs = [1 / 3, 1 / 3, 1 / 3]
    draws = [[draw_budget(0, 1, step, probs, micro) for micro in range(4)] for step in range(200)]
    # a pure function of (seed, phase, step, micro): what every rank computes
    assert draws == [[draw_budget(0, 1, step, probs, micro) for micro in range(4)] for step in range(200)]
    mixed = sum(len(set(row)) > 1 for row in draws)
    assert mixed > 150  # P(4 uniform draws from 3 agree) = 1/27: most updates mix budgets
    counts = torch.bincount(torch.tensor(draws).flatten(), minlength=3).tolist()
    assert all(abs(c / 800 - 1 / 3) < 0.06 for c in counts)
    skewed = [draw_budget(1, 2, s, [0.5, 0.3, 0.2], m) for s in range(500) for m in range(2)]
    assert abs(skewed.count(0) / 1000 - 0.5) < 0.05 and abs(skewed.count(2) / 1000 - 0.2) < 0.04


def test_router_noise_per_rank_and_shared_hard_coin():
    def noise(g: torch.Generator) -> torch.Tensor:
        return torch.rand(8, generator=g)

    same = noise(router_generator(0, 1, 5, micro=1, rank=2))
    assert torch.equal(same, noise(router_generator(0, 1, 5, micro=1, rank=2)))
    assert not torch.equal(same, noise(router_generator(0, 1, 5, micro=1, rank=3)))
    assert not torch.equal(same, noise(router_generator(0, 1, 5, micro=0, rank=2)))
    shared = noise(router_generator(0, 1, 5))
    assert torch.equal(shared, noise(router_generator(0, 1, 5)))
    coins = [draw_hard_sample(0, 1, s, m, 0.1) for s in range(1000) for m in range(2)]
    assert abs(sum(coins) / 2000 - 0.1) < 0.025
    assert not any(draw_hard_sample(0, 1, s, 0, 0.0) for s in range(100))


def test_deepspeed_accumulates_micro_batches():
    ds = deepspeed_config(_config(micro_batch_size=2, grad_accum_steps=3), world_size=4)
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 2 * 4 * 3 and ds["train_micro_batch_size_per_gpu"] == 2
    assert deepspeed_config(_config(), world_size=2)["gradient_accumulation_steps"] == 1
    with pytest.raises(ValueError):
        _config(grad_accum_steps=0)
    assert math.isclose(sum(_config().sampling_probs), 1.0)

"""Distillation config: the evaluate stage's held-out problems never enter training."""

from __future__ import annotations

from components.data import ProblemConfig, eval_prompts, generate_eval_sets
from components.distill.config import DistillConfig
from model.elastic import ElasticSpace


def _config(**changes) -> DistillConfig:
    base = {
        "teacher_uri": "parent",
        "output_dir": "out",
        "space": ElasticSpace(hidden=[64, 48]),
        "budgets": [{"name": "full", "fraction": 1.0}, {"name": "small", "fraction": 0.8}],
        "data": ProblemConfig(max_steps=2),
    }
    return DistillConfig(**{**base, **changes})


def test_excluded_prompts_cover_the_evaluate_stage_problems():
    excluded = _config().excluded_prompts()
    evaluated = eval_prompts(generate_eval_sets([1, 2, 3, 4, 5, 6], 30, 0))  # the demo evaluate stage's sets
    assert excluded is not None and evaluated <= excluded
    assert _config(exclude_eval_per_level=0).excluded_prompts() is None
    assert _config(exclude_eval_levels=[]).excluded_prompts() is None
    assert _config(exclude_eval_levels=[1]).excluded_prompts() < excluded

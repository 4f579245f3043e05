"""The baseline comparisons' accounting: standard errors, FLOPs of the elastic run and of the separate
runs, the step allocation at equal tokens / equal compute, nested problem counts, and the long-problem
ablation config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.baselines_common import (
    binomial_se,
    difference,
    elastic_flops,
    flops_per_token,
    nested_accuracy,
    steps_for_flops,
    steps_for_tokens,
)
from components.data import TextTokenizer
from components.distill.config import DistillConfig
from components.evaluate import EvalConfig, problem_sets
from components.lm_eval import task_accuracy
from model.hybrid import HybridLM
from pipelines.config import load_pipeline_config
from pipelines.runner import PipelineRunner
from pipelines.stages import pipeline_stages

REPO = Path(__file__).resolve().parents[2]
DEMO_PARENT = REPO / "pipelines" / "assets" / "demo-parent"


def _phase(**fields) -> DistillConfig:
    base = {
        "teacher_uri": "/nonexistent/teacher",
        "output_dir": "/nonexistent/out",
        "space": {"hidden": [64, 32]},
        "budgets": [{"name": "full", "fraction": 1.0}, {"name": "half", "fraction": 0.5}],
    }
    return DistillConfig(**{**base, **fields})


def test_binomial_standard_error():
    assert binomial_se(126, 180) == pytest.approx(math.sqrt(0.7 * 0.3 / 180))  # 0.034156
    assert binomial_se(126, 180) == pytest.approx(0.0341565, abs=1e-6)
    assert binomial_se(300, 600) == pytest.approx(0.0204124, abs=1e-6)
    assert binomial_se(0, 50) == 0.0
    with pytest.raises(ValueError, match="n must be"):
        binomial_se(0, 0)


def test_difference_uses_the_unpaired_error():
    a = {"accuracy": 0.7, "se": 0.03}
    b = {"accuracy": 0.6, "se": 0.04}
    d = difference(a, b)
    assert d["diff"] == pytest.approx(0.1) and d["se"] == pytest.approx(0.05)


def test_flops_of_the_elastic_run_full_width_and_as_drawn():
    # 4 steps x 2 micro-batches x (2 rows x 1 worker x 8 tokens) = 128 tokens
    cfg = _phase(steps=4, micro_batch_size=2, num_workers=1, grad_accum_steps=2, seq_len=8, budget_probs=[0.0, 1.0])
    (ph,) = elastic_flops([cfg], 100, [100, 40])
    assert ph["tokens"] == 128
    assert ph["full_width"] == 128 * (2 * 100 + 6 * 100)  # 102,400
    assert ph["drawn"] == 128 * (2 * 100 + 6 * 40)  # every draw is the half budget: 56,320
    assert flops_per_token(185_160, 99_846) == 969_396  # 370,320 + 599,076


def test_separate_steps_at_equal_tokens_and_equal_compute():
    cfg = _phase(steps=100, micro_batch_size=16, num_workers=2, seq_len=64)  # 2,048 tokens per update
    assert steps_for_tokens(2048 * 30, cfg) == 30
    assert steps_for_tokens(10, cfg) == 1  # at least one step
    # 2,048 tokens x (2 x 1000 + 6 x 500) = 10,240,000 FLOPs per step
    assert steps_for_flops(10_240_000 * 12, cfg, 1000, 500) == 12
    assert steps_for_flops(10_240_000 * 12.4, cfg, 1000, 500) == 12
    # a smaller student gets more steps for the same FLOPs: 2,048 x 3,200 = 6,553,600 per step
    assert steps_for_flops(10_240_000 * 12, cfg, 1000, 200) == 19


def test_nested_accuracy_counts_prefixes_like_scoring_them_whole():
    tok = TextTokenizer.load(DEMO_PARENT)
    model = HybridLM.from_pretrained(DEMO_PARENT).eval()
    sets = problem_sets(EvalConfig(checkpoint_uri=str(DEMO_PARENT), output_dir="/tmp/x", levels=[2, 5], n_per_level=4))
    out = nested_accuracy(model, tok, sets, [2, 4], 96)
    assert list(out) == ["4", "8"]
    first = [p for items in sets.values() for p in items[:2]]
    every = [p for items in sets.values() for p in items]
    assert out["4"]["correct"] == task_accuracy(model, tok, first, max_new_tokens=96).correct
    assert out["8"]["correct"] == task_accuracy(model, tok, every, max_new_tokens=96).correct
    assert out["8"]["n"] == 8 and out["8"]["se"] == pytest.approx(binomial_se(out["8"]["correct"], 8))


def test_long_ablation_config_trains_short_then_long_and_scores_long(tmp_path):
    cfg = load_pipeline_config(REPO / "pipelines" / "configs" / "demo-long.yaml", [f"runs_dir={tmp_path}"])
    configs = PipelineRunner(pipeline_stages(), cfg, cfg.run_dir).build_configs()
    p1, p2, ev = configs["distill_phase1"], configs["distill_phase2"], configs["evaluate"]
    (s1,), (s2,) = p1.data.sources, p2.data.sources
    assert (s1.min_steps, s1.max_steps, p1.seq_len) == (1, 3, 40)
    assert (s2.min_steps, s2.max_steps, p2.seq_len) == (4, 6, 64)
    assert ev.levels == [4, 5, 6] and min(ev.levels) > s1.max_steps
    # the evaluated problems never enter training in either phase
    for p in (p1, p2):
        assert set(ev.levels) <= set(p.exclude_eval_levels) and p.exclude_eval_per_level >= ev.n_per_level

"""Distillation config: the evaluate stage's held-out problems never enter training."""

from __future__ import annotations

from components.data import DataConfig, FilesSource, GeneratorSource, eval_prompts, generate_eval_sets
from components.distill.config import DistillConfig
from model.elastic import ElasticSpace


def _config(**changes) -> DistillConfig:
    base = {
        "teacher_uri": "parent",
        "output_dir": "out",
        "space": ElasticSpace(hidden=[64, 48]),
        "budgets": [{"name": "full", "fraction": 1.0}, {"name": "small", "fraction": 0.8}],
        "data": DataConfig(sources=[GeneratorSource(max_steps=2)]),
    }
    return DistillConfig(**{**base, **changes})


def test_excluded_prompts_cover_the_evaluate_stage_problems():
    excluded = _config().excluded_prompts()
    evaluated = eval_prompts(generate_eval_sets([1, 2, 3, 4, 5, 6], 30, 0))  # the demo evaluate stage's sets
    assert excluded is not None and evaluated <= excluded
    assert _config(exclude_eval_per_level=0).excluded_prompts() is None
    assert _config(exclude_eval_levels=[]).excluded_prompts() is None
    assert _config(exclude_eval_levels=[1]).excluded_prompts() < excluded


def test_excluded_prompts_only_come_from_generator_sources():
    files = DataConfig(sources=[FilesSource(paths=["rows.jsonl"], format="chat")])
    assert _config(data=files).excluded_prompts() is None
    mixed = DataConfig(sources=[FilesSource(paths=["rows.jsonl"], weight=0.3), GeneratorSource(weight=0.7)])
    assert _config(data=mixed).excluded_prompts() == _config().excluded_prompts()


def test_data_section_reads_from_yaml_shapes():
    cfg = _config(data={"sources": [{"type": "generator", "max_steps": 8}], "pack": False})
    assert isinstance(cfg.data.sources[0], GeneratorSource) and cfg.data.sources[0].max_steps == 8
